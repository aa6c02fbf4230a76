"""The stage-time model of issue 26 (optimizer/fidelity.py): every term against literal values."""
from __future__ import annotations

import json
import math
import time

import pytest

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.optimizer.fidelity import Calibration, format_fidelity, predict_stage_ms, share_errors
from model_parallel.runtime.observe.metrics import measured_ms
from model_parallel.runtime.observe.metrics import MetricsRecorder, busy_ms


def _chain() -> Graph:
    # input -> a (1 ms fwd, 2 ms bwd, 4 MB weights, 1 MB out) -> b (3 + 3 ms, 2 MB weights)
    nodes = (Node("input", "Input0", activation_size=1e5), Node("a", "Linear", 1.0, 2.0, 1e6, 4e6),
             Node("b", "Linear", 3.0, 3.0, 1e3, 2e6))
    return Graph(nodes=nodes, edges=(("input", "a"), ("a", "b")),
                 metadata={"profile": {"loss_forward_ms": 0.25, "loss_backward_ms": 0.25}})


CAL = Calibration(microbatch_overhead_ms=0.5, link_latency_ms=0.1, link_bandwidth=1e9, optimizer_ms_per_mb={"sgd": 0.2})


def test_every_term_of_a_two_stage_plan():
    plan = Plan(stages=(StagePlan(0, ("input", "a")), StagePlan(1, ("b",))))
    first, last = predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=CAL)
    # stage 0: 4 x 3 ms compute, 4 MB x 0.2 ms/MB, 4 x (0.1 ms + 1 MB / 1 GB/s) sends, 4 x 0.5 overhead
    assert (first.compute_ms, first.loss_ms, first.allreduce_ms) == (12.0, 0.0, 0.0)
    assert first.optimizer_ms == pytest.approx(0.8) and first.send_ms == pytest.approx(4 * 1.1)
    assert first.total_ms == pytest.approx(12 + 0.8 + 4.4 + 2.0)
    # stage 1: 4 x 6 ms, the loss 4 x 0.5 ms, gradients up 4 x (0.1 + 1 ms), 2 MB of weights
    assert (last.compute_ms, last.loss_ms) == (24.0, 2.0)
    assert last.optimizer_ms == pytest.approx(0.4) and last.send_ms == pytest.approx(4.4)


def test_microbatch_scale_and_replicas():
    plan = Plan(stages=(StagePlan(0, ("input", "a"), num_replicas=2, ranks=(0, 1)), StagePlan(1, ("b",), ranks=(2,))))
    first, _ = predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=CAL, scale=0.5)
    assert first.compute_ms == pytest.approx(2 * 3.0 * 0.5)  # each replica runs 2 of the 4 microbatches
    assert first.allreduce_ms == pytest.approx(4 * 1 * 4e6 / (1e9 * 2) * 1e3)  # 4 (r-1) W / (B r)
    assert first.overhead_ms == pytest.approx(1.0)


def test_calibration_round_trips_and_refuses_bad_values():
    assert Calibration.from_json(CAL.to_json()) == CAL
    with pytest.raises(PlanError, match=r"calibration link_latency_ms must be a finite number >= 0, got -1"):
        Calibration(link_latency_ms=-1)
    with pytest.raises(PlanError, match=r"cal.json: unknown key\(s\) \['speed'\]"):
        Calibration.from_json({"speed": 1}, "cal.json")
    with pytest.raises(PlanError, match="no optimizer coefficient for 'adamw'"):
        predict_stage_ms(_chain(), Plan(stages=(StagePlan(0, ("input", "a", "b")),)), num_microbatches=1,
                         calibration=CAL, optimizer="adamw")


def test_busy_excludes_waiting_on_peers_and_the_table_shows_the_error():
    record = {"compute_ms": 10.0, "send_ms": 1.0, "idle_ms": 0.5, "recv_ms": 30.0, "allreduce_ms": 4.0}
    assert busy_ms(record) == 11.5
    table = format_fidelity([11.0, 20.0], [10.0, None])
    assert table.splitlines()[1].split() == ["0", "11.00", "10.00", "+10%", "n/a"] and "n/a" in table.splitlines()[2]


