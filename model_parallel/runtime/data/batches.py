"""Minibatches keyed by (seed, step): deterministic synthetic data, or a real ImageFolder (a user's
Dataset, iterable, DataLoader or token file: `runtime.data.sources`).

A dataset here is anything with `batch(step) -> (inputs: tuple[Tensor, ...], target: Tensor)`; the
same step gives the same minibatch on every process and after a resume, which is what makes pipeline
runs comparable with single-process runs, and what lets two stages read the same step on their own:
stage 0 reads the inputs, the last stage the targets (`sources.read_targets`: an optional, cheaper
`targets(step)`, else `batch(step)`'s target), and no target travels between stages.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch

from model_parallel.errors import DataError, ModelParallelError
from model_parallel.runtime.data.sources import seeded_generator as _generator, token_data


class Dataset(Protocol):
    batch_size: int

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]: ...


@dataclass(frozen=True)
class SyntheticData:
    """Random minibatches: `kind` "dense" (float inputs of `shape`, class targets) or "tokens"
    (int64 ids of `shape` = (seq_len,), next-token-style int64 targets of the same shape)."""

    batch_size: int
    shape: tuple[int, ...]
    num_classes: int = 10
    kind: str = "dense"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ModelParallelError(f"batch size must be >= 1, got {self.batch_size}")
        if self.kind not in ("dense", "tokens"):
            raise ModelParallelError(f"synthetic data kind must be 'dense' or 'tokens', got {self.kind!r}")

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        gen = _generator(self.seed, step)
        if self.kind == "tokens":
            x = torch.randint(self.num_classes, (self.batch_size, *self.shape), generator=gen)
            y = torch.randint(self.num_classes, (self.batch_size, *self.shape), generator=gen)
            return (x,), y
        x = torch.randn((self.batch_size, *self.shape), generator=gen)
        y = torch.randint(self.num_classes, (self.batch_size,), generator=gen)
        return (x,), y


class ImageFolderData:
    """A torchvision ImageFolder (`root/<class>/<image>`), resized to `image_size`, shuffled per
    epoch by (seed, epoch); step s reads samples [s*B, (s+1)*B) of that order (wrapping epochs)."""

    def __init__(self, root: Union[str, "os.PathLike[str]"], batch_size: int, image_size: int = 32, seed: int = 0) -> None:
        from model_parallel.compat import import_torchvision

        torchvision = import_torchvision()
        from torchvision import transforms

        if not os.path.isdir(root):
            raise ModelParallelError(f"--data {root}: not a directory (expected an ImageFolder: root/<class>/<image files>)")
        transform = transforms.Compose([
            transforms.Resize(image_size), transforms.CenterCrop(image_size), transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ])
        try:
            self.dataset = torchvision.datasets.ImageFolder(str(root), transform=transform)
        except (FileNotFoundError, RuntimeError) as error:
            raise ModelParallelError(f"--data {root}: cannot read an ImageFolder: {error}") from None
        self.batch_size, self.seed, self.root = batch_size, seed, root
        self.num_classes = len(self.dataset.classes)
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {epoch: torch.randperm(len(self.dataset), generator=_generator(self.seed, -1 - epoch))}
        return self._orders[epoch]

    def _sample(self, index: int) -> tuple[torch.Tensor, int]:
        try:
            return self.dataset[index]
        except (OSError, ValueError, RuntimeError, SyntaxError) as error:
            # PIL raises UnidentifiedImageError (an OSError) for a corrupt or truncated file, and
            # SyntaxError/ValueError from some decoders: name the file, not a traceback from PIL.
            path = self.dataset.samples[index][0]
            raise DataError(f"{path}: cannot decode this image ({type(error).__name__}: {str(error)[:120]}); "
                            f"replace or delete it (it is sample {index} of the ImageFolder --data {self.root})") from None

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        n = len(self.dataset)
        images, labels = [], []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            image, label = self._sample(int(self._order(i // n)[i % n]))
            images.append(image)
            labels.append(label)
        return (torch.stack(images),), torch.tensor(labels, dtype=torch.int64)

    def targets(self, step: int) -> torch.Tensor:
        """`batch(step)`'s labels without decoding an image (the last stage's read): ImageFolder lists them."""
        n, labels = len(self.dataset), self.dataset.targets
        return torch.tensor([labels[int(self._order(i // n)[i % n])]
                             for i in range(step * self.batch_size, (step + 1) * self.batch_size)], dtype=torch.int64)


def split_microbatches(inputs: Sequence[Any], target: torch.Tensor, num_microbatches: int,
                       where: str = "a minibatch") -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """Split a minibatch along dim 0 into `num_microbatches` parts (sizes differ by at most one); a dict
    input (`{"input_ids": ..., "attention_mask": ...}`) splits into dicts of the same keys."""
    _check_batch_sizes(inputs, target, where)
    parts_t = split_targets(target, num_microbatches)
    parts_in = [_split(x, num_microbatches) for x in inputs]
    return [(tuple(p[j] for p in parts_in), parts_t[j]) for j in range(num_microbatches)]


def _check_batch_sizes(inputs: Sequence[Any], target: torch.Tensor, where: str) -> None:
    """Every input tensor holds as many samples (dim 0) as the target: the split pairs part j of each, so a
    target of another size would pair samples wrongly, or broadcast against the output in the loss (a
    warning from torch, and a wrong loss) instead of failing."""
    if not isinstance(target, torch.Tensor) or target.dim() == 0:
        return
    want = target.shape[0]
    for name, value in _named_tensors(inputs):
        if value.dim() == 0 or value.shape[0] != want:
            size = "a scalar" if value.dim() == 0 else f"{value.shape[0]} samples (shape {tuple(value.shape)})"
            raise DataError(f"{where}: input {name} holds {size} but its target {want} (shape "
                            f"{tuple(target.shape)}); microbatches split every tensor along dim 0, so inputs and target "
                            "must hold the same samples: fix the data source's batch (or its collate_fn)")


def _named_tensors(inputs: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    named: list[tuple[str, torch.Tensor]] = []
    for i, value in enumerate(inputs):
        items = value.items() if isinstance(value, Mapping) else [(None, value)]
        named += [(f"{key!r}" if key is not None else f"#{i}", x) for key, x in items if isinstance(x, torch.Tensor)]
    return named


def split_targets(target: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """A minibatch's target split along dim 0 as `split_microbatches` splits it: the last stage's share of the
    data (part j is the target of the microbatch j that stage 0 sends)."""
    batch = target.shape[0]
    if batch < num_microbatches:
        raise ModelParallelError(f"a minibatch of {batch} samples cannot be split into {num_microbatches} microbatches; "
                                 "raise --batch_size or lower --num_microbatches")
    return list(torch.tensor_split(target, num_microbatches))


def minibatch_parts(inputs: Any, target: torch.Tensor, num_microbatches: int,
                    where: str = "a minibatch") -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """`split_microbatches` of a dataset's inputs: a tuple of positional inputs, or one dict of keyword inputs."""
    return split_microbatches([inputs] if isinstance(inputs, Mapping) else list(inputs), target, num_microbatches, where)


