"""What a checkpoint records of its data, and whether a resume reads the same data (training_record.py asks).

    describe_data(dataset)    "tokens:train.bin (1429 samples)", "Toks (64 samples)", "synthetic dense": the record's "data"
    data_content(dataset)     its contents' fingerprint (the record's "data_content"), or None
    data_change(stored, current)   None: the same data; else why not ("" where only the descriptions tell)

A description names the data but says nothing of its contents: the same file given by another path was
refused as other data, and another file under the same name, or another Dataset of the same length, was
accepted. So the record also holds a fingerprint of the contents, cheap for a multi-GB file and the same on
every rank, computed once per source:

- a token file: its size and a sha256 of SAMPLED_BLOCKS fixed blocks of BLOCK bytes (the first, the last,
  evenly spaced between). Never the whole file: a resume must not read gigabytes before its first step, so
  a change that touches no sampled block goes unseen.
- a map-style Dataset: its length and a sha256 of samples 0, n//2 and n-1 as collated (not the shuffled
  order: that follows from the seed, a field of its own). They are read under fixed seeds, the training's
  random state kept, so a random augmentation reads the same on resume; samples that still differ when read
  twice (state in the dataset) record none, rather than refusing every resume (`data/draws.keyed_draws(0)`, under
  the lock a prefetch thread's read holds too).
- an ImageFolder: its image list (paths relative to the root, and classes), not the pixels.
- an iterable (a DataLoader with a sampler of its own, an IterableDataset): its first minibatch of a fresh
  pass; a user's batch(step) object: its batch(0). All there is to read without a length: enough to tell two
  hosts' different copies apart, not a change past the first minibatch.
Synthetic data records none and is compared by description (its description, batch size and seed are all it is).

Where both records hold a fingerprint, it alone decides (the path spelled otherwise is the same data). A
checkpoint written before it was recorded is compared by description, a token file by its file name and
sample count (its path was the directory it ran from), with one warning that its contents cannot be verified.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Optional

from model_parallel.runtime.data.draws import keyed_draws

logger = logging.getLogger(__name__)

BLOCK = 64 * 1024
SAMPLED_BLOCKS = 8
HEX = 16  # hex digits of a sha256 kept: 64 bits tell two data sets apart, and a message stays readable
_TOKENS = re.compile(r"^tokens:(.*) \((\d+) samples\)$")
_computed: dict[int, tuple[Any, Optional[dict[str, Any]]]] = {}  # id(source) -> (weakref to it, fingerprint)


def unwrap(dataset: Any) -> Any:
    """The source under a Prefetcher and a user's batch(step) object's check (what describes the data)."""
    from model_parallel.runtime.data.prefetch import Prefetcher
    from model_parallel.runtime.data.sources import BatchSource

    if isinstance(dataset, Prefetcher):
        dataset = dataset.dataset
    if isinstance(dataset, BatchSource):  # a user's batch(step) object, checked: named by its own type
        dataset = dataset.source
    return dataset


def describe_data(dataset: Any) -> str:
    """A short, stable name of a data source: "synthetic dense", "tokens:PATH (N samples)", a directory, a type."""
    from model_parallel.runtime.data.batches import ImageFolderData, SyntheticData
    from model_parallel.runtime.data.sources import IterableData, MapData

    dataset = unwrap(dataset)
    if isinstance(dataset, SyntheticData):
        return f"synthetic {dataset.kind}"
    if isinstance(dataset, ImageFolderData):
        return str(dataset.root)
    if isinstance(dataset, MapData):
        return f"{dataset.name} ({len(dataset.dataset)} samples)"
    if isinstance(dataset, IterableData):
        return dataset.name
    return type(dataset).__name__


def data_content(dataset: Any) -> Optional[dict[str, Any]]:
    """The fingerprint of the source's contents (JSON), or None where it has none; computed once per source
    (a checkpoint records it every time, and the data does not change under a run)."""
    source = unwrap(dataset)
    known = _computed.get(id(source))
    if known is not None and known[0]() is source:
        return known[1]
    try:
        content = _content(source)
    except Exception as error:  # noqa: BLE001 - unreadable here: not recorded, so compared by description
        logger.warning("the data's contents cannot be read on this rank (%s: %s): the other ranks' copies are not "
                       "compared with it, and a resume compares the data by its name only",
                       type(error).__name__, str(error)[:200])
        content = None
    try:
        _computed[id(source)] = (weakref.ref(source), content)
    except TypeError:  # not weakly referable: computed again next time
        pass
    return content


def _content(source: Any) -> Optional[dict[str, Any]]:
    from model_parallel.runtime.data.batches import ImageFolderData
    from model_parallel.runtime.data.sources import IterableData, MapData, TokenWindows

    if isinstance(source, MapData) and isinstance(source.dataset, TokenWindows):
        return {"kind": "token file", "samples": len(source.dataset), **token_file_content(source.dataset.path)}
    if isinstance(source, MapData):
        return _samples_content(source)
    if isinstance(source, ImageFolderData):
        root = os.fspath(source.root)
        listed = [[os.path.relpath(path, root), int(label)] for path, label in source.dataset.samples]
        return {"kind": "image folder", "samples": len(listed), "sha256 of the image list": _sha(repr(listed).encode())}
    if isinstance(source, IterableData):
        return _first_step_content("iterable", source.opening)
    if not type(source).__module__.startswith("model_parallel.") and callable(getattr(source, "batch", None)):
        return _first_step_content("batch(step) object", lambda: source.batch(0))
    return None


def _first_step_content(kind: str, read: Callable[[], Any]) -> Optional[dict[str, Any]]:
    """An iterable's or a batch(step) object's first minibatch, hashed: all there is to read without a length or
    indices. Enough to tell two hosts' different copies apart (a pass, or step 0, is the same on every rank that
    reads the data); a change past the first minibatch goes unseen."""
    digest = _stable_digest(read, "its first minibatch")
    return None if digest is None else {"kind": kind, "sha256 of the first minibatch": digest}


def _stable_digest(read: Callable[[], Any], what: str) -> Optional[str]:
    """The sha256 (HEX digits) of what `read` returns, read twice under fixed seeds; None where the two reads differ
    (state in the data: no fingerprint, rather than refusing every resume)."""
    readings = []
    for _ in range(2):
        with keyed_draws(0):  # fixed seeds, the training's random state kept
            digest = hashlib.sha256()
            _feed(digest, read())
            readings.append(digest.hexdigest()[:HEX])
    if readings[0] != readings[1]:
        logger.debug("the data's contents not recorded: %s differ between two reads", what)
        return None
    return readings[0]


def token_file_content(path: str) -> dict[str, Any]:
    """A token file's size and the sha256 of its sampled blocks (SAMPLED_BLOCKS * BLOCK bytes read at most)."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    last = max(size - BLOCK, 0)
    offsets = sorted({last * i // (SAMPLED_BLOCKS - 1) for i in range(SAMPLED_BLOCKS)})
    with open(path, "rb") as file:
        for offset in offsets:
            file.seek(offset)
            digest.update(file.read(BLOCK))
    return {"bytes": size, "sha256 of sampled blocks": digest.hexdigest()[:HEX]}


def _samples_content(source: Any) -> Optional[dict[str, Any]]:
    size = len(source.dataset)
    indices = sorted({0, size // 2, size - 1})
    digest = _stable_digest(lambda: source.collate_fn([source.dataset[i] for i in indices]), f"samples {indices}")
    if digest is None:
        return None
    return {"kind": "dataset", "samples": size, f"sha256 of samples {', '.join(map(str, indices))}": digest}


def _feed(digest: Any, value: Any) -> None:
    """Hash a collated sample: tensors and arrays by dtype, shape and bytes; containers in order (a dict by key)."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(f"array {value.dtype} {value.shape};".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(f"key {key!r};".encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} {len(value)};".encode())
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (str, bytes, int, float, bool)):
        digest.update(f"{value!r};".encode())
    else:  # an object whose repr may hold its address: its type only, so that reading it twice agrees
        digest.update(f"object {type(value).__qualname__};".encode())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:HEX]


def data_change(stored: Mapping[str, Any], current: Mapping[str, Any]) -> Optional[str]:
    """None where `current` reads the data `stored` records; else what differs ("" where the descriptions tell it)."""
    old, new = stored.get("data_content"), current.get("data_content")
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        if old == new:
            return None
        if old.get("kind") != new.get("kind"):
            return f"the data was a {old.get('kind')}, now a {new.get('kind')}"
        differing = [f"{key} {old.get(key)} -> {new.get(key)}" for key in sorted(set(old) | set(new))
                     if key != "kind" and old.get(key) != new.get(key)]
        return f"the {old.get('kind')}'s contents differ: {'; '.join(differing)}"
    return None if _by_name(stored.get("data")) == _by_name(current.get("data")) else ""


def _by_name(description: Any) -> Any:
    # Without a fingerprint on both sides, a token file is its file name and sample count: the path was relative
    # to wherever the run started.
    match = _TOKENS.match(description) if isinstance(description, str) else None
    return (os.path.basename(match.group(1)), match.group(2)) if match else description


def unverified(stored: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """Whether `current` has a fingerprint the checkpoint's record lacks (written before it was recorded)."""
    return "data_content" not in stored and isinstance(current.get("data_content"), Mapping)
