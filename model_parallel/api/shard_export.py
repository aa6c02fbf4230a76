"""save_pretrained from the ranks: each rank writes its own stage's tensors as safetensors shards, rank 0 the index.

    trainer.save_pretrained("out/")     # every rank together; no rank ever holds more than its own stage

What transformers' own `save_pretrained` writes, for a model no single process holds:
1. each rank names its tensors - [key, dtype, shape, bytes] - in the original model's names, a tied tensor under
   the key transformers keeps (`remove_tied_weights_from_state_dict` on the model built on meta), as JSON;
2. every rank derives the same layout from those lists: a tensor is written by the lowest rank holding it (replica
   0; one holder of a tie split across stages), each rank's tensors cut into shards of at most `max_shard_size` in
   the model's key order, numbered rank by rank: `model-0000k-of-0000N.safetensors` (`model.safetensors` if N is 1);
3. rank 0 makes a temporary directory beside the target and says its name; each rank writes its shards there with
   safetensors' writer (metadata {"format": "pt"});
4. every rank's verdict (`agree`): on success rank 0 writes config.json (+ generation_config.json), the index
   (`metadata.total_size`, `total_parameters`) and moves the files into place; a failure anywhere raises
   `CheckpointError` on every rank, naming the ranks that failed and why (a refusal every rank makes alike, such as
   a model that is not a Hugging Face one, is that error itself, a `ConfigError`).
"""
from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from model_parallel.api.hf_directory import INDEX_NAME, make_staging, move_into_place
from model_parallel.errors import CheckpointError, ConfigError, ModelParallelError
from model_parallel.graph.core import STATE_ALIASES, Graph

logger = logging.getLogger(__name__)

__all__ = ["save_pretrained_sharded", "TensorEntry", "shard_layout", "hf_kept_keys"]



@dataclass(frozen=True)
class TensorEntry:
    """One tensor a rank holds, as the ranks tell each other: its Hugging Face key, dtype, shape and bytes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Shard:
    """One file of the export: its name, the rank that writes it and the keys in it."""

    filename: str
    rank: int
    keys: tuple[str, ...]


def hf_kept_keys(target: Any) -> dict[str, str]:
    """Every state-dict key of `target` (a PreTrainedModel, on meta) -> the key transformers stores it under:
    itself, or for a tied tensor the one key `save_pretrained` keeps (`remove_tied_weights_from_state_dict`)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = target.state_dict()
    ignored = set(getattr(target, "_keys_to_ignore_on_save", None) or ())
    kept = remove_tied_weights_from_state_dict({k: v for k, v in state.items() if k not in ignored}, target)
    by_object: dict[int, str] = {}
    for key in kept:
        by_object[id(target.get_parameter_or_buffer(key))] = key
    return {key: by_object[id(target.get_parameter_or_buffer(key))] for key in state if key not in ignored}


def local_tensors(graph: Graph, stage_state: Mapping[str, torch.Tensor], kept: Mapping[str, str],
                  model: Any, rank: int) -> dict[str, torch.Tensor]:
    """This rank's tensors by the key transformers stores them under; rank 0 also the model's keys no graph node
    owns (buffers forward never reads: not trained, so the model's own values, refused when it holds none)."""
    from model_parallel.codegen.naming import original_state_from_stage, state_key_map

    out: dict[str, torch.Tensor] = {}
    for key, value in original_state_from_stage(graph, stage_state).items():
        if key not in kept:
            raise ConfigError(f"the trained stage holds {key!r}, which the {type(model).__name__} does not; was the "
                              "graph profiled from another model? Profile this model again")
        out.setdefault(kept[key], value.detach())
    owned = {kept[k] for k in [*state_key_map(graph), *(graph.metadata.get(STATE_ALIASES) or {})] if k in kept}
    unowned = [key for key in dict.fromkeys(kept.values()) if key not in owned]
    if unowned:  # every rank checks, so a refusal is the same everywhere
        from model_parallel.api.export import refuse_unfilled

        reference = model.state_dict()
        refuse_unfilled(model, unowned, reference)
        if rank == 0:
            out.update({key: reference[key].detach() for key in unowned})
    return out


def entries_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    return [TensorEntry(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), v.numel() * v.element_size())
            for k, v in tensors.items()]