def test_share_errors_ignore_a_machine_that_is_uniformly_slower_than_at_the_profile():
    # Every stage measured 1.3x its prediction: -23 % each, but the shares of the step are exact.
    assert share_errors([10.0, 20.0, 30.0], [13.0, 26.0, 39.0]) == pytest.approx([0.0, 0.0, 0.0])
    # Stage 0 predicted 1/4 of the work and measured 1/5: its share is 25 % high, the other's 6.25 % low.
    assert share_errors([10.0, 30.0], [10.0, 40.0]) == pytest.approx([25.0, -6.25])
    assert share_errors([10.0, 30.0], [10.0, None]) == [None, None]  # no share without every stage
    table = format_fidelity([10.0, 30.0], [10.0, 40.0]).splitlines()
    assert table[1].split()[-2:] == ["+0%", "+25%"] and table[2].split()[-2:] == ["-25%", "-6%"]


def _three_stages() -> tuple[Graph, Plan]:
    graph = Graph(nodes=(*_chain().nodes, Node("c", "Linear", 1.0, 1.0, 1e3, 0.0)),
                  edges=(("input", "a"), ("a", "b"), ("b", "c")), metadata=_chain().metadata)
    return graph, Plan(stages=(StagePlan(0, ("input", "a")), StagePlan(1, ("b",)), StagePlan(2, ("c",))))


def test_loss_only_on_the_last_stage_and_gradient_accumulation_after_the_first_microbatch():
    graph, plan = _three_stages()
    cal = Calibration(optimizer_ms_per_mb={"sgd": 0.0}, accumulate_ms_per_mb=0.25)
    stages = predict_stage_ms(graph, plan, num_microbatches=4, calibration=cal)
    assert [s.loss_ms for s in stages] == [0.0, 0.0, 4 * 0.5]
    # 3 of the 4 microbatches add into .grad: 4 MB and 2 MB of weights, none on the last stage.
    assert [s.accumulate_ms for s in stages] == pytest.approx([3 * 4 * 0.25, 3 * 2 * 0.25, 0.0])
    assert predict_stage_ms(graph, plan, num_microbatches=1, calibration=cal)[0].accumulate_ms == 0.0
    replicated = Plan(stages=(StagePlan(0, ("input", "a"), num_replicas=2, ranks=(0, 1)), StagePlan(1, ("b", "c"), ranks=(2,))))
    assert predict_stage_ms(graph, replicated, num_microbatches=4, calibration=cal)[0].accumulate_ms == pytest.approx(1 * 4 * 0.25)


def test_optimizer_term_is_parameter_bytes_times_the_kinds_coefficient():
    cal = Calibration(optimizer_ms_per_mb={"sgd": 0.2, "adamw": 1.0})
    plan = Plan(stages=(StagePlan(0, ("input", "a")), StagePlan(1, ("b",))))
    sgd = [s.optimizer_ms for s in predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=cal)]
    adamw = [s.optimizer_ms for s in predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=cal, optimizer="adamw")]
    assert sgd == pytest.approx([4 * 0.2, 2 * 0.2]) and adamw == pytest.approx([4.0, 2.0])
    # The optimizer steps once per flush: more microbatches do not change it.
    assert [s.optimizer_ms for s in predict_stage_ms(_chain(), plan, num_microbatches=8, calibration=cal)] == pytest.approx(sgd)


def test_cpu_clock_prices_receives_and_a_mismatched_profile_clock_is_refused():
    graph, plan = _three_stages()
    wall = Calibration(link_latency_ms=0.1, link_bandwidth=1e9, optimizer_ms_per_mb={"sgd": 0.0})
    cpu = Calibration(**{**wall.to_json(), "clock": "cpu"})
    assert all(s.recv_ms == 0.0 for s in predict_stage_ms(graph, plan, num_microbatches=2, calibration=wall))
    first, middle, last = predict_stage_ms(graph, plan, num_microbatches=2, calibration=cpu)
    # Stage 0 receives the gradient of its 1 MB output, stage 2 the 1 kB activation it computes on; the
    # middle stage both: per microbatch latency + bytes / bandwidth each.
    assert first.recv_ms == pytest.approx(2 * (0.1 + 1.0)) and last.recv_ms == pytest.approx(2 * (0.1 + 0.001))
    assert middle.recv_ms == pytest.approx(first.recv_ms + last.recv_ms) and middle.recv_ms == pytest.approx(middle.send_ms)
    profiled = Graph(nodes=graph.nodes, edges=graph.edges, metadata={"profile": {"clock": "wall"}})
    with pytest.raises(PlanError, match="profile was timed on the 'wall' clock and the calibration on 'cpu'"):
        predict_stage_ms(profiled, plan, num_microbatches=2, calibration=cpu)
    with pytest.raises(PlanError, match="calibration clock must be one of"):
        Calibration(clock="gpu")


