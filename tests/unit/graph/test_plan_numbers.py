"""A plan file's number fields are JSON numbers: strings ("nan", "inf", "3"), bools and fractions where a count
is meant are refused with the field named (issue 33: plan fields accepted "nan"/"inf" strings)."""
from __future__ import annotations

import pytest

from model_parallel.errors import PlanError
from model_parallel.graph.plan import PLAN_SCHEMA, PLAN_VERSION, Plan


def _plan(stage: dict, **top: object) -> dict:
    base = {"stage_id": 0, "node_ids": ["x"], "num_replicas": 1, "ranks": [0], "compute_s": 0.5}
    return {"schema": PLAN_SCHEMA, "schema_version": PLAN_VERSION, "stages": [{**base, **stage}], **top}


def test_a_well_formed_plan_reads() -> None:
    plan = Plan.from_dict(_plan({}), "plan.json")
    assert plan.stages[0].compute_s == 0.5 and plan.stages[0].ranks == (0,)


@pytest.mark.parametrize(("stage", "top", "field"), [
    ({"compute_s": "nan"}, {}, "compute_s"),
    ({"compute_s": "inf"}, {}, "compute_s"),
    ({"memory_bytes": "1e3"}, {}, "memory_bytes"),
    ({"num_replicas": 2.7}, {}, "num_replicas"),
    ({"num_replicas": True}, {}, "num_replicas"),
    ({"stage_id": "0"}, {}, "stage_id"),
    ({"ranks": ["0"]}, {}, "a rank"),
    ({}, {"time_per_minibatch_s": "nan"}, "time_per_minibatch_s"),
    ({}, {"version": 1.5}, "version"),
])
def test_non_numbers_are_refused_naming_the_field(stage: dict, top: dict, field: str) -> None:
    with pytest.raises(PlanError, match=rf"plan\.json: malformed plan \(ValueError: {field} must be"):
        Plan.from_dict(_plan(stage, **top), "plan.json")


@pytest.mark.parametrize(("stage", "top", "field", "kind"), [
    ({"node_ids": "abc"}, {}, "node_ids", "a JSON list"),  # was read letter by letter: nodes a, b, c
    ({"node_ids": [1]}, {}, "a node id", "a JSON string"),
    ({"ranks": "01"}, {}, "ranks", "a JSON list"),
    ({}, {"extra": [["schedule", "zbv"]]}, "extra", "a JSON object"),  # was read as its pairs: dict([...])
    ({}, {"num_machines": "4"}, "num_machines", "a JSON list"),
])
def test_containers_of_another_json_type_are_refused_not_coerced(stage: dict, top: dict, field: str, kind: str) -> None:
    with pytest.raises(PlanError, match=rf"plan\.json: malformed plan \(ValueError: {field} must be {kind}"):
        Plan.from_dict(_plan(stage, **top), "plan.json")
