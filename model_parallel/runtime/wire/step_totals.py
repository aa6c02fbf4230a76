"""The one reduction of every training step: [loss, squared gradient norm, command length, stop requests] summed
over all ranks.

A step used to end with two collectives on the control group: an all-reduce of [loss, squared norm]
and a broadcast of rank 0's decision (its length, then its bytes), even when there was nothing to say:
with tiny stages 1-2 ms a step more than torch.distributed.pipelining, which has neither
(docs/runtime.md, "Fixed cost per step"). Now the decision rides in the reduction: rank 0 writes the
byte length of its command's JSON into the third slot and every other rank writes 0, so the sum is
that length on every rank. 0: carry on, and nothing else travels; n > 0: one broadcast of exactly n
bytes follows (`receive_command`). A float64 holds every integer up to 2**53 exactly. The fourth slot is 1
from each rank a signal asked to stop (runtime/step/stop_signals.py): every rank learns at the same step.

The reduction is no gloo collective but point-to-point through one root rank on the control group
(`Posted`): every other rank sends its three numbers and receives the sums. Measured on the tiny row, an
all-reduce cost ~1 ms a step more (a process-group worker thread woken twice a step per rank, on a
machine where every wake-up waits for a core); p2p messages are posted by the training thread itself,
and a wait names the peer it waits for. The root adds its own part, then the others in rank order, so
every rank gets the same sums, whatever order they arrived in. The engine makes the root the rank of the
last stage (`root_rank`): its part (the loss) is the last one known in a step, every other part (0
without clipping) was posted early in the step (right after the rank's first activation left: the
loop's `started`), so the root never waits, and the sums it sends
back reach each other rank while that rank still waits for its last gradient. The root posts its
receives early as well, right after its step's activation receives (its own part follows:
`Posted.contribute`): gloo sends a
message only into a posted receive, and a part that found none waited for both processes' gloo
threads (measured: ~0.9 ms a step on the loaded machine). With rank 0 as the
root, the last stage waited for rank 0's update before its next step could begin, and rank 0's
first activation of that step found no receive posted (gloo then waits for one: comm.py).

Rank 0 polls its channel in step k, just before its part of the reduction, so a command is applied by
every rank at the boundary after step k (before step k + 1): one step after the report it may answer,
which was step k - 1's. The poll passes `before_step=k + 1`, which a scripted channel plays exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist

from model_parallel.errors import ProtocolError
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command
from model_parallel.runtime.wire.agreement import broadcast_bytes
from model_parallel.runtime.wire.comm import TAG_TOTALS, start_work, wait_work

# Larger is no command: a plan of a million-node graph is a few MB of JSON.
MAX_COMMAND_BYTES = 1 << 30


@dataclass(frozen=True)
class StepTotals:
    """One step's sums over every rank."""

    loss: float  # the minibatch loss (the last stage's sum over microbatches; other ranks add 0)
    squared_norm: float  # the global squared gradient norm (0.0 when not clipping)
    command_bytes: int  # the length of rank 0's command JSON; 0: no command this step
    stop_requests: int = 0  # ranks a signal asked to stop (runtime/step/stop_signals.py); 0: carry on


def pack(loss_sum: float, squared_norm: float, command: Optional[Command], stop: bool = False
         ) -> tuple[torch.Tensor, bytes]:
    """This rank's contribution to the reduction, and the command body it will broadcast (rank 0 only
    passes a command; empty bytes for none). `stop`: a signal asked this rank to stop."""
    payload = command.to_json().encode() if command is not None else b""
    return torch.tensor([loss_sum, squared_norm, float(len(payload)), float(stop)], dtype=torch.float64), payload


