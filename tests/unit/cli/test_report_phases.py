"""The demo report's throughput phases when the policy switched before the slowdown (a demo run re-planned at
step 9 for measured speeds, the straggler slowed at 15 and was rebalanced at 22): the rebalance is the switch
after the slowdown, not "step 9 (-6 steps after the slowdown)", and 'after' holds no slowed step."""
from __future__ import annotations

from model_parallel.cli.report import throughput_phases


def rows(*spec):
    return [{"step": step, "plan_version": version, "samples_per_s": value} for step, version, value in spec]


def test_a_switch_before_the_slowdown_is_not_the_rebalance():
    data = rows((0, 0, 1), (1, 0, 1), (2, 0, 60), (3, 0, 60), (4, 1, 5), (5, 1, 5), (6, 1, 80), (7, 1, 80),
                (8, 1, 30), (9, 1, 30), (10, 1, 30), (11, 1, 30), (12, 2, 5), (13, 2, 5), (14, 2, 70), (15, 2, 70))
    phases = throughput_phases(data, slow_at=8, settle=2)
    assert phases["switch_step"] == 12 and phases["steps_to_detect"] == 4
    assert phases["earlier_switches"] == [4]
    assert phases["before"] == 80  # on plan v1, the plan the slowdown hit, from its switch + settle
    assert phases["slowed"] == 30 and phases["after"] == 70


def test_only_a_switch_before_the_slowdown_leaves_no_rebalance():
    data = rows((0, 0, 9), (1, 0, 9), (2, 1, 9), (3, 1, 9), (4, 1, 9), (5, 1, 3), (6, 1, 3), (7, 1, 3), (8, 1, 3))
    phases = throughput_phases(data, slow_at=5, settle=1)
    assert phases["switch_step"] is None and phases["after"] is None and phases["earlier_switches"] == [2]
    assert phases["slowed"] == 3 and phases["before"] == 9