def shard_layout(order: Sequence[str], entries: Sequence[Sequence[TensorEntry]], max_shard_size: int,
                 expected: Mapping[str, tuple[int, ...]]) -> list[Shard]:
    """The files of the export, the same on every rank: `entries[r]` is what rank r holds; `order` the keys
    transformers stores, in the model's order; `expected` their shapes. A key is written by the lowest rank
    holding it; a rank's keys are cut greedily (a tensor above the limit alone), ranks' shards numbered in order."""
    holder: dict[str, TensorEntry] = {}
    owner: dict[str, int] = {}
    for rank, listed in enumerate(entries):
        for entry in listed:
            if entry.key not in expected:
                raise CheckpointError(f"rank {rank} holds {entry.key!r}, which the model does not store")
            if tuple(entry.shape) != tuple(expected[entry.key]):
                raise CheckpointError(f"rank {rank} holds {entry.key!r} as {list(entry.shape)}, the model has "
                                      f"{list(expected[entry.key])}; is the config the one the model was built from?")
            if entry.key not in owner:
                owner[entry.key], holder[entry.key] = rank, entry
    missing = [key for key in order if key not in owner]
    if missing:
        raise CheckpointError(f"no rank holds {len(missing)} tensor(s) of the model, e.g. {missing[:3]}: the stages "
                              "do not cover the model; was the graph traced from another model or config?")
    groups: list[tuple[int, list[str]]] = []
    for rank in range(len(entries)):
        size = 0
        for key in (k for k in order if owner[k] == rank):
            nbytes = holder[key].nbytes
            if not groups or groups[-1][0] != rank or (size + nbytes > max_shard_size and groups[-1][1]):
                groups.append((rank, []))
                size = 0
            groups[-1][1].append(key)
            size += nbytes
    total = len(groups)
    name = (lambda i: "model.safetensors") if total == 1 else (lambda i: f"model-{i + 1:05d}-of-{total:05d}.safetensors")
    return [Shard(name(i), rank, tuple(keys)) for i, (rank, keys) in enumerate(groups)]


def parse_shard_size(value: Union[int, str]) -> int:
    """`max_shard_size` in bytes: an int or a size such as "500MB" (huggingface_hub's reading)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = value if isinstance(value, int) else parse_size_to_int(value)
    except ValueError as error:
        raise ConfigError(f"max_shard_size {value!r}: expected bytes or a size such as 500MB ({error})") from None
    if size <= 0:
        raise ConfigError(f"max_shard_size {value!r}: must be positive")
    return int(size)


# ---- the collective ---------------------------------------------------------------------------------------------
def save_pretrained_sharded(model: Any, graph: Graph, stage_state: Mapping[str, torch.Tensor],
                            directory: Union[str, Path], *, group: Any, timeout: float,
                            max_shard_size: Union[int, str] = "5GB") -> Path:
    """Collective over `group` (a gloo group of every rank): write `model`'s Hugging Face directory from each
    rank's `stage_state` (stage-module names). Returns the directory on every rank once it is in place."""
    import torch.distributed as dist

    from model_parallel import jsonbound
    from model_parallel.api.export import hf_config_and_class
    from model_parallel.runtime.wire.agreement import broadcast_json

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    failure: Optional[str] = None
    target: Any = None  # the model on meta: names, shapes, ties
    kept: dict[str, str] = {}
    mine: dict[str, torch.Tensor] = {}
    local: Optional[Exception] = None  # this rank's own error, chained to what every rank raises
    try:
        limit = parse_shard_size(max_shard_size)
        config, cls = hf_config_and_class(model)
        with torch.device("meta"):  # no memory: only names, shapes and which tensors are tied
            target = cls(copy.deepcopy(config))
        kept = hf_kept_keys(target)
        mine = local_tensors(graph, stage_state, kept, model, rank)
    except Exception as error:  # noqa: BLE001 - every rank must hear it, or the others wait for this one
        failure, local = _cause(error), error
    _agree_or_raise(failure, group, timeout, "naming its tensors", local)
    entries = _exchange(entries_of(mine), rank, world, group, timeout)
    shapes = {key: tuple(value.shape) for key, value in target.state_dict().items()}
    order = list(dict.fromkeys(kept.values()))
    shards = shard_layout(order, entries, limit, {key: shapes[key] for key in order})

    out = Path(directory)
    staging, failure = "", None
    if rank == 0:
        try:
            staging = str(make_staging(out))
        except OSError as error:
            failure, local = _cause(error), error
    _agree_or_raise(failure, group, timeout, "making the temporary directory beside the target", local)
    tmp = Path(str(jsonbound.loads(broadcast_json(json.dumps(staging), 0, group, timeout), where="rank 0's directory",
                                   error=CheckpointError)))
    try:
        _agree_or_raise(_write_shards(shards, mine, tmp, rank), group, timeout, "writing its shards")
        failure = None
        if rank == 0:
            try:
                _finish(target, shards, [e for listed in entries for e in listed], tmp, out)
            except Exception as error:  # noqa: BLE001
                failure, local = _cause(error), error
        _agree_or_raise(failure, group, timeout, "writing the index and config and moving the files into place", local,
                        untouched=False)  # into an existing directory some files may have moved
    finally:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("[rank %d] save_pretrained: wrote %d of %d shard(s) of %s to %s", rank,
                sum(s.rank == rank for s in shards), len(shards), type(target).__name__, out)
    return out


