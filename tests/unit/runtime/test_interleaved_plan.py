"""Plans with several stages per rank: loop placement only, only under the interleaved schedule; what is refused."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model_parallel.errors import ConfigError, PlanError
from model_parallel.graph.plan import Plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.plancheck import check_plan, check_switchable


def test_interleaved_refusals_name_the_fix():
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    four = even_plan(graph, 4)
    loop = replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2,)) for s in four.stages))
    assert loop.stages_of_rank(0) == (0, 2) and loop.num_ranks == 2
    with pytest.raises(PlanError, match="use Plan.stages_of_rank"):
        loop.stage_of_rank(0)
    check_plan(graph, loop, 2, "interleaved")
    with pytest.raises(PlanError, match="only the interleaved schedules run that"):
        check_plan(graph, loop, 2, "1f1b")
    with pytest.raises(PlanError, match="needs loop placement over p >= 2 ranks"):
        check_plan(graph, four, 4, "interleaved")  # one stage per rank
    one_rank = replace(four, stages=tuple(replace(s, ranks=(0,)) for s in four.stages))
    with pytest.raises(PlanError, match="needs loop placement over p >= 2 ranks"):
        check_plan(graph, one_rank, 1, "interleaved")  # p = 1: consecutive stages on one rank
    with pytest.raises(PlanError, match="needs loop placement over p >= 2 ranks"):
        check_plan(graph, even_plan(graph, 2, {0: 2}), 3, "interleaved")  # a replica, but not a loop
    replicated = replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2, s.stage_id % 2 + 2), num_replicas=2)
                                            for s in four.stages))  # replica i of the pipeline on ranks 2i, 2i + 1
    assert replicated.loop_width == 2 and replicated.stages_of_rank(3) == (1, 3) and loop.loop_width == 2
    assert check_plan(graph, replicated, 4, "interleaved").plan.num_ranks == 4
    assert check_plan(graph, replicated, 4, "zbinterleaved").plan.num_ranks == 4  # zero bubble places replicas alike
    with pytest.raises(PlanError, match="a rank runs two stages"):  # replica 1 not on ranks k % p + p
        Plan(stages=tuple(replace(s, ranks=(s.stage_id % 2, 3 - s.stage_id % 2), num_replicas=2) for s in four.stages))
    with pytest.raises(PlanError, match="a rank runs two stages"):  # not a loop: stage 1 beside stage 0
        Plan(stages=tuple(replace(s, ranks=((0, 0, 1, 1)[s.stage_id],)) for s in four.stages))
    check_switchable("interleaved")  # loop plan to loop plan (test_interleaved_switch); check_plan refuses the rest
    check_switchable("1f1b")
    TrainConfig(schedule="interleaved", bf16=True, recompute=True)  # per-stage features: run (integration tests)


def test_a_tie_split_across_stages_is_planned_under_interleaved():
    import torch

    from model_parallel.errors import TiedParameterError
    from model_parallel.graph.plan import StagePlan
    from support.tied_lm import SEQ, VOCAB, TiedLM

    graph, _ = trace_model(TiedLM(), (torch.randint(0, VOCAB, (2, SEQ)),))
    ids = list(graph.topological_order)  # tokens, wte, ..., lm_head, ...: wte on stage 0, lm_head on the last
    cuts = [ids[:2], ids[2:3], ids[3:4], ids[4:]]
    plan = Plan(stages=tuple(StagePlan(k, tuple(nodes), ranks=(k % 2,)) for k, nodes in enumerate(cuts)))
    (tie,) = check_plan(graph, plan, 2, "interleaved").ties  # summed per step as under 1f1b (test_interleaved_ties)
    assert tie.ranks == (0, 1) and [k for k, _ in tie.paths] == [0, 3]
    with pytest.raises(TiedParameterError, match="pipedream schedule updates each stage"):
        check_plan(graph, replace(plan, stages=tuple(replace(s, ranks=(k,)) for k, s in enumerate(plan.stages))), 4,
                   "pipedream")


def test_stage_group_is_keyed_by_layer_and_backend_limits_are_refused():
    from torch import nn

    from model_parallel.errors import ModelParallelError
    from model_parallel.runtime.step.multi_stage import StageGroup, check_supported

    shared = nn.Linear(2, 2)
    first, second = nn.Module(), nn.Module()
    first.fc1, first.act = nn.Linear(2, 2), shared
    second.fc3, second.act = nn.Linear(2, 2), shared  # the same object under one name: held once
    group = StageGroup([first, second])
    assert sorted(group.state_dict()) == ["act.bias", "act.weight", "fc1.bias", "fc1.weight", "fc3.bias", "fc3.weight"]
    assert len(list(group.parameters())) == 6
    other = nn.Module()
    other.fc1 = nn.Linear(2, 2)  # another object under a name already held
    with pytest.raises(ModelParallelError, match="different members named 'fc1'"):
        StageGroup([first, other])
    with pytest.raises(ModelParallelError, match="not one computation"):
        group()
    check_supported(backend="gloo")
    with pytest.raises(ConfigError, match="NCCL ignores.*--backend gloo"):
        check_supported(backend="nccl")


def test_v_placement_only_under_zbv():
    from model_parallel.graph.in_flight import MULTI_STAGE_SCHEDULES

    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    four = even_plan(graph, 4)
    v = replace(four, stages=tuple(replace(s, ranks=((0, 1, 1, 0)[s.stage_id],)) for s in four.stages))
    assert v.is_v_placement and v.several_stages_per_rank and not v.is_loop_placement
    check_plan(graph, v, 2, "zbv")
    loop = replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2,)) for s in four.stages))
    with pytest.raises(PlanError, match=r"the zbv schedule needs 2p stages on p >= 2 ranks in a V"):
        check_plan(graph, loop, 2, "zbv")
    replicated = replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2, s.stage_id % 2 + 2), num_replicas=2)
                                            for s in four.stages))
    with pytest.raises(PlanError, match=r"the zbv schedule needs 2p stages on p >= 2 ranks in a V"):
        check_plan(graph, replicated, 4, "zbv")  # a loop of replicas, not a V
    v2 = replace(four, stages=tuple(replace(s, ranks=((0, 1, 1, 0)[s.stage_id], (2, 3, 3, 2)[s.stage_id]),
                                            num_replicas=2) for s in four.stages))  # replica i of the V on ranks 2i, 2i+1
    assert v2.is_v_placement and v2.v_width == 2 and v2.stages_of_rank(3) == (1, 2) and replicated.v_width == 0
    assert check_plan(graph, v2, 4, "zbv").plan.num_ranks == 4
    with pytest.raises(PlanError, match="only the interleaved schedules run that"):
        check_plan(graph, v, 2, "1f1b")
    with pytest.raises(PlanError, match="needs loop placement"):
        check_plan(graph, v, 2, "zbinterleaved")
    for name in MULTI_STAGE_SCHEDULES:
        check_switchable(name)  # loop plan to loop plan, V to V (check_plan refuses any other new plan)
    assert TrainConfig(schedule="zbv", bf16=True).wire_dtype == torch.bfloat16  # runs bf16 (the mailbox rounds)
