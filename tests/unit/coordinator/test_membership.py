"""The coordinator follows the job's membership: a world the survivors re-formed (`--recover`) registers as the next
generation with its own plan, and a coordinator started again learns the live plan from the workers (issue 36
items 1-2, the coordinator's half; the processes' half is tests/integration/test_recovery_coordinator.py)."""
from dataclasses import replace

import pytest

from model_parallel.cli.ctl import format_status
from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.client import CoordinatorChannel
from model_parallel.errors import ProtocolError
from model_parallel.graph.plan import Plan, StagePlan
from support import wait_for
from support.coordinators import chain_graph, live_coordinator, two_stage_plan

TOKEN = b"membership-token"
GRAPH = chain_graph(6)


def three_stage_plan() -> Plan:
    ids = list(GRAPH.topological_order)
    return Plan((StagePlan(0, tuple(ids[:3]), ranks=(0,)), StagePlan(1, tuple(ids[3:5]), ranks=(1,)),
                 StagePlan(2, tuple(ids[5:]), ranks=(2,))))


@pytest.fixture
def coordinator():
    with live_coordinator(TOKEN, GRAPH, three_stage_plan(), policy="manual", config=pol.PolicyConfig(window=3),
                          heartbeat_timeout=30) as coord:
        yield coord


def survivors(address: str, version: int) -> list[CoordinatorChannel]:
    """Original ranks 0 and 2 after original rank 1 was lost: generation 1, a world of 2, their even split."""
    plan = replace(two_stage_plan(GRAPH, 4), version=version)
    membership = {"members": [0, 2], "lost": [1], "from_step": 4}
    return [CoordinatorChannel(address, TOKEN, rank=r, world_size=2, live_plan=plan, recover=True, generation=1,
                               membership=membership) for r in (0, 1)]


def test_a_reformed_world_is_the_next_generation_with_the_survivors_plan(coordinator) -> None:
    first = [CoordinatorChannel(coordinator.address, TOKEN, rank=r, world_size=3, recover=True) for r in range(3)]
    assert first[0].issued == 0
    for channel in first[::2]:  # the survivors' old channels: a lost peer is not their end under --recover
        channel.close("failed: rank 1 stopped responding")
    wait_for(lambda: [w.status for w in coordinator.workers.values()] == ["recovering", "running", "recovering"])
    assert coordinator.stop_reason is None and not coordinator.done.is_set()
    new = survivors(coordinator.address, version=1)
    try:
        status = coordinator.handle_ctl("status", {})
        assert (status["generation"], status["world_size"], status["plan_version"]) == (1, 2, 1)
        assert sorted(w["rank"] for w in status["workers"]) == [0, 1]  # the old world's registrations are gone
        [recovery] = status["recoveries"]
        assert (recovery["lost"], recovery["members"], recovery["from_step"], recovery["plan_version"]) == ([1], [0, 2], 4, 1)
        assert status["history"][-1]["reason"].startswith("recovery: generation 1, original rank(s) [1] lost")
        assert ("membership generation 1: original rank(s) [1] lost; a world of 2 (original ranks [0, 2]) from step 4 "
                "on plan v1") in format_status(status)  # what `ctl status` prints
        # The policy works on the new world: a scale onto one worker is plan v2, sent to the new rank 0.
        coordinator.handle_ctl("scale", {"workers": 1})
        command = wait_for(new[0].poll)
        assert command.kind == "switch" and command.plan.version == 2 and len(command.plan.stages) == 1
        # A process of the old generation (the lost one, back from SIGSTOP) is refused, naming why.
        with pytest.raises(ProtocolError, match="registers in membership generation 0, but the job re-formed as "
                                                "generation 1 without it: that process was replaced"):
            CoordinatorChannel(coordinator.address, TOKEN, rank=1, world_size=3, timeout=5)
    finally:
        for channel in first + new:
            channel.close()