def _cause(error: BaseException) -> str:
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first}"


def _agree_or_raise(failure: Optional[str], group: Any, timeout: float, what: str,
                    local: Optional[Exception] = None, untouched: bool = True) -> None:
    import torch.distributed as dist

    from model_parallel.runtime.wire.agreement import agree

    causes = agree(failure, group, timeout, f"save_pretrained: {what}")
    if isinstance(local, ModelParallelError) and len(causes) == dist.get_world_size(group) \
            and len(set(causes.values())) == 1:
        raise local  # every rank refused alike (not a Hugging Face model, a bad max_shard_size): the error itself
    if causes:
        named = "; ".join(f"rank {r}: {cause}" for r, cause in sorted(causes.items()))
        after = "; nothing was written to the target directory" if untouched else ""
        raise CheckpointError(f"save_pretrained failed {what} on rank(s) {sorted(causes)} ({named}){after}") from local


def _exchange(mine: list[TensorEntry], rank: int, world: int, group: Any, timeout: float) -> list[list[TensorEntry]]:
    """Every rank's entries on every rank (one small JSON broadcast per rank), checked as data."""
    from model_parallel import jsonbound
    from model_parallel.runtime.wire.agreement import broadcast_json

    out = []
    for src in range(world):
        text = json.dumps([[e.key, e.dtype, list(e.shape), e.nbytes] for e in mine]) if src == rank else None
        rows = jsonbound.loads(broadcast_json(text, src, group, timeout), where=f"tensor names from rank {src}",
                               error=CheckpointError)
        listed = []
        for row in rows:
            ok = (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str)
                  and isinstance(getattr(torch, str(row[1]), None), torch.dtype)
                  and isinstance(row[2], list) and all(isinstance(d, int) and d >= 0 for d in row[2])
                  and isinstance(row[3], int) and row[3] >= 0)
            if not ok:
                raise CheckpointError(f"rank {src} sent {str(row)[:80]} as a tensor, not [key, dtype, shape, bytes]")
            listed.append(TensorEntry(row[0], row[1], tuple(row[2]), row[3]))
        out.append(listed)
    return out


def _write_shards(shards: Sequence[Shard], tensors: Mapping[str, torch.Tensor], tmp: Path, rank: int) -> Optional[str]:
    """This rank's shards into `tmp`, one at a time; the failure's cause, or None."""
    from safetensors.torch import save_file

    try:
        for shard in shards:
            if shard.rank == rank:
                save_file({k: tensors[k].contiguous().cpu() for k in shard.keys}, str(tmp / shard.filename),
                          metadata={"format": "pt"})
    except Exception as error:  # noqa: BLE001
        return _cause(error)
    return None


def _finish(target: Any, shards: Sequence[Shard], entries: Sequence[TensorEntry], tmp: Path, out: Path) -> None:
    """Rank 0: config (as transformers writes it: dtype, architectures), generation config, index; then into place."""
    from model_parallel.fileio import atomic_write_text

    sizes = {e.key: e for e in entries}
    floating = [sizes[k].dtype for s in shards for k in s.keys if getattr(torch, sizes[k].dtype).is_floating_point]
    target.config.dtype = floating[0] if floating else "float32"
    target.config.architectures = [type(target).__name__]
    target.config.save_pretrained(str(tmp))
    if target.can_generate():
        target.generation_config.save_pretrained(str(tmp))
    if len(shards) > 1:
        index = {"metadata": {"total_parameters": target.num_parameters(),
                              "total_size": sum(sizes[k].nbytes for s in shards for k in s.keys)},
                 "weight_map": {k: s.filename for s in shards for k in s.keys}}
        atomic_write_text(tmp / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
    move_into_place(tmp, out, {s.filename for s in shards})
