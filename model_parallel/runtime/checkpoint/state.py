"""What goes into a checkpoint besides the tensors themselves: the model's fingerprint, optimizer state
keyed by parameter name, and a stage module's state split into parameters and buffers.

These helpers are independent of the file layout (runtime/checkpoint/store.py) and of the commit
protocol (runtime/checkpoint/commit.py); runtime/checkpoint/store.py re-exports them.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

OptimizerState = Mapping[str, Mapping[str, Union[torch.Tensor, float, int]]]


# ----------------------------------------------------------------------------- fingerprint


def _dtype_name(dtype: Union[str, torch.dtype]) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_dtype_map(named: Union[nn.Module, Mapping[str, Any]]) -> dict[str, tuple[tuple[int, ...], str]]:
    items = named.named_parameters() if isinstance(named, nn.Module) else named.items()
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, value in items:
        if isinstance(value, torch.Tensor):
            out[name] = (tuple(value.shape), _dtype_name(value.dtype))
        else:
            shape, dtype = value
            out[name] = (tuple(int(d) for d in shape), _dtype_name(dtype))
    return out


def model_fingerprint(named: Union[nn.Module, Mapping[str, Any]]) -> str:
    """Hash of sorted parameter names, shapes and dtypes (16 hex digits).

    Names are normalised with "." -> "_", so the original model's `layer1.0.conv1.weight` and the
    stage-module name `layer1_0_conv1.weight` agree: any partition of a model has its fingerprint.
    """
    return _fingerprint(named)


def _fingerprint(named: Union[nn.Module, Mapping[str, Any]]) -> str:
    entries = sorted(
        (name.replace(".", "_"), list(shape), dtype) for name, (shape, dtype) in _shape_dtype_map(named).items()
    )
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- optimizer state


class StreamedState(Mapping[str, dict[str, Any]]):
    """Name-keyed optimizer state read one parameter at a time: `layout[name]` says what an entry holds (its
    tensors as meta tensors: shape and dtype) without reading anything, `self[name]` reads the entry (fresh
    tensors the caller owns). An offloaded optimizer's state (runtime/step/offload.py) and a checkpoint's come
    this way, so a checkpoint write or a resume holds one parameter's state at a time, never the whole."""

    def __init__(self, layout: dict[str, dict[str, Any]], read: Callable[[str], dict[str, Any]],
                 ranges: Optional[Callable[[str], dict[str, Any]]] = None) -> None:
        self.layout = layout
        self._read = read
        # An entry with its tensors as FileRanges (runtime/step/file_range.py) where they lie in files: an offloaded
        # optimizer copies them file to file (`load_optimizer_state_by_name`), as the shard writer does.
        self.ranges = ranges

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self.layout:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)

    def with_entries(self, entries: Mapping[str, Mapping[str, Any]]) -> "StreamedState":
        """`entries` (in memory already: a switch's arriving state, taken over as they are) over these."""
        def pick(read: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
            return lambda name: dict(entries[name]) if name in entries else read(name)
        return StreamedState({**self.layout, **{name: dict(entry) for name, entry in entries.items()}},
                             pick(self._read), pick(self.ranges) if self.ranges else None)

    def renamed(self, names: Mapping[str, str]) -> "StreamedState":
        """The entries of `names`' values under their keys (new name -> name here), still unread."""
        names = {new: old for new, old in names.items() if old in self.layout}
        ranges = self.ranges
        return StreamedState({new: self.layout[old] for new, old in names.items()}, lambda new: self._read(names[new]),
                             (lambda new: ranges(names[new])) if ranges else None)


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, named_params: Mapping[str, torch.Tensor]
) -> Union[dict[str, dict[str, Any]], StreamedState]:
    """The optimizer's per-parameter state keyed by parameter name (tensors detached, on CPU): copied into a
    dict, or, where the optimizer is offloaded, a StreamedState read from its files when an entry is asked for."""
    from model_parallel.runtime.step.offload import offload_of

    by_id = {id(p): name for name, p in named_params.items()}
    offload = offload_of(optimizer)
    if offload is not None:
        owned = {by_id[id(p)]: (p, layout) for p, layout in offload.state_layout(optimizer) if id(p) in by_id}
        return StreamedState({name: layout for name, (_, layout) in owned.items()},
                             lambda name: offload.read_param(optimizer, owned[name][0]),
                             lambda name: offload.ranges(optimizer, owned[name][0]))
    out: dict[str, dict[str, Any]] = {}
    for param, state in optimizer.state.items():
        name = by_id.get(id(param))
        if name is None:
            continue  # a parameter this stage does not own (cannot happen with one optimizer per stage)
        out[name] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return out


