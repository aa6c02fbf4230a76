"""The trained model out: stage state -> the original model's state-dict names, a Hugging Face directory.

    state = original_state_dict(graph, trainer_state, model)    # load_state_dict(strict=True) into the model
    save_pretrained(model_or_config, state, "out/")             # config + sharded safetensors (+ index)
    export_checkpoint("ckpt/", None, "out/")                     # the same from a checkpoint, without workers
                                                                 # (its recorded graph and HF config; or given)

Stage modules name a parameter `layer1_0_conv1.weight` (codegen.naming); the original model calls it
`layer1.0.conv1.weight`. The graph records which original names each node owns, so the renaming is
exact; a key the unmodified model has and the graph does not own (a buffer forward never reads) is
taken from the model when it holds real values, and otherwise refused by name: a silently missing key
would load as garbage. Writing the Hugging Face format is left to transformers' own `save_pretrained`
(ties stored once, shards, the index), on a copy of the model built on meta from the same config. That needs the
whole state in one process; `trainer.save_pretrained` on several ranks writes each stage where it lives instead
(api/shard_export.py), and `gather_state` (every stage on every rank) serves `state_dict(original_names=True)` only.
"""
from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from model_parallel.api.hf_directory import make_staging, move_into_place, weight_files
from model_parallel.errors import CheckpointError, ConfigError, ModelParallelError
from model_parallel.graph.core import Graph

logger = logging.getLogger(__name__)

__all__ = ["original_state_dict", "save_pretrained", "export_checkpoint", "checkpoint_stage_state", "gather_state",
           "write_safetensors"]


def original_state_dict(graph: Graph, stage_state: Mapping[str, torch.Tensor],
                        model: Optional[nn.Module] = None) -> dict[str, torch.Tensor]:
    """Stage-keyed state (every stage's) -> the original model's keys; with `model`, exactly its keys."""
    from model_parallel.codegen.naming import original_state_from_stage

    state = original_state_from_stage(graph, stage_state)
    if model is None:
        return state
    reference = model.state_dict(keep_vars=True)
    unexpected = sorted(set(state) - set(reference))
    if unexpected:
        raise ConfigError(f"the trained state has {len(unexpected)} key(s) the {type(model).__name__} lacks, e.g. "
                          f"{unexpected[:3]}; was the graph profiled from another model? Profile this model again")
    missing = [key for key in reference if key not in state]
    refuse_unfilled(model, missing, reference, " or load with strict=False")
    for key in missing:  # not read by forward, so never trained: the model's own value is the value
        state[key] = reference[key].detach()
    return {key: state[key] for key in reference}  # the model's order


# ---- Hugging Face directories -------------------------------------------------------------------------
def hf_config_and_class(model_or_config: Any, model_class: Optional[str] = None) -> tuple[Any, type]:
    """(config, model class) from a PreTrainedModel, a PretrainedConfig, a config.json or an HF directory;
    `model_class` (a transformers class name, e.g. "GPT2LMHeadModel") overrides config.architectures."""
    import transformers

    if isinstance(model_or_config, nn.Module):
        config = getattr(model_or_config, "config", None)
        if not isinstance(config, transformers.PretrainedConfig):
            raise ConfigError(f"save_pretrained needs a Hugging Face model (one with a .config), got "
                              f"{type(model_or_config).__name__}; use original_state_dict() and torch.save or "
                              "safetensors for other models")
        return config, type(model_or_config)
    if isinstance(model_or_config, (str, Path)):
        path = Path(model_or_config)
        folder = path.parent if path.is_file() else path
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{path}: no config.json; pass a Hugging Face config.json or model directory")
        config = read_hf_config(folder)
    elif isinstance(model_or_config, transformers.PretrainedConfig):
        config = model_or_config
    else:
        raise ConfigError(f"save_pretrained takes a Hugging Face model, config, config.json or directory, got "
                          f"{type(model_or_config).__name__}")
    names = [model_class] if model_class else list(getattr(config, "architectures", None) or [])
    # Only a class transformers itself exports, and only a model class: the config names it, we do not import it.
    found = [getattr(transformers, name, None) for name in names]
    classes = [c for c in found if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)]
    if not classes:
        raise ConfigError(f"the config ({type(config).__name__}) names no model class transformers has "
                          f"(asked for {names}); name one, e.g. model_class='GPT2LMHeadModel' (--model_class), "
                          "or set config.architectures")
    return config, classes[0]