def test_measured_is_cpu_ms_on_the_cpu_clock_and_busy_ms_on_the_wall_clock():
    record = {"compute_ms": 10.0, "send_ms": 1.0, "idle_ms": 0.5, "recv_ms": 30.0, "cpu_ms": 9.0}
    assert measured_ms(record, "cpu") == 9.0 and measured_ms(record, "wall") == 11.5
    assert math.isnan(measured_ms({k: v for k, v in record.items() if k != "cpu_ms"}, "cpu"))  # an old metrics file


def test_step_records_carry_the_process_cpu_time_not_the_wall_time():
    recorder = MetricsRecorder(rank=0)
    recorder.begin_step(0)
    time.sleep(0.3)  # waiting (on a peer, or descheduled) costs no CPU
    waited = recorder.end_step(samples=1)
    recorder.begin_step(1)
    start = time.process_time()
    while time.process_time() - start < 0.1:
        pass
    worked = recorder.end_step(samples=1)
    assert waited.step_ms >= 300.0 and waited.cpu_ms < 100.0
    assert worked.cpu_ms >= 100.0 and worked.to_dict()["cpu_ms"] == worked.cpu_ms


def test_accumulation_is_priced_per_node_at_the_price_per_mb_of_its_size():
    # a: 4 MB of weights, b: 2 MB. The curve: 0.1 ms/MB at 1 MB, 0.3 at 4 MB (log-interpolated between).
    cal = Calibration(optimizer_ms_per_mb={"sgd": 0.0}, accumulate_ms_per_mb=9.0,
                      accumulate_curve=((1e6, 0.1), (4e6, 0.3)))
    assert cal.accumulate_ms_per_mb_at(2e6) == pytest.approx(0.2)  # halfway on log(size)
    assert (cal.accumulate_ms_per_mb_at(1e3), cal.accumulate_ms_per_mb_at(1e9)) == (0.1, 0.3)  # ends held
    plan = Plan(stages=(StagePlan(0, ("input", "a")), StagePlan(1, ("b",))))
    first, last = predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=cal)
    assert first.accumulate_ms == pytest.approx(3 * 4 * 0.3) and last.accumulate_ms == pytest.approx(3 * 2 * 0.2)
    # Without a curve (an older calibration) the flat coefficient prices every size.
    flat = Calibration(optimizer_ms_per_mb={"sgd": 0.0}, accumulate_ms_per_mb=0.25)
    assert predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=flat)[0].accumulate_ms == pytest.approx(3 * 4 * 0.25)


def test_timeshare_term_only_when_the_host_runs_more_ranks_than_cores():
    cal = Calibration(optimizer_ms_per_mb={"sgd": 0.0}, accumulate_ms_per_mb=0.25, timeshare_factor=1.2,
                      machine={"cpus": 2})
    plan = Plan(stages=(StagePlan(0, ("input", "a")), StagePlan(1, ("b",))))
    for ranks in (None, 1, 2):  # a core per rank (or unknown): warm caches, as profiled
        assert all(s.timeshare_ms == 0.0 for s in predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=cal,
                                                                   ranks_per_host=ranks))
    first, last = predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=cal, ranks_per_host=4)
    # 0.2 x the compute of the actions that start after a receive: the first stage's backwards and their
    # accumulation (4 x 2 ms + 3 x 4 MB x 0.25), the last stage's forwards (4 x 3 ms; loss and backward follow)
    assert first.timeshare_ms == pytest.approx(0.2 * (8 + 3.0)) and last.timeshare_ms == pytest.approx(0.2 * 12)
    # A middle stage waits before both: 4 x (1 + 2) ms + 3 x 4 MB x 0.25; a stage of inputs only computes nothing.
    three = Plan(stages=(StagePlan(0, ("input",)), StagePlan(1, ("a",)), StagePlan(2, ("b",))))
    inputs, middle, end = predict_stage_ms(_chain(), three, num_microbatches=4, calibration=cal, ranks_per_host=4)
    assert (inputs.timeshare_ms, middle.timeshare_ms, end.timeshare_ms) == pytest.approx((0.0, 0.2 * 15, 0.2 * 12))
    alone = Plan(stages=(StagePlan(0, ("input", "a", "b")),))
    assert predict_stage_ms(_chain(), alone, num_microbatches=4, calibration=cal, ranks_per_host=4)[0].timeshare_ms == 0.0
    assert first.total_ms == pytest.approx(sum(first.terms().values())) and "timeshare_ms" in first.terms()
    # A calibration that does not know its cores never applies it.
    unknown = Calibration(optimizer_ms_per_mb={"sgd": 0.0}, timeshare_factor=1.2)
    assert predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=unknown, ranks_per_host=4)[0].timeshare_ms == 0.0