class Posted:
    """The step's reduction in flight, through `root`: every other rank sends it its contribution and
    receives the sums back (point-to-point on `group`, which spans every rank: no collective, so no
    process-group worker thread, and a wait that names its peer). `wait` leaves the sums in `totals`;
    `payload` is the command body this rank will broadcast (rank 0's; empty elsewhere)."""

    def __init__(self, totals: torch.Tensor, payload: bytes, group: Any, root: int = 0) -> None:
        self.totals, self.payload, self.group, self.root = totals, payload, group, root
        self.rank = dist.get_rank()
        if self.rank == root:  # every receive posted now: the contributions land while this rank computes
            self.parts = [(peer, torch.empty_like(totals)) for peer in range(dist.get_world_size(group)) if peer != root]
            self.works = [(peer, _start(dist.irecv, part, peer, group)) for peer, part in self.parts]
        else:
            self.mine = totals.clone()  # in flight while `totals` receives the sums
            self.works = [(root, _start(dist.isend, self.mine, root, group)), (root, _start(dist.irecv, totals, root, group))]

    def contribute(self, loss_sum: float, squared_norm: float, stop: bool = False) -> None:
        """The root's own loss and norm, known after its step's work: its receives were posted when the step
        began (the command length it may have written then stays; a stop asked for since is added)."""
        assert self.rank == self.root, "only the root contributes after posting"
        self.totals[0], self.totals[1] = loss_sum, squared_norm
        self.totals[3] = max(float(self.totals[3]), float(stop))

    def wait(self, timeout: float) -> None:
        """Block until this rank holds the sums (the root: until every rank was sent them); PeerError naming a peer."""
        for peer, work in self.works:
            wait_work(work, timeout, peer, WHAT)
        if self.rank != self.root:
            return
        for _, part in self.parts:  # in rank order: the same sums whatever order they arrived in
            self.totals += part
        sends = [(peer, _start(dist.isend, self.totals, peer, self.group)) for peer, _ in self.parts]
        for peer, work in sends:
            wait_work(work, timeout, peer, WHAT)


WHAT = "the step's loss reduction"


def _start(op: Any, tensor: torch.Tensor, peer: int, group: Any) -> Any:
    return start_work(partial(op, tensor, peer, group=group, tag=TAG_TOTALS), peer, WHAT)


def post(loss_sum: float, squared_norm: float, command: Optional[Command], group: Any, root: int = 0,
         stop: bool = False) -> Posted:
    """Start this rank's part of the step's reduction over `group` through `root` (every rank, once per
    step, in step order, with the same root)."""
    totals, payload = pack(loss_sum, squared_norm, command, stop)
    return Posted(totals, payload, group, root)


def root_rank(plan: Plan) -> int:
    """The reduction's root under `plan`: the first rank of its last stage (see the module docstring)."""
    return max(plan.stages, key=lambda stage: stage.stage_id).ranks[0]


def unpack(totals: torch.Tensor) -> StepTotals:
    """The reduced vector as `StepTotals`; a command length that is no whole number of bytes in
    0..MAX_COMMAND_BYTES (a rank that wrote into the slot) is refused, never guessed."""
    loss, squared_norm, length, stops = (float(x) for x in totals.tolist())
    if not (math.isfinite(length) and length == int(length) and 0 <= length <= MAX_COMMAND_BYTES):
        raise ProtocolError(f"the step reduction announced a command of {length!r} bytes; expected a whole number "
                            f"in 0..{MAX_COMMAND_BYTES} (only rank 0 may write the command slot: a rank of another "
                            "version of model_parallel?)")
    if not (math.isfinite(stops) and stops == int(stops) and stops >= 0):
        raise ProtocolError(f"the step reduction counted {stops!r} ranks asked to stop; expected a whole number >= 0 "
                            "(a rank of another version of model_parallel?)")
    return StepTotals(loss, squared_norm, int(length), int(stops))


def receive_command(totals: StepTotals, payload: bytes, group: Any, timeout: float) -> Optional[Command]:
    """Collective when `totals.command_bytes` > 0 (every rank knows it, from the reduction): rank 0's
    command on every rank. Nothing travels when there is none."""
    if not totals.command_bytes:
        return None
    return Command.from_json(broadcast_bytes(payload, totals.command_bytes, 0, group, timeout).decode())
