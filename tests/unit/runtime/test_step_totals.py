"""The step's one reduction (runtime/wire/step_totals.py): [loss, squared norm, command length, stop requests], and
the command body that follows it only when rank 0 announced one."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from model_parallel.errors import ProtocolError
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.messages import Command, NullChannel, ScriptedChannel
from model_parallel.runtime.launch import free_port
from model_parallel.runtime.wire import step_totals
from model_parallel.runtime.wire.step_totals import MAX_COMMAND_BYTES, StepTotals

STOP = Command.stop("the operator asked")


def test_no_command_adds_zero_to_the_command_slot_and_has_no_body():
    totals, payload = step_totals.pack(1.5, 0.25, None)
    assert totals.dtype == torch.float64 and totals.tolist() == [1.5, 0.25, 0.0, 0.0]
    assert payload == b""
    assert step_totals.unpack(totals) == StepTotals(1.5, 0.25, 0)


def test_the_sum_over_ranks_carries_rank_0s_command_length_exactly():
    rank0, payload = step_totals.pack(0.0, 2.0, STOP)  # stage 0: no loss; rank 0 polled a stop
    last, nothing = step_totals.pack(3.25, 1.0, None)  # the last stage: the loss; no command
    assert payload == STOP.to_json().encode() and nothing == b""
    assert step_totals.unpack(rank0 + last) == StepTotals(3.25, 3.0, len(payload))
    # A switch carries a plan: its JSON is longer, and a float64 still holds the length exactly.
    plan = Plan(stages=tuple(StagePlan(k, tuple(f"node_{k}_{i}" for i in range(500)), ranks=(k,)) for k in range(4)))
    switch, body = step_totals.pack(0.0, 0.0, Command.switch(plan, "rebalance"))
    assert step_totals.unpack(switch).command_bytes == len(body) > 10_000
    assert Command.from_json(body.decode()) == Command.switch(plan, "rebalance")


@pytest.mark.parametrize("length, shown", [(2.5, "2.5"), (-1.0, "-1.0"), (float("nan"), "nan"),
                                           (float(MAX_COMMAND_BYTES + 1), str(float(MAX_COMMAND_BYTES + 1)))])
def test_a_command_length_that_no_rank_0_could_announce_is_refused(length, shown):
    totals = torch.tensor([0.0, 0.0, length, 0.0], dtype=torch.float64)
    with pytest.raises(ProtocolError, match=rf"announced a command of {shown} bytes; expected a whole number in "
                                            rf"0\.\.{MAX_COMMAND_BYTES} \(only rank 0 may write the command slot"):
        step_totals.unpack(totals)


def test_every_rank_learns_how_many_ranks_a_signal_asked_to_stop():
    """runtime/step/stop_signals.py: a rank that got SIGTERM writes 1; the sum is the same count on every rank."""
    first, _ = step_totals.pack(0.0, 0.0, None, stop=True)
    middle, _ = step_totals.pack(0.0, 0.0, None)
    last, _ = step_totals.pack(2.0, 0.0, None, stop=True)
    assert step_totals.unpack(first + middle + last) == StepTotals(2.0, 0.0, 0, 2)
    assert step_totals.unpack(middle + middle).stop_requests == 0
    with pytest.raises(ProtocolError, match=r"counted 0\.5 ranks asked to stop; expected a whole number >= 0"):
        step_totals.unpack(torch.tensor([0.0, 0.0, 0.0, 0.5], dtype=torch.float64))


def test_no_command_means_no_collective():
    # group=None and no process group at all: a broadcast would raise, so nothing was sent.
    assert not dist.is_initialized()
    assert step_totals.receive_command(StepTotals(1.0, 0.0, 0), b"", None, 1.0) is None


def test_an_announced_command_is_received_whole():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        posted = step_totals.post(2.5, 0.0, STOP, dist.group.WORLD)  # a world of one: rank 0 alone sums
        posted.wait(10.0)
        sums = step_totals.unpack(posted.totals)
        assert sums == StepTotals(2.5, 0.0, len(STOP.to_json().encode()))
        assert step_totals.receive_command(sums, posted.payload, None, 10.0) == STOP
        # The root posts before its step's work and contributes after it: a signal in between still counts.
        posted = step_totals.post(0.0, 0.0, None, dist.group.WORLD)
        posted.contribute(1.0, 0.0, stop=True)
        posted.wait(10.0)
        assert step_totals.unpack(posted.totals) == StepTotals(1.0, 0.0, 0, 1)
    finally:
        dist.destroy_process_group()


def test_a_scripted_channel_plays_the_step_the_runtime_asks_for():
    """The runtime polls in step k for the boundary before step k + 1, before it has reported step k."""
    channel = ScriptedChannel.from_json(json.dumps({"1": {"kind": "stop", "reason": "one"}, "3": {"kind": "stop"}}))
    assert channel.poll(before_step=1) == Command.stop("one")  # in step 0, nothing reported yet
    assert channel.poll(before_step=2) is None
    assert channel.poll(before_step=3) == Command.stop()
    assert channel.reports == []
    assert NullChannel().poll(before_step=1) is None


def test_the_root_is_the_first_rank_of_the_last_stage():
    plan = Plan(stages=(StagePlan(0, ("a",), ranks=(0,)), StagePlan(1, ("b",), ranks=(1,)),
                        StagePlan(2, ("c",), num_replicas=2, ranks=(2, 3))))
    assert step_totals.root_rank(plan) == 2
    assert step_totals.root_rank(Plan(stages=(StagePlan(0, ("a",), ranks=(0,)),))) == 0