def test_corun_term_when_other_ranks_share_the_host_and_timeshare_counts_only_what_it_adds():
    cal = Calibration(optimizer_ms_per_mb={"sgd": 0.0}, timeshare_factor=1.3, corun_factor=1.2, machine={"cpus": 2})
    plan = Plan(stages=(StagePlan(0, ("input", "a")), StagePlan(1, ("b",))))
    for ranks in (None, 1):  # unknown, or alone on its host: as profiled
        assert all(s.corun_ms == 0.0 for s in predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=cal,
                                                               ranks_per_host=ranks))
    # Two ranks on two cores: both compute at once, every action 1.2x its profile; no time-sharing.
    first, last = predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=cal, ranks_per_host=2)
    assert first.corun_ms == pytest.approx(0.2 * first.compute_ms) and first.timeshare_ms == 0.0
    assert last.corun_ms == pytest.approx(0.2 * (last.compute_ms + last.loss_ms))
    # Four ranks on two cores: the cold actions cost 1.3x in all, of which 1.2x is the co-running.
    first, last = predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=cal, ranks_per_host=4)
    assert first.corun_ms == pytest.approx(0.2 * first.compute_ms)
    assert first.timeshare_ms == pytest.approx(0.1 * 8) and last.timeshare_ms == pytest.approx(0.1 * 12)
    # A co-running factor above the timeshare factor leaves nothing for time-sharing to add.
    both = Calibration(optimizer_ms_per_mb={"sgd": 0.0}, timeshare_factor=1.1, corun_factor=1.2, machine={"cpus": 2})
    assert all(s.timeshare_ms == 0.0 for s in predict_stage_ms(_chain(), plan, num_microbatches=4, calibration=both,
                                                               ranks_per_host=4))


def test_an_older_calibration_loads_with_the_new_terms_off_and_bad_new_values_are_refused():
    old = {"microbatch_overhead_ms": 0.5, "link_latency_ms": 0.1, "link_bandwidth": 1e9, "optimizer_ms_per_mb": {"sgd": 0.2},
           "machine": {"cpus": 2}, "accumulate_ms_per_mb": 0.1, "clock": "cpu"}
    loaded = Calibration.from_json(old, "old.json")
    assert (loaded.accumulate_curve, loaded.timeshare_factor, loaded.corun_factor) == ((), 1.0, 1.0)
    new = Calibration(accumulate_curve=((1e6, 0.1), (4e6, 0.3)), timeshare_factor=1.1, corun_factor=1.05)
    assert Calibration.from_json(json.loads(json.dumps(new.to_json()))) == new  # through JSON (lists)
    with pytest.raises(PlanError, match=r"timeshare_factor must be a finite number >= 1, got 0.9"):
        Calibration(timeshare_factor=0.9)
    with pytest.raises(PlanError, match=r"corun_factor must be a finite number >= 1, got nan"):
        Calibration(corun_factor=float("nan"))
    with pytest.raises(PlanError, match=r"accumulate_curve must be .* by increasing size"):
        Calibration(accumulate_curve=((4e6, 0.3), (1e6, 0.1)))
