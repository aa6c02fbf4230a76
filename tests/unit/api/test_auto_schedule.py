"""`schedule="auto"` in the job builder (api/auto_schedule.py): candidate plans from a timed profile, the memory
limit per schedule, the refusals, and the choice carried on the plan."""
from __future__ import annotations

import logging
from typing import Optional

import pytest

from model_parallel.api import auto_schedule
from model_parallel.api.auto_schedule import edge_transfers, stage_times
from model_parallel.api.job import JobSpec, _schedule_plan
from model_parallel.errors import ScheduleError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan
from model_parallel.runtime.step.auto import chosen_schedule

MB = 1e6
# The zero-bubble schedules' I/W split is estimated (half of a weighted node's backward each), so they win most
# simulated races: tests about 1f1b, gpipe and interleaved rule them out (test_zero_bubble_... picks them).
NO_ZB = {name: "ruled out by the test" for name in ("zbh1", "zbinterleaved", "zbv")}


def chain(activation_mb: float, layers: int = 4) -> Graph:
    """Input -> n0 -> ... : each layer 1 ms forward, 2 ms backward, 1 MB of weights, `activation_mb` out."""
    nodes = [Node("x", "Input0", activation_size=activation_mb * MB)]
    nodes += [Node(f"n{i}", f"Linear({i})", forward_ms=1.0, backward_ms=2.0, parameter_size=1 * MB,
                   activation_size=activation_mb * MB) for i in range(layers)]
    return Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))


def spec(graph: Graph, **fields: object) -> JobSpec:
    return JobSpec(graph=graph, batch_size=8, num_microbatches=8, schedule="auto", **fields)  # type: ignore[arg-type]


def resolve_auto(job: JobSpec, graph: Graph, given: Optional[Plan], world_size: int) -> Plan:
    """What build_job does with schedule="auto" (without building a model from the graph's missing layers)."""
    return auto_schedule.resolve_auto(graph, world_size, job.num_microbatches, job.micro_batch,
                                      job.schedule_refusals or {},
                                      lambda name: _schedule_plan(job, graph, name, given, world_size))


def test_gpipe_refused_by_memory_runs_1f1b(caplog: pytest.LogCaptureFixture) -> None:
    # m = 8: GPipe holds 8 microbatches' 20 MB activations on a stage (160 MB > 100 MB), 1F1B at most 2.
    graph = chain(20)
    with caplog.at_level(logging.INFO, logger="model_parallel.api.auto_schedule"):
        plan = resolve_auto(spec(graph, memory_per_worker=100 * MB, schedule_refusals=NO_ZB), graph, None, 2)
    assert chosen_schedule(plan) == "1f1b"
    line = next(r.getMessage() for r in caplog.records if "schedule auto" in r.getMessage())
    assert line.startswith("schedule auto: chose 1f1b (predicted ")
    assert "gpipe refused: no split of the model into 2 stages fits 0.1 GB per worker" in line
    assert "interleaved " in line  # priced under the limit too: a rank's stages together (optimizer.contiguous)
    assert plan.extra["schedule"]["line"] == line
    assert "bubble" in plan.table().splitlines()[-1]


def test_interleaved_wins_on_a_fast_link_and_1f1b_on_heavy_crossings() -> None:
    light = chain(0.001)
    plan = resolve_auto(spec(light, schedule_refusals=NO_ZB), light, None, 2)
    assert chosen_schedule(plan) == "interleaved"
    assert plan.is_loop_placement and plan.num_stages == 4
    # 20 MB per crossing at 1 GB/s: 20 ms a message against 1-2 ms of compute, one message at a time per edge
    # and direction. Interleaved pays 3 crossings a microbatch; GPipe queues all 8 forwards, then all 8
    # backwards, on its one edge; 1F1B's messages alternate directions and overlap.
    heavy = chain(20)
    line = resolve_auto(spec(heavy, schedule_refusals=NO_ZB), heavy, None, 2).extra["schedule"]["line"]
    assert line.startswith("schedule auto: chose 1f1b (predicted 228.0 ms/step, bubble 79 %; gpipe 332.0 ms, "
                           "interleaved 374.0 ms, zbh1 refused: ruled out by the test")


