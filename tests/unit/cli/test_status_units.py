"""ctl status and the demo report: every table states its clock and scale; the report shows the final plan."""
import json

import pytest

from model_parallel.cli.ctl import format_status
from model_parallel.cli.report import final_plan
from model_parallel.errors import PlanError
from model_parallel.graph.plan import Plan, StagePlan


def two_stage(version):
    return Plan((StagePlan(0, ("a", "b"), ranks=(0,), compute_s=0.0306), StagePlan(1, ("c",), ranks=(1,))),
                version=version)


def test_ctl_status_labels_profile_and_measured_ms():
    plan = two_stage(1)
    status = {"plan_version": 1, "pending_version": None, "policy": "auto", "last_decision": "speeds steady",
              "table": plan.table(), "misses": 1, "effective_threshold": 0.4, "noise_level": 0.4,
              "stages": [{"stage": 0, "rank": 0, "num_nodes": 2, "profiled_ms": 30.6, "measured_ms": 740.8,
                          "speed": 1.0}],
              "workers": [], "history": []}
    text = format_status(status)
    table_at = text.index("time per minibatch")
    assert text.index("plan table times are the PROFILE's ms") < table_at  # the plan's times are labelled as profile ms
    assert "profile ms" in text and "measured compute ms (this run" in text
    assert "30.60" in text and "740.80" in text
    assert "a switch now needs a predicted gain above 40% (noise level 40%)" in text
    # A plan the policy solved carries this machine's ms: the label says so, with the factor.
    solved = {**status, "plan": {"extra": {"time_scale": "measured", "calibration": 24.2}}}
    assert "plan table times are THIS MACHINE's ms (the profile's ms x 24.2" in format_status(solved)


def test_the_plan_table_itself_states_its_scale():
    # The table is also logged alone (each worker's "plan vN", the coordinator's membership lines): it says its scale.
    assert plan_scale(two_stage(0)) == "times in the profile's ms"
    from dataclasses import replace

    solved = replace(two_stage(1), extra={"time_scale": "measured", "calibration": 24.2})
    assert plan_scale(solved) == "times in this machine's ms (the profile's x 24.2)"


def plan_scale(plan):
    line = next(row for row in plan.table().splitlines() if row.startswith("time per minibatch"))
    return line.rsplit("; ", 1)[1]


def test_ctl_status_marks_a_loop_ranks_measured_ms_as_its_total():
    plan = two_stage(1)
    rows = [{"stage": k, "rank": k % 2, "num_nodes": 1, "profiled_ms": 1.0, "measured_ms": 8.0 + k % 2,
             "speed": 1.0, "measured_is_rank_total": True} for k in range(4)]
    status = {"plan_version": 1, "pending_version": None, "policy": "auto", "last_decision": "-",
              "table": plan.table(), "stages": rows, "workers": [], "history": []}
    text = format_status(status)
    assert text.count("8.00*") == 2 and text.count("9.00*") == 2
    assert "* the rank's stages together" in text
    one_each = {**status, "stages": [{**r, "measured_is_rank_total": False} for r in rows[:2]]}
    assert "*" not in format_status(one_each)


def test_report_final_plan_comes_from_the_status_file(tmp_path):
    initial = two_stage(0)
    assert final_plan(tmp_path, initial) == (initial, [])  # no coordinator status: the initial plan
    live = two_stage(2)
    history = [{"version": 1, "requested_at_step": 5, "reason": "auto: x"},  # refused/never applied: not listed
               {"version": 2, "requested_at_step": 9, "applied_at_step": 10, "reason": "auto: y"}]
    (tmp_path / "coordinator_status.json").write_text(json.dumps({"plan": live.to_dict(), "history": history}))
    plan, switches = final_plan(tmp_path, initial)
    assert plan.version == 2 and [s["version"] for s in switches] == [2]
    (tmp_path / "coordinator_status.json").write_text("[1, 2]")
    with pytest.raises(PlanError, match="coordinator_status.json: not a coordinator status file"):
        final_plan(tmp_path, initial)


def test_a_rank_that_has_not_reported_is_not_shown_as_a_spare():
    # QA: right after a recovery (generation 1 registered, no step reported yet) `ctl status` showed every rank of the
    # new world as `spare`, though each held a stage of plan v1.
    row = {"rank": 0, "status": "running", "step": 0, "stage": None, "plan_version": 0, "slowdown": 1.0,
           "samples_per_s": None, "host": "h", "pid": 1}
    plan = Plan((StagePlan(0, ("a", "b"), ranks=(0,)), StagePlan(1, ("c",), ranks=(2,))), version=1)  # rank 1: a spare
    status = {"plan_version": 1, "pending_version": None, "policy": "manual", "last_decision": "-",
              "table": plan.table(), "plan": plan.to_dict(), "stages": [], "history": [],
              "workers": [row, {**row, "rank": 1}, {**row, "rank": 2, "stage": 1, "samples_per_s": 25.0}]}
    lines = [line.split() for line in format_status(status).splitlines() if line.split()[:2] in (["0", "running"],
                                                                                                 ["1", "running"],
                                                                                                 ["2", "running"])]
    assert [line[3] for line in lines] == ["-", "spare", "1"], lines
