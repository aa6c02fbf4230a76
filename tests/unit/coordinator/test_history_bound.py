"""A run that rebalances all day (a noisy shared machine switched 19 times in 4,000 steps): the coordinator's switch
history grew ~280 bytes a switch for ever, in memory, in the status file rewritten every second and in every
`ctl status` reply, which past ~3,700 switches no longer fit a frame (protocol.MAX_FRAME_BYTES); `ctl status` printed a
line per switch. It keeps the last HISTORY_LOG, counts them all (`switches`), and the text shows the latest few.
The same for the re-formed worlds of an elastic job (`recoveries`: a line each, for ever)."""
import json

from model_parallel.cli.ctl import format_status
from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.protocol import MAX_FRAME_BYTES
from model_parallel.coordinator.rebalancer import Rebalancer
from model_parallel.coordinator.solver import default_solver
from model_parallel.coordinator.status import Roster
from tests.unit.coordinator.test_policy_replay import chain_graph, even_plan

HISTORY_LOG, STATUS_SWITCHES = 100, 10  # kept (rebalancer.HISTORY_LOG, status.RECOVERY_LOG), printed (ctl.STATUS_LINES)
REASON = ("auto: predicted 5.20 -> 2.57 ms per step of the slowest rank's compute (50.6% gain); back to the plan "
          "before the last switch, which was made for a change that did not last")


def _moved(plan, k):
    """`plan` with its first cut moved by `k % 2` nodes: two plans to switch between."""
    first, second = plan.stages[0], plan.stages[1]
    nodes = first.node_ids + second.node_ids
    cut = len(first.node_ids) + (1 if k % 2 else 0)
    return plan.__class__((first.__class__(0, nodes[:cut], ranks=(0,)), second.__class__(1, nodes[cut:], ranks=(1,))))


def test_many_switches_keep_the_status_bounded():
    graph = chain_graph(8)
    plan = even_plan(graph, 2)
    rebalancer = Rebalancer(graph, plan, pol.PolicyConfig(), default_solver, auto=True, world_size=2)
    link = object()
    switches = 3 * HISTORY_LOG + 7
    for k in range(switches):
        issued = rebalancer.issue(_moved(plan, k + 1), REASON, 10 * k, lambda rank, command: link, predicted=False)
        assert issued is not None and rebalancer.pending is not None
        rebalancer.confirm(10 * k + 2)
    summary = rebalancer.summary(Roster(2).workers)
    assert len(summary["history"]) == HISTORY_LOG
    assert summary["plan_version"] == switches and summary["switches"] == switches
    assert [h["version"] for h in summary["history"]] == list(range(switches - HISTORY_LOG + 1, switches + 1))
    assert summary["history"][-1]["applied_at_step"] == 10 * (switches - 1) + 2  # the newest is still confirmed
    assert len(json.dumps(summary)) < MAX_FRAME_BYTES // 10

    text = format_status({**summary, "policy": "auto", "workers": []})
    lines = [line for line in text.splitlines() if line.startswith("switch to v")]
    assert len(lines) == STATUS_SWITCHES and lines[-1].startswith(f"switch to v{switches}:")
    assert f"{switches - STATUS_SWITCHES} earlier switch(es) not shown" in text


def test_many_membership_generations_keep_the_status_bounded():
    roster = Roster(3)
    generations = 250
    for generation in range(1, generations + 1):
        roster.new_generation(generation, 3 - generation % 2, {
            "generation": generation, "lost": [1] if generation % 2 else [], "joined": [] if generation % 2 else [1],
            "members": [0, 2] if generation % 2 else [0, 1, 2], "world_size": 3 - generation % 2,
            "from_step": 100 * generation, "plan_version": generation})
    assert len(roster.recoveries) == HISTORY_LOG and roster.recoveries[-1]["generation"] == generations
    summary = {"plan_version": 0, "pending_version": None, "policy": "auto", "last_decision": "-", "table": "",
               "stages": [], "workers": [], "history": [], "recoveries": roster.recoveries}
    text = format_status(summary)
    lines = [line for line in text.splitlines() if line.startswith("membership generation")]
    assert len(lines) == STATUS_SWITCHES and lines[-1].startswith(f"membership generation {generations}:")
    assert f"{generations - STATUS_SWITCHES} earlier membership generation(s) not listed" in text
