"""One rank's share of one step: its schedule actions run on its stage.

For each action of the rank (microbatch j lives on replica j % r_k of stage k):

    kF j: inputs <- the data (k = 0) or a pre-posted irecv from stage k-1
          outputs = stage(*inputs)   [recompute: torch.utils.checkpoint; bf16: autocast]
          k < p-1: isend(outputs) to stage k+1     k = p-1: loss = criterion(out, target j) / m
    kB j: k < p-1: output grads <- pre-posted irecv from stage k+1; autograd.backward(outputs, grads)
          k = p-1: loss.backward()
          k > 0:   isend(input grads) to stage k-1
    kI j: as kB j, but the input grads only (backward_split.py), sent at once; what the weight grads need is kept
    kW j: the weight grads of microbatch j from what its kI kept (zero-bubble schedules, zero_bubble.py)
    wait for every send

A rank holding several stages (interleaved 1F1B, multi_stage.py) runs one executor per stage, action by
action in its row's order (`begin` / `act` / `finish`), with one message tag per stage edge (comm.edge_tag); two
consecutive stages on one rank (ZBV's V) hand over through a mailbox instead of a message (wire/local.py).

Under bf16 (`TrainConfig.wire_dtype`) float32 boundary activations and their gradients travel as
bf16 and are widened back on arrival: the receiver computes on the rounded value (comm.py); the
single-process oracle rounds at the same cuts (`structure.cross`).

Only stage 0 and the last stage read data (`StepData`): stage 0 its microbatches' inputs, the last
stage their targets (read from the same minibatch of the same step and split by the same rule, so
target j belongs to the inputs stage 0 sent as microbatch j); no target travels between stages.

Boundary values travel flat (structure.py): a stage's outputs are flattened into
their tensors (a module's tuple output, a dict, a ModelOutput: whatever a node produced), the
structure rides in the message header, and the receiver rebuilds the values around the received
tensors. Gradients are per tensor: the receiver's inputs ARE the flat tensors, and the sender pairs
its flat output tensors with the gradients it gets back, so none is lost inside a container.

With the `pipedream` schedule (no flush) each forward runs on a stashed copy of the weights and each
backward's gradient is applied at once (`weight_stash.WeightStash`; the loss is not divided by m).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from model_parallel.errors import ModelParallelError, PeerError
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.observe.memory_probe import NO_METER
from model_parallel.runtime.observe.straggler import Compute
from model_parallel.runtime.step.output import float_output
from model_parallel.runtime.step.backward_split import WeightWork, backward_input, backward_weight
from model_parallel.runtime.step.rng import seeded_forward
from model_parallel.runtime.step.schedule import INPUT, WEIGHT, Action
from model_parallel.runtime.step.weight_stash import WeightStash
from model_parallel.runtime.wire import comm
from model_parallel.runtime.wire import structure
from model_parallel.runtime.wire.local import LocalRecv, Mailbox



@dataclass(frozen=True)
class StepData:
    """What a rank read of one minibatch, per microbatch j: stage 0 its stage inputs, the last stage its target
    (a single stage: both); None where the stage reads nothing (intermediate stages read no data)."""

    inputs: Optional[Sequence[Sequence[Any]]] = None
    targets: Optional[Sequence[Any]] = None


NO_DATA = StepData()


@dataclass
class StepState:
    """One step in progress on one stage: its receives, stashed microbatches, sends and loss so far."""

    data: StepData
    receives: "_Receives"
    stash: dict[int, "_Stash"]
    sends: list[comm.SendHandle]
    loss_sum: float = 0.0
    weight_work: dict[int, WeightWork] = field(default_factory=dict)  # microbatches through I, waiting for W
    # Called once, when the step's urgent first work is done: its first activation sent, or (a stage whose step
    # begins by waiting) its receives posted. The loop posts its part of the step's reduction there.
    started: Optional[Callable[[], None]] = None


@dataclass
class _Stash:
    inputs: list[Any]  # the stage's flat input tensors (k > 0: as received), which collect the input grads
    outputs: Any  # the flat output tensors sent, or the loss on the last stage
    weights: Optional[dict[str, torch.Tensor]] = None  # PipeDream: the stashed weight version


class StepExecutor:
    """Runs the actions of stage `stage_id` (one of `num_stages`) for one step. `route(stage, j)` is the
    rank holding microbatch j of a stage; `decode(outputs)` rebuilds the model output on the last stage."""

    meter: Any = NO_METER  # memory_probe.StashMeter when the run measures what each microbatch keeps

    def __init__(self, *, stage: nn.Module, stage_id: int, num_stages: int, actions: Sequence[Action],
                 route: Callable[[int, int], int], config: TrainConfig, criterion: Callable[[Any, torch.Tensor], torch.Tensor],
                 decode: Callable[[Sequence[Any]], Any], device: torch.device, header_cache: comm.HeaderCache,
                 metrics: Any, timeout: float, flush: bool = True, weight_stash: Optional[WeightStash] = None,
                 tag_per_edge: bool = False, local: Optional[Mailbox] = None) -> None:
        self.stage, self.stage_id, self.num_stages, self.actions = stage, stage_id, num_stages, tuple(actions)
        self.tag_per_edge = tag_per_edge  # several stages per rank: one tag per stage edge (comm.edge_tag)
        self.local = local  # the rank's mailbox between its own stages (ZBV: stage p-1 -> p), or None
        self.route, self.config, self.criterion, self.decode = route, config, criterion, decode
        self.device, self.header_cache, self.metrics, self.timeout = device, header_cache, metrics, timeout
        self.flush, self.weight_stash = flush, weight_stash  # PipeDream: no flush; a stash when the stage has weights
        self.recompute = config.recompute_stage(stage_id)
        if weight_stash is not None and any(a.kind in (INPUT, WEIGHT) for a in self.actions):
            raise ModelParallelError("a split backward (I, W) updates the weights after the flush; PipeDream's weight "
                                     "stashing updates after each backward: run zero-bubble schedules with a flush")
        self.wire_dtype = config.wire_dtype  # bf16: float32 boundary values and gradients travel rounded to bf16
        # Boundary values are named by node id in errors (a PipeDream package's stage may have no names).
        names = getattr(stage, "output_names", None)
        self.output_names = tuple(names) if names is not None else None
        # Received structures found to be a plain list of the leaves in order (the usual boundary of
        # tensors): by identity, since a cached header hands out the same object every message.
        self._flat_trees: dict[int, Any] = {}

    def tag(self, base: int, edge: int) -> int:
        """The tag of kind `base` on the edge between stages `edge` and `edge` + 1."""
        return comm.edge_tag(base, edge if self.tag_per_edge else None)

    def _unflatten(self, leaves: list[Any], tree: Any) -> list[Any]:
        """`structure.unflatten`, with a shortcut for a flat list of leaves (no walk per microbatch)."""
        if tree is None:
            return leaves
        if self._flat_trees.get(id(tree)) is tree:  # verified for this many leaves (a header fixes the count)
            return list(leaves)
        value = structure.unflatten(leaves, tree, self.device)
        if _is_flat(tree, len(leaves)):
            self._flat_trees[id(tree)] = tree  # held here, so its id stays its own
        return value

    def forward(self, values: Sequence[Any], weights: Optional[dict[str, torch.Tensor]] = None) -> Any:
        """Run the stage; with `weights` (PipeDream weight stashing) on those parameter tensors instead."""
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.config.bf16 else nullcontext()
        module: Any = self.stage
        if weights is not None:
            from torch.func import functional_call

            module = lambda *args: functional_call(self.stage, weights, args)  # noqa: E731
        with autocast:
            if self.recompute:
                from torch.utils.checkpoint import checkpoint

                return checkpoint(module, *values, use_reentrant=False)
            return module(*values)

    def run(self, step: int, data: StepData, compute: Compute, started: Optional[Callable[[], None]] = None) -> float:
        """The step's actions on what this rank read (`data`). Returns this rank's share of the loss.
        `started` runs once: right after the step's first activation send is posted when the step begins
        with a forward that sends one, else once the step's first receives are posted."""
        state = self.begin(data)
        state.started = started
        if not state.receives.deferred:
            self._started(state)
        for action in self.actions:
            self.act(step, state, action, compute)
        return self.finish(state)

    def begin(self, data: StepData) -> StepState:
        """A step's state, its first receives posted."""
        return StepState(data, _Receives(self, self.stage_id == self.num_stages - 1), {}, [])

    def act(self, step: int, state: StepState, action: Action, compute: Compute) -> None:
        """Run one of this stage's actions of the step."""
        k, m = self.stage_id, self.config.num_microbatches
        last = k == self.num_stages - 1
        # Flush schedules: loss / m, one update per step. PipeDream: each microbatch is an update.
        loss_scale = m if self.flush else 1
        data, receives, stash, sends = state.data, state.receives, state.stash, state.sends
        j = action.microbatch
        if action.is_forward:
            if k == 0:
                assert data.inputs is not None, "stage 0 reads its inputs"
                inputs = values = list(data.inputs[j])
                receives.skip("F")
            else:
                inputs, tree = receives.take("F", j)
                values = self._unflatten(inputs, tree)
            self.meter.begin(j)
            weights = self.weight_stash.stash() if self.weight_stash is not None else None
            if last:
                assert data.targets is not None, "the last stage reads its targets"
                target = data.targets[j]

                def forward_loss() -> torch.Tensor:
                    output = self.decode(self.forward(values, weights))
                    if self.config.bf16:
                        output = float_output(output)
                    return self.criterion(output, target) / loss_scale
                with seeded_forward(self.device, self.config.seed, step, k, j):  # dropout's masks (step/rng.py)
                    loss = compute("forward", j, forward_loss, stage=k)
                state.loss_sum += float(loss.detach()) * loss_scale / m
                stash[j] = _Stash(inputs, loss, weights=weights)
            else:
                with seeded_forward(self.device, self.config.seed, step, k, j):
                    outputs = compute("forward", j, lambda: self.forward(values, weights), stage=k)
                with self.metrics.measure("send", microbatch=j, stage=k):
                    leaves, handle = self._send_forward(j, outputs, stream=j)
                sends.append(handle)
                stash[j] = _Stash(inputs, leaves, weights=weights)
                # Only now what this step posts but needs later: the first activation left without them.
                receives.release()
                self._started(state)
            self.meter.kept(j, stash[j])
            return
        if action.kind == WEIGHT:
            work = state.weight_work.pop(j)
            compute("backward", j, lambda: backward_weight(work), "backward W", stage=k)
            self.meter.release(j)
            return
        entry = stash.pop(j)
        output_grads: list[Optional[torch.Tensor]]
        if last:
            outputs, output_grads = [entry.outputs], [None]
        else:
            received, _ = receives.take("B", j)
            if len(received) != len(entry.outputs):
                raise PeerError(f"stage {k + 1} sent {len(received)} gradients for microbatch {j}, expected "
                                f"{len(entry.outputs)} (one per tensor sent); are both ranks running the same plan?")
            pairs = [(o, g) for o, g in zip(entry.outputs, received)
                     if isinstance(o, torch.Tensor) and o.requires_grad and isinstance(g, torch.Tensor)]
            outputs, output_grads = [o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs]
        if action.kind == INPUT:
            params = list(self.stage.parameters())
            input_grads, state.weight_work[j] = compute(
                "backward", j, lambda: backward_input(outputs, output_grads, entry.inputs, params), "backward I", stage=k)
            self.meter.keep(j, state.weight_work[j].gradients())
        else:
            if outputs:
                compute("backward", j, lambda: torch.autograd.backward(outputs, output_grads), stage=k)
            input_grads = [v.grad if isinstance(v, torch.Tensor) and v.requires_grad else None for v in entry.inputs]
        if k > 0:
            with self.metrics.measure("send", microbatch=j, stage=k):
                sends.append(self._send(input_grads, self.route(k - 1, j), self.tag(comm.TAG_GRADIENT, k - 1), j))
        if self.weight_stash is not None and entry.weights is not None:
            self.weight_stash.update(step, entry.weights)
        if action.kind != INPUT:  # after an I the weight path's tensors live on until its W
            self.meter.release(j)

    @staticmethod
    def _started(state: StepState) -> None:
        started = state.started
        if started is not None:
            state.started = None
            started()

    def finish(self, state: StepState) -> float:
        """Wait for the step's sends; returns this stage's share of the loss."""
        with self.metrics.measure("send", stage=self.stage_id):
            for handle in state.sends:
                handle.wait(self.timeout)
        return state.loss_sum

    def _send_forward(self, j: int, outputs: Any, stream: Any) -> tuple[list[Any], comm.SendHandle]:
        """Send microbatch j's outputs to the next stage, flat; returns the leaves sent and the handle."""
        values = list(outputs)
        names = self.output_names or tuple(f"output {i}" for i in range(len(values)))
        leaves, tree = structure.flatten_values(values, names)
        handle = self._send(leaves, self.route(self.stage_id + 1, j), self.tag(comm.TAG_ACTIVATION, self.stage_id),
                            stream, structure=tree)
        return leaves, handle

    def _send(self, values: list[Any], dst: int, tag: int, stream: Any, structure: Any = None) -> comm.SendHandle:
        """A message to rank `dst`; to a stage of this rank (ZBV's V), into the mailbox, nothing to wait for."""
        if self.local is not None and dst == self.local.rank:
            self.local.put(tag, stream, values, structure)
            return comm.SendHandle(works=[], buffers=[], peer=dst)
        return comm.send_values(values, dst, tag, device=self.device, cache=self.header_cache, stream=stream,
                                structure=structure, wire_dtype=self.wire_dtype)

    def recv(self, src: int, tag: int, stream: Any) -> "comm.PendingRecv | LocalRecv":
        """A receive from rank `src`, posted now; from a stage of this rank, out of the mailbox."""
        if self.local is not None and src == self.local.rank:
            return LocalRecv(self.local, tag, stream)
        return comm.PendingRecv(src, tag, device=self.device, cache=self.header_cache, stream=stream)

    def run_forward(self, data: StepData,
                    metric: Optional[Callable[[Any, torch.Tensor], Any]] = None) -> tuple[float, float]:
        """Forward-only (validation): this rank's microbatches in order, under no_grad; no stash, no
        backward, no update. Returns this rank's share of (mean loss, mean metric): nonzero on the last stage."""
        k, m = self.stage_id, self.config.num_microbatches
        last = k == self.num_stages - 1
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.config.bf16 else nullcontext()
        sends: list[comm.SendHandle] = []
        loss_sum = metric_sum = 0.0
        # Streams of their own: the training steps' cached headers stay as they are.
        for j in sorted({a.microbatch for a in self.actions if a.is_forward}):
            if k == 0:
                assert data.inputs is not None, "stage 0 reads its inputs"
                values = list(data.inputs[j])
            else:
                pending = self.recv(self.route(k - 1, j), self.tag(comm.TAG_ACTIVATION, k - 1), ("eval", j))
                values = self._unflatten(pending.wait(self.timeout), pending.structure)
            with torch.no_grad(), autocast:
                outputs = self.stage(*values)
            if last:
                assert data.targets is not None, "the last stage reads its targets"
                target = data.targets[j]
                output = self.decode(outputs)
                output = float_output(output) if self.config.bf16 else output
                with torch.no_grad():
                    loss_sum += float(self.criterion(output, target)) / m
                    metric_sum += float(metric(output, target)) / m if metric is not None else 0.0
            else:
                sends.append(self._send_forward(j, outputs, stream=("eval", j))[1])
        for handle in sends:
            handle.wait(self.timeout)
        return loss_sum, metric_sum