def state_keys(optimizer: torch.optim.Optimizer) -> Optional[frozenset[str]]:
    """The per-parameter state keys `optimizer`'s kind keeps (SGD with momentum: momentum_buffer; AdamW: step,
    exp_avg, exp_avg_sq), from one step of a copy (its class, its defaults) on a probe tensor; None when no copy
    can be built (an optimizer whose constructor takes more than its defaults): then unknown."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    like = params[0] if params else torch.zeros(1)
    probe = nn.Parameter(torch.zeros(1, device=like.device, dtype=like.dtype))
    try:
        # Only what the constructor takes: AdamW's defaults hold Adam's decoupled_weight_decay, its __init__ refuses it.
        accepted = inspect.signature(type(optimizer)).parameters
        copy = type(optimizer)([probe], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        probe.grad = torch.zeros_like(probe)
        copy.step()
    except Exception:  # noqa: BLE001 - a check that cannot be made is not a reason to fail a resume
        return None
    return frozenset(copy.state.get(probe, {}))


def foreign_state(optimizer: torch.optim.Optimizer, state: OptimizerState) -> Optional[tuple[frozenset[str], frozenset[str]]]:
    """(keys an entry of `state` holds, keys `optimizer` keeps) where they differ: another kind of optimizer's state
    (SGD's momentum_buffer for AdamW, which would fail its step with KeyError 'exp_avg'); None where it fits. Nothing
    is read: a StreamedState's layout names the keys."""
    layout = state.layout if isinstance(state, StreamedState) else state
    held = next((frozenset(layout[name]) for name in layout if layout[name]), None)
    if held is None:
        return None  # no state yet (a checkpoint before the first step): nothing to mistake
    kept = state_keys(optimizer)
    return None if kept is None or held == kept else (held, kept)


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, named_params: Mapping[str, torch.Tensor], state: OptimizerState,
    copy: bool = True,
) -> None:
    """Install name-keyed state into `optimizer` for the parameters it holds (moved to their device).

    Names absent from `state` keep no state (e.g. a checkpoint taken before the first step). With
    `copy=False` tensors already on the right device are taken over, not cloned: a plan switch hands
    over the state it owns, and a clone would hold the whole optimizer state twice at that moment. An offloaded
    optimizer's (runtime/step/offload.py) each parameter's state goes to its files as soon as it is installed.
    """
    from model_parallel.runtime.step.offload import offload_of

    offload = offload_of(optimizer)
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    # Offloaded, a streamed state's tensors go file to file (its FileRanges), none of them read into memory.
    ranges = state.ranges if offload is not None and isinstance(state, StreamedState) else None
    for name, param in named_params.items():
        entry = (ranges(name) if name in state else None) if ranges else state.get(name)
        if entry is None:
            continue
        group = group_of.get(id(param), {})
        # As torch's own load_state_dict does: Adam's `step` stays on the CPU unless capturable/fused.
        restored = _restored(entry, param.device, bool(group.get("capturable") or group.get("fused")), copy)
        # Dropped before the next entry is read (a StreamedState reads it then): alive beside it, glibc's heap grew.
        del entry
        if offload is not None:
            offload.load(optimizer, param, restored)
            del restored
        else:
            optimizer.state[param] = restored


def _restored(entry: Mapping[str, Any], device: torch.device, step_on_param_device: bool, copy: bool) -> dict[str, Any]:
    """One parameter's state moved to `device` (Adam's `step` to the CPU unless `step_on_param_device`)."""
    restored: dict[str, Any] = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor):
            on_cpu = key == "step" and not step_on_param_device
            value = value.detach().clone() if copy else value.detach()
            restored[key] = value.to("cpu" if on_cpu else device)
        else:
            restored[key] = value
    return restored


def split_state(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, persistent buffers) of a stage module by state-dict name, ready for save_shard."""
    state = module.state_dict()
    # Every name of a Parameter: a tied one is in the state dict under each of its names.
    param_names = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    params = {k: v for k, v in state.items() if k in param_names}
    buffers = {k: v for k, v in state.items() if k not in param_names}
    return params, buffers