def test_a_reformed_world_that_numbers_its_plan_too_low_is_warned_about_and_issues_go_above(coordinator, caplog) -> None:
    first = [CoordinatorChannel(coordinator.address, TOKEN, rank=r, world_size=3) for r in range(3)]
    coordinator.handle_ctl("scale", {"workers": 2})  # v1 sent to rank 0, never applied (rank 0 is lost below)
    new = survivors(coordinator.address, version=1)
    try:
        assert "the re-formed world runs plan v1, but this coordinator already spent v1" in caplog.text
        # The switch the old world never applied is abandoned, not left pending or taken for live.
        status = coordinator.handle_ctl("status", {})
        assert status["pending_version"] is None, status
        spent = status["history"][0]
        assert spent["version"] == 1 and "applied_at_step" not in spent, status["history"]
        assert spent["abandoned"].startswith("recovery: generation 1"), spent
        coordinator.handle_ctl("scale", {"workers": 1})
        assert wait_for(new[0].poll).plan.version == 2
    finally:
        for channel in first + new:
            channel.close()


def test_a_switch_given_up_when_rank_0_left_to_re_form_is_recorded_as_abandoned(coordinator) -> None:
    first = [CoordinatorChannel(coordinator.address, TOKEN, rank=r, world_size=3, recover=True) for r in range(3)]
    coordinator.handle_ctl("scale", {"workers": 2})  # v1 sent to rank 0 ...
    first[0].close("failed: rank 1 stopped responding")  # ... whose connection ends before it answers
    wait_for(lambda: coordinator.rebalancer.pending is None, what="the switch given up with its connection")
    new = survivors(coordinator.address, version=1)
    try:
        spent = coordinator.handle_ctl("status", {})["history"][0]
        assert spent["version"] == 1 and "applied_at_step" not in spent, spent
        assert spent["abandoned"].startswith("recovery: generation 1"), spent
        assert coordinator.rebalancer.dropped is None  # no late report of the old world's v1 confirms it now
    finally:
        for channel in first + new:
            channel.close()


def test_a_restarted_coordinator_learns_the_live_plan_from_the_workers(coordinator) -> None:
    live = replace(three_stage_plan(), version=4)
    channels = []
    try:
        for rank in (1, 0, 2):  # reconnecting after the coordinator they knew died: same token, same address
            channels.append(CoordinatorChannel(coordinator.address, TOKEN, rank=rank, world_size=3, live_plan=live))
        status = coordinator.handle_ctl("status", {})
        assert status["plan_version"] == 4 and status["learned"] == {"plan_version": 4, "from_rank": 1, "at_step": 0}
        assert "learned from the workers (this coordinator started while the job ran): plan v4 from rank 1" in format_status(status)
        assert [w["rank"] for w in status["workers"]] == [0, 1, 2]
        coordinator.handle_ctl("scale", {"workers": 2})
        assert wait_for(channels[1].poll).plan.version == 5  # above the live plan, which the workers would refuse
    finally:
        for channel in channels:
            channel.close()


def test_a_plan_the_coordinator_cannot_serve_is_refused_naming_it(coordinator) -> None:
    bad = Plan((StagePlan(0, ("input0", "nowhere"), ranks=(0,)),), version=3)
    with pytest.raises(ProtocolError, match="runs a plan this coordinator cannot serve"):
        CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=3, live_plan=bad, timeout=5)
    status = coordinator.handle_ctl("status", {})
    assert status["plan_version"] == 0 and status["workers"] == []


def test_a_reformed_world_trains_on_when_the_coordinator_is_gone_too(caplog) -> None:
    from model_parallel.runtime.launch import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there: the coordinator was lost with the worker
    with pytest.raises(ProtocolError, match="cannot reach the coordinator"):  # the first world still fails fast
        CoordinatorChannel(address, TOKEN, rank=0, world_size=2, timeout=2)
    channel = CoordinatorChannel(address, TOKEN, rank=0, world_size=2, generation=1, timeout=2,
                                 live_plan=replace(two_stage_plan(GRAPH, 4), version=3))
    try:
        assert channel.session is None and "cannot reach the coordinator" in channel.lost
        assert "cannot register with the coordinator at" in caplog.text and "training continues" in caplog.text
        assert channel.poll() is None and channel.plan_floor == 3
    finally:
        channel.close()