def stage_zero_inputs(graph_inputs: Sequence[Any], inputs: Any, mb_inputs: Sequence[Any],
                      where: str = "a minibatch") -> list[Any]:
    """Stage 0's model inputs for one microbatch: positional inputs as they are; keyword inputs in the
    order of the graph's placeholders (`graph_inputs`: `graph.metadata["inputs"]`, as the profiler traced them)."""
    if not isinstance(inputs, Mapping):
        return list(mb_inputs)
    kwargs = mb_inputs[0]
    names = [i["name"] for i in graph_inputs if isinstance(i, Mapping) and "name" in i]
    if sorted(names) != sorted(kwargs):
        if set(names) & set(kwargs):
            # The placeholders are named after the traced keys, so these keys are not the traced ones. In the dict's
            # order they fed the wrong slots: token_type_ids where attention_mask was traced trained silently, and a
            # missing key failed as "forward() missing 1 required positional argument".
            missing, unexpected = sorted(set(names) - set(kwargs)), sorted(set(kwargs) - set(names))
            raise DataError(f"{where}: its keyword inputs {sorted(kwargs)} are not those the model was traced with "
                            f"{names} (missing {missing or 'none'}, unexpected {unexpected or 'none'}); the trace fixed "
                            "the model's inputs, so every minibatch must hold the same keys: give each batch those "
                            "keys, or trace with the ones your batches hold (example_inputs)")
        return list(kwargs.values())  # no record of the placeholders: the dict's order (how flat_inputs traced it)
    return [kwargs[name] for name in names]


def _split(value: Any, parts: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, parts))
    if isinstance(value, Mapping):
        split = {key: _split(v, parts) for key, v in value.items()}
        return [{key: split[key][j] for key in value} for j in range(parts)]
    return [value] * parts


def make_dataset(spec: str, batch_size: int, seed: int, *, shape: tuple[int, ...], num_classes: int, kind: str = "dense",
                 image_size: int = 32, prefetch: Optional[int] = None, seq_len: Optional[int] = None,
                 token_dtype: str = "uint16", vocab: Optional[int] = None) -> Any:
    """`spec` is "synthetic", "tokens:PATH" (a flat token file, windows of `seq_len`, default the model's
    input length; `runtime.data.sources.token_data`) or an ImageFolder directory. `prefetch` batches are prepared
    ahead on a background thread (`runtime.data.prefetch.Prefetcher`; 0: none); default 2 for files (decoding
    images costs as much as a stage's compute) and 0 for synthetic data (a few random numbers). `vocab`: the model's
    vocabulary size, which a token file's ids must stay below (None: unchecked)."""
    if spec == "synthetic":
        dataset: Any = SyntheticData(batch_size, tuple(shape), num_classes, kind, seed)
        depth = 0 if prefetch is None else prefetch
    elif spec.startswith("tokens:"):
        length = seq_len or (shape[-1] if shape else 0)
        if not length:
            raise DataError(f"--data {spec}: the model records no sequence length; give --seq_len N")
        if shape and kind == "tokens" and length != shape[-1]:
            # The graph was traced at its input length: other lengths would fail deep inside a stage.
            raise DataError(f"--data {spec}: --seq_len {length} differs from the model's input length {shape[-1]} "
                            f"(as traced); give --seq_len {shape[-1]}, or profile the model at length {length}")
        dataset = token_data(spec[len("tokens:"):], length, batch_size, seed, token_dtype, vocab)
        depth = 2 if prefetch is None else prefetch
    else:
        dataset = ImageFolderData(spec, batch_size, image_size, seed)
        depth = 2 if prefetch is None else prefetch
    if depth:
        from model_parallel.runtime.data.prefetch import Prefetcher

        return Prefetcher(dataset, depth=depth)
    return dataset
