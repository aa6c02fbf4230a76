"""`check_plan` refuses what a worker's stage build would refuse after a switch moved layers: a module with
parameters called from two stages (before, a plan splitting it passed here and failed in build_stage)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from model_parallel.codegen.build import build_stage
from model_parallel.errors import CodegenError, PlanError
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.plancheck import check_plan


class CalledTwice(nn.Module):
    """One Linear applied twice: `fc`, `relu`, `fc_1` (the second call of the same module)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


def test_a_plan_splitting_the_calls_of_a_module_with_parameters_is_refused_as_the_build_would() -> None:
    model = CalledTwice()
    graph, _ = trace_model(model, (torch.zeros(2, 4),))
    ids = list(graph.topological_order)
    assert ids == ["x", "fc", "relu", "fc_1"]
    split = Plan((StagePlan(0, tuple(ids[:3])), StagePlan(1, tuple(ids[3:]))))
    with pytest.raises(CodegenError, match=r"module 'fc' \(nodes fc, fc_1\) is used by stages \[0, 1\] and has parameters"):
        check_plan(graph, split, 2, "1f1b")
    whole = check_plan(graph, Plan((StagePlan(0, tuple(ids)),)), 2, "1f1b")
    with pytest.raises(CodegenError, match="module 'fc' is used by node fc_1 of this stage"):  # what a worker hit
        build_stage(graph, ("fc_1",), whole.boundaries[0], source_model=model)
    together = Plan((StagePlan(0, tuple(ids[:1])), StagePlan(1, tuple(ids[1:]))))
    assert check_plan(graph, together, 2, None).plan.stages[1].node_ids == ("fc", "relu", "fc_1")


@pytest.mark.parametrize("schedule", ["1f1b", None])  # None: the coordinator's check before it issues a plan
def test_a_stage_without_nodes_is_refused(schedule) -> None:
    # Accepted before: the stage's module took no input and the run died at its first forward ("forward() takes
    # 1 positional argument but 2 were given"), after the coordinator had issued the plan.
    graph, _ = trace_model(CalledTwice(), (torch.zeros(2, 4),))
    ids = tuple(graph.topological_order)
    with pytest.raises(PlanError, match=r"plan v3: stage\(s\) \[0\] hold no nodes; .* a plan with fewer stages"):
        check_plan(graph, Plan((StagePlan(0, ()), StagePlan(1, ids)), version=3), 2, schedule)