def read_hf_config(folder: Path) -> Any:
    """`folder/config.json` as transformers' config object: JSON only. A config whose `auto_map` names code of its
    own (a .py file beside it, which a checkpoint or a downloaded folder may carry) is refused, never run: transformers
    would ask on a terminal and run it on "y"."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError) as error:  # code it names, an unknown model_type, bad values
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{folder / 'config.json'}: not a config transformers {transformers.__version__} reads as "
                          f"data alone ({first}); give the config of a model type transformers itself has (code "
                          "shipped with a config or a checkpoint is never run)") from None


def refuse_unfilled(model: nn.Module, keys: Any, reference: Mapping[str, torch.Tensor], fix: str = "") -> None:
    """ConfigError when a key of `model` no graph node owns has no value (the model is on meta): a missing key would
    load as garbage. `fix` adds a way out the caller offers."""
    unfilled = [key for key in keys if reference[key].is_meta]
    if unfilled:
        raise ConfigError(
            f"{len(unfilled)} key(s) of the {type(model).__name__} are owned by no graph node and the model holds no "
            f"values for them (it is on meta), e.g. {unfilled[:3]}; build the model with real values (they are not "
            f"trained: forward never reads them){fix}")

def save_pretrained(model_or_config: Any, state: Mapping[str, torch.Tensor], directory: Union[str, Path],
                    *, max_shard_size: Union[int, str] = "5GB", model_class: Optional[str] = None) -> Path:
    """Write `state` (original keys) as a Hugging Face model directory, loadable by `from_pretrained`."""
    config, cls = hf_config_and_class(model_or_config, model_class)
    return write_hf_directory(config, cls, state, directory, max_shard_size=max_shard_size,
                              config_file=config_label(model_or_config), origin="the state")


def config_label(model_or_config: Any) -> str:
    """Where a config came from, for an error: its config.json, else its type."""
    if isinstance(model_or_config, (str, Path)):
        path = Path(model_or_config)
        return str(path if path.is_file() else path / "config.json")
    config = getattr(model_or_config, "config", model_or_config)
    return f"the config ({type(config).__name__})"


def write_hf_directory(config: Any, cls: type, state: Mapping[str, torch.Tensor], directory: Union[str, Path], *,
                       max_shard_size: Union[int, str], config_file: str, origin: str,
                       fix: str = "give the config the model was built from") -> Path:
    """`state` as `cls(config)`'s Hugging Face directory. Every key and shape is checked against the model the config
    builds before anything is written: torch's load_state_dict would stop at the first mismatch with a traceback,
    and a mismatch is the config's doing (another vocab_size or width), so the error names its file."""
    with torch.device("meta"):  # no memory: the tensors are `state`'s own
        target = cls(config)
    shapes = {key: tuple(value.shape) for key, value in target.state_dict().items()}
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise ConfigError(f"{config_file}: {origin} does not fit the {cls.__name__} it builds: missing {missing[:3]} "
                          f"({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)}); {fix}")
    other = [(key, tuple(state[key].shape), shape) for key, shape in shapes.items() if tuple(state[key].shape) != shape]
    if other:
        listed = "; ".join(f"{key}: {list(have)} stored, {list(want)} by the config" for key, have, want in other[:3])
        more = f"; and {len(other) - 3} more" if len(other) > 3 else ""
        raise ConfigError(f"{config_file}: {len(other)} tensor(s) of {origin} have another shape than the "
                          f"{cls.__name__} this config builds ({listed}{more}); {fix}")
    target.load_state_dict(dict(state), strict=True, assign=True)
    if hasattr(target, "tie_weights"):
        target.tie_weights()  # tied keys one tensor again, so transformers stores them once
    # Non-persistent buffers (rotary frequencies) stay on meta: no state dict, so saving never reads them.
    out = output_directory(directory)
    # transformers writes file by file: a crash mid-save (or a full disk) would leave a config beside a part of the
    # weights, which from_pretrained loads with the rest left at their init. Staged, the target is whole or untouched.
    staging = make_staging(out)
    try:
        target.save_pretrained(str(staging), max_shard_size=max_shard_size)
        move_into_place(staging, out, weight_files(staging))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("wrote %s (%s, %d tensors) to %s", cls.__name__, type(config).__name__, len(shapes), out)
    return out