def _is_flat(tree: Any, count: int) -> bool:
    """Whether `tree` is {"list": [{"leaf": 0}, ..., {"leaf": count - 1}]} (ints, not bools)."""
    items = tree.get("list") if isinstance(tree, dict) and len(tree) == 1 else None
    return isinstance(items, list) and len(items) == count and all(
        type(item) is dict and len(item) == 1 and type(item.get("leaf")) is int and item["leaf"] == i
        for i, item in enumerate(items))


class _Receives:
    """The next `AHEAD` activation and gradient receives of a step, posted ahead so they land during compute.

    Two, not one: gloo sends a message only once the receiver's receive is posted; otherwise the send
    waits for the receiver's notice, which the sender's gloo thread handles while its training thread
    waits elsewhere: two more thread wake-ups on the critical path of every message. A stage
    before this one runs one warm-up forward more than this one (1F1B), so it sends up to two
    activations ahead of this stage's forwards (issue #37, "Fixed cost per step"; docs/runtime.md).
    Safe on one tag: a cached message is one transfer on its tag (comm.py, side tag).

    A stage whose step begins with a forward posts its gradient receives only once that forward's activation
    is sent (`release`): each post costs ~0.1 ms of the training thread on the 2-core VM, and the first
    activation is on the critical path, while the first gradient comes back a stage's forward and
    backward later at the earliest."""

    AHEAD = 2

    def __init__(self, executor: StepExecutor, last: bool) -> None:
        self.executor, self.last = executor, last
        self.queues = {"F": [a for a in executor.actions if a.is_forward],
                       "B": [a for a in executor.actions if a.sends_gradient]}
        self.position = {"F": 0, "B": 0}  # the next action of each kind to run
        self.posted = {"F": 0, "B": 0}  # how many of each kind's receives are posted (or need none)
        self.pending: dict[str, deque["Optional[comm.PendingRecv | LocalRecv]"]] = {"F": deque(), "B": deque()}
        self.deferred = bool(executor.actions) and executor.actions[0].is_forward and not last
        self._top_up("F")
        if not self.deferred:
            self._top_up("B")

    def release(self) -> None:
        """Post the deferred gradient receives (after the step's first activation send, or before a wait)."""
        if self.deferred:
            self.deferred = False
            self._top_up("B")

    def _top_up(self, kind: str) -> None:
        queue = self.queues[kind]
        while self.posted[kind] < min(len(queue), self.position[kind] + self.AHEAD):
            self.pending[kind].append(self._post(kind, queue[self.posted[kind]].microbatch))
            self.posted[kind] += 1

    def _post(self, kind: str, j: int) -> "Optional[comm.PendingRecv | LocalRecv]":
        x, k = self.executor, self.executor.stage_id
        if kind == "F" and k > 0:
            return x.recv(x.route(k - 1, j), x.tag(comm.TAG_ACTIVATION, k - 1), j)
        if kind == "B" and not self.last:
            return x.recv(x.route(k + 1, j), x.tag(comm.TAG_GRADIENT, k), j)
        return None

    def skip(self, kind: str) -> None:
        """An action that needs no receive (stage 0's forwards read the data)."""
        self.pending[kind].popleft()
        self.position[kind] += 1
        self._top_up(kind)

    def take(self, kind: str, j: int) -> tuple[list[Any], Any]:
        """The flat values of microbatch j's message and the structure the sender attached (or None)."""
        self.release()
        pending = self.pending[kind].popleft()
        assert pending is not None
        with self.executor.metrics.measure("recv", microbatch=j, stage=self.executor.stage_id):
            values = pending.wait(self.executor.timeout)
        self.position[kind] += 1
        self._top_up(kind)
        return values, pending.structure
