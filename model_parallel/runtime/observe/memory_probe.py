"""What a stage really holds, measured: tensor storage bytes by kind, and the process's peak.

The optimizer's footprint model (`optimizer/memory.py`) predicts parameters + gradients + optimizer
state + stashed activations per stage; `state_bytes` counts the first three exactly from tensor
storages (RSS would also count the allocator's caches and the interpreter), and `PeakProbe` measures
the peak: on CUDA `torch.cuda.max_memory_allocated` since `start`, on CPU the growth of the process's
peak RSS since `start` (an upper estimate: it includes allocator slack and the stage's code).
`out_of_memory` turns an allocation the allocator refused into one line: the rank, its stage, the bytes
it held and the limit.
"""
from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from model_parallel.errors import ModelParallelError, OutOfMemoryError
from model_parallel.graph.saved import covered, span


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def state_bytes(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
    """Bytes of the storages behind `module`'s parameters, their gradients and the optimizer's state
    (each storage counted once: tied parameters share one). `optimizer_state` counts the state tensors
    shaped like their parameter (momentum, Adam's moments), `optimizer_scalars` the rest (Adam's step). With its state
    offloaded (runtime/step/offload.py) `optimizer_state` is the most one chunk of the update held, what is resident then."""
    seen: set[int] = set()
    out = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "optimizer_scalars": 0}

    def add(kind: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            pointer, size = _storage(tensor)
            if pointer not in seen or pointer == 0:
                seen.add(pointer)
                out[kind] += size

    parameters = list(module.parameters())
    for p in parameters:
        add("parameters", p)
    for p in parameters:
        add("gradients", p.grad)
    if optimizer is not None:
        for param, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add("optimizer_state" if value.shape == param.shape else "optimizer_scalars", value)
        from model_parallel.runtime.step.offload import offload_of

        if (offload := offload_of(optimizer)) is not None:  # on disk between updates: the most one chunk held in memory
            # (during an update the chunk in `optimizer.state` was counted above: it is part of that peak, not beside it)
            out["optimizer_state"] = max(out["optimizer_state"], offload.peak_state_bytes)
    return out


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class PeakProbe:
    """Peak bytes since `start()`: CUDA's allocator peak on a GPU, else the growth of peak RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            self.baseline = peak_rss_bytes()

    @property
    def source(self) -> str:
        return "cuda_max_allocated" if self.device.type == "cuda" else "peak_rss_growth"

    def peak(self) -> int:
        """Bytes above the baseline at the peak (CUDA: all allocated bytes at the peak, the stage's included)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, peak_rss_bytes() - self.baseline)


class NullMeter:
    """The executor's meter when memory is not measured: every hook is a no-op (`RunOptions.measure_memory`)."""

    def step(self, stage: Any, data: Any = None) -> "contextlib.AbstractContextManager[None]":
        return contextlib.nullcontext()

    def begin(self, microbatch: int) -> None:
        pass

    def kept(self, microbatch: int, entry: Any) -> None:
        pass

    def keep(self, microbatch: int, tensors: Any) -> None:
        pass

    def release(self, microbatch: int) -> None:
        pass

    def held(self, stage: Any, optimizer: Any) -> None:
        pass

    def record(self) -> dict[str, int]:
        return {}


NO_METER = NullMeter()


class StashMeter:
    """Measures the bytes a stage keeps for backward per microbatch in flight, and their peak over a step.

    Counted: every tensor autograd saves during a microbatch's forward (a `saved_tensors_hooks` pack
    hook, which keeps a detached view of the tensor: `_pack` says why not the tensor itself) and the boundary buffers the executor keeps until that
    microbatch's backward (received inputs, sent outputs, PipeDream's stashed weight version). Each
    storage counts once (the union of the byte ranges its tensors view: `graph/saved.py`, the rule the
    profiler's `Node.saved_bytes` is counted by); the stage's parameters and
    buffers (held, counted by `state_bytes`) and the step's input data (held for the whole step whatever
    the schedule) are not counted. A microbatch's bytes are released when its backward has run.
    Also records the parameters + gradients + optimizer state at the end of a step's backwards
    (`held`), and on CUDA `torch.cuda.max_memory_allocated`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.current: Optional[int] = None  # the microbatch whose forward runs
        self.spans: dict[int, dict[int, tuple[int, int]]] = {}  # storage -> microbatch -> (start, end)
        self.owned: dict[int, set[int]] = {}  # microbatch -> its storages
        self.live: dict[int, int] = {}  # storage -> bytes counted now
        self.total = 0
        self.step_peak = 0
        self.peak = 0  # over the run
        self.excluded: set[int] = set()
        self.held_bytes: dict[str, int] = {}  # this step's, by kind
        self.held_peak = 0  # the largest parameters + gradients + optimizer state over the run

    @contextlib.contextmanager
    def step(self, stage: Any, data: Any = None) -> Iterator[None]:
        """One step of `stage` on `data` (stage 0's microbatches): installs the pack hook for its duration."""
        self.excluded = {t.untyped_storage().data_ptr() for t in _tensors(data)}
        if stage is not None:
            self.excluded |= {t.untyped_storage().data_ptr() for t in (*stage.parameters(), *stage.buffers())}
        self.step_peak = self.total
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield
        self.current = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.current is not None:
            self._add(self.current, tensor)
        # Detached (same storage and version counter), not the tensor itself: an operator's saved *output*
        # packed as itself refers back to the node that saves it (tensor -> grad_fn -> saved tensor), a cycle
        # through C++ that gc cannot see and only a backward without retain_graph breaks. Zero bubble's I and W
        # retain the graph (backward_split.py), so every microbatch's graph leaked: rank 3's resident memory
        # grew ~40 MB a step more than 1F1B's under bench/big_model.py --schedule zbh1 (docs/runtime.md).
        # Unpacking rebuilds the grad_fn from what autograd keeps beside the packed value.
        return tensor.detach()

    def _add(self, microbatch: int, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        pointer, start, end = span(tensor)
        if pointer == 0 or pointer in self.excluded or end <= start:
            return
        mine = self.spans.setdefault(pointer, {})
        old = mine.get(microbatch)
        mine[microbatch] = (start, end) if old is None else (min(old[0], start), max(old[1], end))
        self.owned.setdefault(microbatch, set()).add(pointer)
        self._recount(pointer)

    def _recount(self, pointer: int) -> None:
        """The union of the byte ranges microbatches in flight view in one storage."""
        union = covered(self.spans.get(pointer, {}).values())
        self.total += union - self.live.get(pointer, 0)
        if union:
            self.live[pointer] = union
        else:
            self.live.pop(pointer, None)
            self.spans.pop(pointer, None)
        self.step_peak = max(self.step_peak, self.total)
        self.peak = max(self.peak, self.total)

    def begin(self, microbatch: int) -> None:
        """Microbatch `microbatch`'s forward starts: what autograd saves from now on is its."""
        self.current = microbatch

    def kept(self, microbatch: int, entry: Any) -> None:
        """The executor's stash entry of a microbatch (inputs, outputs, weight version): kept until its backward."""
        self.current = None
        for tensor in (*_tensors(entry.inputs), *_tensors(entry.outputs), *_tensors(entry.weights)):
            self._add(microbatch, tensor)

    def keep(self, microbatch: int, tensors: Any) -> None:
        """More tensors microbatch `microbatch` keeps until it is released (zero bubble: the gradients its I kept
        for its W)."""
        for tensor in tensors:
            self._add(microbatch, tensor)

    def release(self, microbatch: int) -> None:
        """Microbatch `microbatch`'s backward has run: autograd freed what it saved, the executor its stash."""
        for pointer in self.owned.pop(microbatch, ()):
            self.spans.get(pointer, {}).pop(microbatch, None)
            self._recount(pointer)

    def held(self, stage: Any, optimizer: Any) -> None:
        """After the step's backwards: parameters, gradients and the optimizer state of earlier steps (none
        at the first step: a reader takes the largest over steps)."""
        self.held_bytes = state_bytes(stage, optimizer) if stage is not None else {}
        self.held_peak = max(self.held_peak, _held(self.held_bytes))

    def record(self) -> dict[str, int]:
        """This step's measurements, as metrics fields (`StepRecord.extra`)."""
        held = self.held_bytes
        out = {"stash_peak_bytes": self.step_peak, "held_bytes": _held(held),
               "weights_opt_bytes": held.get("parameters", 0) + held.get("optimizer_state", 0)}
        if self.device.type == "cuda":
            out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        return out


def _held(kinds: dict[str, int]) -> int:
    """Parameters + gradients + optimizer state (Adam's 0-d step counters are not in the footprint)."""
    return sum(v for k, v in kinds.items() if k != "optimizer_scalars")


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value (nested lists, tuples, dicts; a tensor)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


# What an allocator says when it is refused memory (CPU: c10's DefaultCPUAllocator; CUDA: its OutOfMemoryError).
_REFUSED = ("can't allocate memory", "not enough memory", "out of memory", "cannot allocate memory")


def refused_allocation(error: BaseException) -> bool:
    """Whether `error` is an allocation the allocator (or mmap) refused: a MemoryError, or a library's error that
    says so in its text (ENOMEM from a memory-map, CUDA's "out of memory")."""
    return isinstance(error, MemoryError) or any(phrase in str(error).lower() for phrase in _REFUSED)


def memory_limit(device: torch.device) -> tuple[Optional[int], str]:
    """(bytes, what) this process may hold: the device's memory on a GPU, else its RLIMIT_AS/RLIMIT_DATA."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory), "the GPU's memory"
    limits = [(resource.getrlimit(kind)[0], name) for kind, name in
              ((resource.RLIMIT_AS, "RLIMIT_AS"), (resource.RLIMIT_DATA, "RLIMIT_DATA"))]
    limits = [(value, name) for value, name in limits if value != resource.RLIM_INFINITY]
    if not limits:
        return None, "no RLIMIT_AS/RLIMIT_DATA: the machine's memory"
    value, name = min(limits)
    return int(value), name


def out_of_memory(error: BaseException, rank: int, stage_id: Optional[int], stage: Any, optimizer: Any,
                  device: torch.device) -> Optional[OutOfMemoryError]:
    """`error` as one line naming the rank, its stage, the bytes it held and the limit; None when `error`
    is not an allocation the allocator refused."""
    if isinstance(error, ModelParallelError):
        return None  # ours already (a peer's failure quoted in a PeerError may say "out of memory" too)
    if not refused_allocation(error):
        return None
    held = state_bytes(stage, optimizer) if stage is not None else {}
    limit, what = memory_limit(device)
    gb = lambda value: f"{value / 1e9:.3g} GB"  # noqa: E731
    stage_bytes = sum(held.values())
    try:
        data = status_bytes("VmData")
        process = f"; the process held {gb(data)} of data, {gb(status_bytes('VmRSS'))} resident"
    except (OSError, KeyError, ValueError):
        data, process = 0, ""
    # memory_per_worker prices the stage (weights, gradients, optimizer state, activations), not what the process holds
    # besides it (torch and the libraries, the traced model): the plan must fit in the limit less that.
    own = max(data - stage_bytes, 0)
    budget = (f"memory_per_worker (--memory_per_worker) at most the limit less the {gb(own)} the process holds "
              f"besides its stage ({gb(limit - own)})" if limit and own and limit > own else
              "memory_per_worker (--memory_per_worker) at the limit")
    # Held optimizer state can leave memory without a smaller plan (runtime/step/offload.py: the same parameters).
    offload = (" (or keep the optimizer state on local disk: --offload_optimizer DIR, RunOptions(offload_optimizer=DIR))"
               if held.get("optimizer_state", 0) > 0 else "")
    return OutOfMemoryError(
        f"rank {rank} (stage {stage_id}) ran out of memory: its stage held {gb(stage_bytes)} (parameters "
        f"{gb(held.get('parameters', 0))}, gradients {gb(held.get('gradients', 0))}, optimizer state "
        f"{gb(held.get('optimizer_state', 0))}){process}; limit: {gb(limit) if limit else 'none'} ({what}); give "
        f"the job {budget} to get a plan that fits{offload}, or raise the limit "
        f"[{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}]")


def status_bytes(field: str) -> int:
    """A /proc/self/status field in bytes (VmData, VmRSS); KeyError where the kernel has none."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)