def test_a_zero_bubble_schedule_wins_when_its_estimated_split_fills_the_bubble() -> None:
    light = chain(0.001)
    plan = resolve_auto(spec(light), light, None, 2)
    line = plan.extra["schedule"]["line"]
    assert chosen_schedule(plan) in ("zbh1", "zbinterleaved", "zbv"), line
    times = stage_times(light, plan, 1.0)
    assert all(t.input_ms == pytest.approx(t.weight_ms) and t.input_ms + t.weight_ms == pytest.approx(t.backward_ms)
               for t in times)  # every layer has weights: half of its backward is I, half W


def test_the_configs_refusal_and_a_given_plan_limit_the_candidates() -> None:
    light = chain(0)  # free crossings: 1f1b and gpipe tie, and the tie goes to 1f1b (less memory)
    refused = spec(light, schedule_refusals={"interleaved": "the interleaved schedule does not run --bf16", **NO_ZB})
    assert chosen_schedule(resolve_auto(refused, light, None, 2)) == "1f1b"
    straight = resolve_auto(refused, light, None, 2)
    given = resolve_auto(spec(light), light, straight, 2)  # one stage per rank given: interleaved cannot run it
    assert chosen_schedule(given) == "zbh1" and [s.node_ids for s in given.stages] == [s.node_ids for s in straight.stages]
    with pytest.raises(ScheduleError, match=r"no schedule can run this job \(1f1b: .*; gpipe: .*; interleaved: "):
        resolve_auto(spec(chain(20), memory_per_worker=1 * MB), chain(20), None, 2)


def test_stage_times_and_transfers_are_one_microbatchs() -> None:
    graph = chain(10)
    plan = resolve_auto(spec(graph, schedule_refusals={"interleaved": "no", **NO_ZB}), graph, None, 2)
    times = stage_times(graph, plan, 0.5)
    assert [(t.forward_ms, t.backward_ms) for t in times] == [(1.0, 2.0), (1.0, 2.0)]  # 2 layers each, half a batch
    assert edge_transfers(graph, plan, 0.5) == pytest.approx((5.0,))  # 5 MB at 1 GB/s


def test_the_pipeline_trainer_resolves_auto_before_it_builds_a_runner() -> None:
    import torch

    from model_parallel.api.trainer import PipelineTrainer
    from model_parallel.runtime.build.zoo import recipe
    from model_parallel.runtime.config import TrainConfig

    r = recipe("mlp")
    trainer = PipelineTrainer(r.model(0), lambda params: torch.optim.SGD(params, lr=0.1), r.data(8, 0),
                              TrainConfig(batch_size=8, num_microbatches=4, schedule="auto"), criterion=r.criterion,
                              num_stages=2, single_process=True)
    # One process: interleaved needs >= 2 ranks; of the one-stage-per-rank schedules zbh1's deferred W fill
    # 1F1B's drain (the single process then runs the stages in turn: the schedule does not change its math).
    assert trainer.config.schedule == "zbh1"
    assert trainer.plan.extra["schedule"]["line"].startswith("schedule auto: chose zbh1 (predicted ")
    assert "interleaved refused: the interleaved schedule places several stages on each of >= 2 ranks; this world " \
           "has 1" in trainer.plan.extra["schedule"]["line"]


def test_what_several_stages_per_rank_cannot_honour_rules_interleaved_out() -> None:
    from model_parallel.api.auto_schedule import schedule_refusals
    from model_parallel.runtime.config import TrainConfig

    assert schedule_refusals(TrainConfig(schedule="auto"), False, "gloo") == {}
    measured = schedule_refusals(TrainConfig(schedule="auto"), True, "gloo")
    assert measured == {}  # every schedule measures: a rank's stages share one meter
    assert "which NCCL ignores" in schedule_refusals(TrainConfig(schedule="auto"), False, "nccl")["interleaved"]


def test_zbv_s_default_v_split_is_checked_per_rank_under_a_memory_limit() -> None:
    from model_parallel.errors import InfeasibleError

    graph = chain(20)
    plan = _schedule_plan(spec(graph, memory_per_worker=1e12), graph, "zbv", None, 2)
    assert plan.is_v_placement and [s.ranks for s in plan.stages] == [(0,), (1,), (1,), (0,)]
    # The start is the V balanced by rank sums (contiguous.v_plan); under a cap nothing fits, the refusal names the
    # rank over and the least memory per worker that fits.
    with pytest.raises(InfeasibleError, match=r"the balanced zbv split puts a predicted .* GB on rank [01] \(stages "
                                              r"(\[0, 3\]|\[1, 2\]).* the least memory per worker that fits is"):
        _schedule_plan(spec(graph, memory_per_worker=1 * MB), graph, "zbv", None, 2)