def test_a_world_that_admitted_a_joiner_is_the_next_generation_with_the_joiner_a_spare(coordinator) -> None:
    first = [CoordinatorChannel(coordinator.address, TOKEN, rank=r, world_size=3, recover=True) for r in range(3)]
    for channel in first:
        channel.reforming()  # the admission's stop: the bye says "recovering", the job is not over
        channel.close("stopped after 5 of the 9 requested step(s): admitting a joining worker")
    wait_for(lambda: [w.status for w in coordinator.workers.values()] == ["recovering"] * 3)
    assert coordinator.stop_reason is None
    plan = replace(three_stage_plan(), version=1)  # the plan the world ran, original rank 3 a spare in it
    membership = {"members": [0, 1, 2, 3], "lost": [], "joined": [3], "from_step": 5}
    new = [CoordinatorChannel(coordinator.address, TOKEN, rank=r, world_size=4, live_plan=plan, recover=True,
                              generation=1, membership=membership) for r in range(4)]
    try:
        status = coordinator.handle_ctl("status", {})
        assert (status["generation"], status["world_size"], status["plan_version"]) == (1, 4, 1)
        [change] = status["recoveries"]
        assert (change["joined"], change["lost"], change["members"]) == ([3], [], [0, 1, 2, 3]), change
        assert status["history"][-1]["reason"].startswith("admission: generation 1, original rank(s) [3] joined")
        assert "original rank(s) [3] joined (spares); a world of 4" in format_status(status)
        coordinator.handle_ctl("scale", {"workers": 4})  # the policy may give the spare a share
        command = wait_for(new[0].poll)
        assert command.kind == "switch" and command.plan.version == 2 and len(command.plan.stages) == 4
    finally:
        for channel in first + new:
            channel.close()


def test_an_admission_that_lost_a_member_says_so_and_does_not_call_the_joiner_a_spare(coordinator, caplog) -> None:
    # QA: original rank 1 lost while the world re-formed for the admission of rank 3 (recovery.reform's retry): the
    # world [0, 2, 3] runs the 3-rank plan it ran, so the joiner (current rank 2) holds stage 2. The coordinator logged
    # "[3] joined ... the joiner a spare until a rebalance gives it a share" and ctl status "[3] joined (spares)",
    # naming the loss nowhere.
    first = [CoordinatorChannel(coordinator.address, TOKEN, rank=r, world_size=3, recover=True) for r in range(3)]
    for channel in first:
        channel.reforming()
        channel.close("stopped after 5 of the 9 requested step(s): admitting a joining worker")
    wait_for(lambda: [w.status for w in coordinator.workers.values()] == ["recovering"] * 3)
    plan = replace(three_stage_plan(), version=1)
    membership = {"members": [0, 2, 3], "lost": [1], "joined": [3], "from_step": 5}
    new = [CoordinatorChannel(coordinator.address, TOKEN, rank=r, world_size=3, live_plan=plan, recover=True,
                              generation=2, membership=membership) for r in range(3)]
    try:
        status = coordinator.handle_ctl("status", {})
        assert "original rank(s) [3] joined, [1] lost; a world of 3 (original ranks [0, 2, 3])" in format_status(status)
        assert "lost while it re-formed" in status["history"][-1]["reason"], status["history"][-1]
        assert ("membership generation 2: original rank(s) [3] joined; original rank(s) [1] lost while it re-formed; "
                "a world of 3" in caplog.text and "the joiner holds the stage of the current rank it took" in caplog.text)
        assert "a spare until" not in caplog.text, caplog.text
    finally:
        for channel in first + new:
            channel.close()


def test_a_reformed_world_that_runs_a_stand_in_schedule_is_served_under_it(coordinator) -> None:
    # The first world ran interleaved; the survivors' world does not divide m and runs 1f1b on its even split
    # (cli/recover_schedule.py): their one-stage-per-rank plan is checked under 1f1b, not refused under interleaved.
    coordinator.rebalancer.schedule = "interleaved"
    plan = replace(two_stage_plan(GRAPH, 4), version=1)
    membership = {"members": [0, 2], "lost": [1], "from_step": 4}
    new = [CoordinatorChannel(coordinator.address, TOKEN, rank=r, world_size=2, live_plan=plan, recover=True,
                              generation=1, membership=membership, schedule="1f1b") for r in (0, 1)]
    try:
        status = coordinator.handle_ctl("status", {})
        assert (status["generation"], status["world_size"], status["plan_version"]) == (1, 2, 1)
        assert coordinator.rebalancer.schedule == "1f1b"  # later plans are checked under what the world runs
    finally:
        for channel in new:
            channel.close()