def output_directory(out: Union[str, Path]) -> Path:
    """`out` as a directory to write into, refused (ConfigError) where a file is in the way: at `out` itself or
    above it. Checked before anything is read, so a typo in --out costs no load and leaves nothing behind."""
    path = Path(out)
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                where = "exists and is a file" if place == path else f"is inside {place}, a file"
                raise ConfigError(f"{path}: {where}, not a directory; export writes a directory (config.json and "
                                  "safetensors, or model.safetensors): give a new or an existing directory path (--out)")
            break
    return path


# ---- from a checkpoint directory ----------------------------------------------------------------------
EXPORT_FIX = "export reads a training run's --checkpoint_dir (its 'latest' pointer and step_<N>/ folders): give that folder"


def checkpoint_stage_state(checkpoint_dir: Union[str, Path], graph: Graph,
                           step: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Every stage key of a committed checkpoint (a tie stored once restored under each of its keys)."""
    from model_parallel.runtime.checkpoint.store import load_checkpoint

    return _stage_state(load_checkpoint(checkpoint_dir, step, fix=EXPORT_FIX), graph)


def _stage_state(checkpoint: Any, graph: Graph) -> dict[str, torch.Tensor]:
    """`checkpoint_stage_state` of an opened checkpoint."""
    from model_parallel.codegen.naming import state_key_map
    from model_parallel.runtime.build.tied import stored_keys

    state = {**checkpoint.params(), **checkpoint.buffers()}
    for alias, stored in stored_keys(graph).items():
        if stored in state:
            state.setdefault(alias, state[stored])
    owned = set(state_key_map(graph).values())
    foreign, missing = sorted(set(state) - owned - set(stored_keys(graph))), sorted(owned - set(state))
    if foreign or missing:
        raise CheckpointError(f"{checkpoint.path}: the checkpoint does not hold the graph's parameters ({len(missing)} "
                              f"missing, e.g. {missing[:2]}; {len(foreign)} not in the graph, e.g. {foreign[:2]}); "
                              "pass the graph the run trained")
    return state


# A running job with --keep_checkpoints K deletes a step K commits after `latest` named it; export reads `latest`
# again this many times before it says so (each read takes the step's graph, config and tensors from one folder).
READ_TRIES = 3


def export_checkpoint(checkpoint_dir: Union[str, Path], graph: Union[Graph, str, Path, None], out: Union[str, Path], *,
                      config: Any = None, step: Optional[int] = None, max_shard_size: Union[int, str] = "5GB",
                      model_class: Optional[str] = None) -> Path:
    """A checkpoint -> an HF directory (with a config) or `out/model.safetensors` in the original names.
    `graph` None: the graph the checkpoint recorded, and then its Hugging Face config.json too when `config` is None
    (runtime/checkpoint/model_files.py); a given graph or config overrides what it recorded."""
    from model_parallel.graph.io import load_graph

    out = output_directory(out)  # before anything is read
    given = graph if graph is None or isinstance(graph, Graph) else load_graph(graph)
    read = _read_pinned(Path(checkpoint_dir), step, given, config, model_class)
    if read.hf is not None:
        fix = ("restore the config.json the run recorded, or pass --config CONFIG, the config it trained"
               if read.recorded else "pass the config the run trained (--config), or drop --config to use the recorded one")
        return write_hf_directory(*read.hf, read.state, out, max_shard_size=max_shard_size, config_file=read.config_file,
                                  origin=f"the checkpoint {read.folder}", fix=fix)
    return write_safetensors(read.state, out / "model.safetensors")


@dataclass(frozen=True)
class _StepRead:
    """What export takes from one committed step: its tensors in the original names and the config to write them with."""

    folder: Path
    state: dict[str, torch.Tensor]
    hf: Optional[tuple[Any, type]]  # (config, model class), None: a plain state dict
    config_file: str
    recorded: bool  # the config is the one the checkpoint recorded (not --config)


def _read_pinned(root: Path, step: Optional[int], graph: Optional[Graph], config: Any,
                 model_class: Optional[str]) -> _StepRead:
    """Step `step` (None: the one `latest` names) read whole; a step deleted while it is read (its manifest gone) is
    a prune by a running job: `latest` is read again, up to READ_TRIES times, then CheckpointError saying so."""
    from model_parallel.runtime.checkpoint.layout import MANIFEST, latest_step, step_dir
    from model_parallel.runtime.checkpoint.store import load_checkpoint

    tries = READ_TRIES if step is None else 1  # a step asked for by number is not replaced by a newer one
    last: Optional[BaseException] = None
    # A step asked for by number that is not there was reported "deleted while export read it", as if pruned.
    if step is not None and not (step_dir(root, step) / MANIFEST).is_file():
        from model_parallel.runtime.checkpoint.layout import list_checkpoints

        raise CheckpointError(f"--step {step}: {root} holds no committed step {step} (committed steps: "
                              f"{list_checkpoints(root)}); give one of them, or no --step for the latest")
    for attempt in range(tries):
        pinned = step if step is not None else latest_step(root)
        if pinned is None:
            load_checkpoint(root, None, fix=EXPORT_FIX)  # raises: no committed checkpoint, and what export needs
            raise AssertionError("load_checkpoint returned without a committed step")
        try:
            return _read_step(root, pinned, graph, config, model_class)
        except (ModelParallelError, OSError) as error:
            # Pruned: its manifest is gone, or `latest` moved past it (the prune's rmtree may not have reached the
            # manifest yet). Otherwise the error is about what the step holds, and reading again would not help.
            gone = not (step_dir(root, pinned) / MANIFEST).is_file()
            if not (gone or (step is None and latest_step(root) != pinned)):
                raise
            last = error
            logger.info("%s was deleted while export read it (try %d of %d)", step_dir(root, pinned), attempt + 1, tries)
    which = "each the step 'latest' named" if step is None else "the step --step named"
    raise CheckpointError(
        f"{step_dir(root, pinned)}: deleted while export read it ({tries} time(s) in a row, {which}): a running job "
        "prunes its checkpoints (it keeps only its newest --keep_checkpoints); export after the run ends, or give the "
        "run a larger --keep_checkpoints") from last


def _read_step(root: Path, step: int, graph: Optional[Graph], config: Any, model_class: Optional[str]) -> _StepRead:
    """Everything export needs from committed step `step`, read now (the config too: a recorded config.json goes
    with its step)."""
    from model_parallel.runtime.checkpoint.model_files import checkpoint_graph, checkpoint_hf_config
    from model_parallel.runtime.checkpoint.store import load_checkpoint

    checkpoint = load_checkpoint(root, step, fix=EXPORT_FIX)
    folder = checkpoint.path
    recorded = graph is None and config is None
    if graph is None:
        graph = checkpoint_graph(folder)
        if config is None:
            config = checkpoint_hf_config(folder, graph)
    state = original_state_dict(graph, _stage_state(checkpoint, graph))
    hf = None if config is None else hf_config_and_class(config, model_class)
    return _StepRead(folder, state, hf, "" if config is None else config_label(config), recorded)


def write_safetensors(state: Mapping[str, torch.Tensor], path: Union[str, Path]) -> Path:
    """`state` as one safetensors file, atomically; a tensor shared by several keys (a tie) is written under
    each of them (safetensors refuses shared storage), so `load_state_dict(strict=True)` finds every key."""
    from safetensors.torch import save

    from model_parallel.fileio import atomic_write

    seen: set[int] = set()
    tensors = {}
    for key, value in state.items():
        value = value.detach().contiguous()
        tensors[key] = value.clone() if value.data_ptr() in seen else value
        seen.add(value.data_ptr())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(save(tensors)), binary=True)
    return path


# ---- every rank's stage into one state ----------------------------------------------------------------
def gather_state(local: Mapping[str, torch.Tensor], timeout: float) -> dict[str, torch.Tensor]:
    """Every rank's stage state on every rank (collective): names and shapes as JSON, then the tensors.
    Replicas hold the same values, so the first rank to name a key provides it."""
    import json

    import torch.distributed as dist

    from model_parallel import jsonbound
    from model_parallel.runtime.wire.agreement import broadcast_json
    from model_parallel.runtime.wire.comm import wait_work

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    result: dict[str, torch.Tensor] = {}
    for src in range(dist.get_world_size()):
        mine = src == dist.get_rank()
        names = [[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in local.items()]
        header = json.dumps(names) if mine else None
        entries = jsonbound.loads(broadcast_json(header, src, None, timeout), where=f"state names from rank {src}",
                                  error=CheckpointError)
        for key, shape, dtype in entries:
            dtype_obj = getattr(torch, str(dtype), None)
            if not isinstance(dtype_obj, torch.dtype) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise CheckpointError(f"rank {src} sent tensor {key!r} as {shape} {dtype!r}, not a shape and a dtype")
            tensor = (local[key].detach().to(device).contiguous() if mine
                      else torch.empty(shape, dtype=dtype_obj, device=device))
            wait_work(dist.broadcast(tensor, src, async_op=True), timeout, src, "state gather")
            result.setdefault(key, tensor.cpu() if not mine else local[key].detach())
    return result
