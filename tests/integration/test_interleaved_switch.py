"""Live plan switches under interleaved 1F1B: from a loop plan to a loop plan at a step boundary, layers moving by
owner rank (wire/migration.py) with their optimizer state. On 2 processes the MLP's 4 stages get other cuts
(step 2), then become 6 stages, 3 per rank (step 4); training equals single-process training within 1e-5 and
each rank ends holding the new plan's stages. A switch to a plan that is not a loop is refused, training goes on.
On 4 processes a loop over ranks 0 and 1 (2 and 3 spare) becomes a loop over all four (p 2 -> 4)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from model_parallel.codegen.naming import state_key
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.messages import Command
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.trainer import single_process_reference
from support import assert_relatively_close

STEPS = 7


def _cut(order: list[str], starts: list[int], version: int, p: int = 2) -> Plan:
    bounds = [0, *starts, len(order)]
    return Plan(stages=tuple(StagePlan(k, tuple(order[a:b]), ranks=(k % p,)) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))),
                version=version)


@pytest.mark.slow
def test_interleaved_switches_between_loop_plans_stay_exact(tmp_path):
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    order = list(graph.topological_order)
    six = even_plan(graph, 6)
    plans = {2: _cut(order, [3, 5, 9], 1),  # other cuts: layers cross between the ranks
             4: replace(six, stages=tuple(replace(s, ranks=(s.stage_id % 2,)) for s in six.stages), version=2),  # v = 3
             5: replace(even_plan(graph, 2), version=3)}  # one stage per rank: not a loop, refused
    script = tmp_path / "switch.json"
    script.write_text(json.dumps({k: Command.switch(p, "test").to_dict() for k, p in plans.items()}))
    result = launch_workers(["--model", "mlp", "--schedule", "interleaved", "--steps", str(STEPS), "--timeout", "60",
                             "--optimizer", "adamw", "--lr", "0.003", "--checkpoint_dir", str(tmp_path / "ckpt"),
                             "--control_script", str(script)], 2, timeout=300)
    assert result.ok, result.summary()
    out = result.output(0)
    assert "switched to plan v1" in out and "switched to plan v2" in out and "[rank 0 stage 0,2,4]" in out
    assert "refusing the switch to plan v3" in out and "needs loop placement over p >= 2 ranks" in out
    checkpoint = load_checkpoint(tmp_path / "ckpt")
    assert checkpoint.extra["next_step"] == STEPS and checkpoint.world["plan"]["version"] == 2
    assert [s["ranks"] for s in checkpoint.world["plan"]["stages"]] == [[k % 2] for k in range(6)]
    model = r.model(0)
    single_process_reference(model, r.criterion, lambda ps: torch.optim.AdamW(ps, lr=0.003, weight_decay=0.0), r.data(8, 0),
                             TrainConfig(batch_size=8, num_microbatches=4), STEPS)
    got = checkpoint.params()
    for name, value in model.named_parameters():
        assert_relatively_close(got[state_key(name)], value.detach(), 1e-5, name)


@pytest.mark.slow
def test_an_interleaved_switch_onto_more_ranks_activates_the_spares(tmp_path):
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    four, eight = even_plan(graph, 4), even_plan(graph, 8)
    start = replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2,)) for s in four.stages))
    wide = replace(eight, stages=tuple(replace(s, ranks=(s.stage_id % 4,)) for s in eight.stages), version=1)
    (tmp_path / "plan.json").write_text(json.dumps(start.to_dict()))
    (tmp_path / "switch.json").write_text(json.dumps({2: Command.switch(wide, "test: onto the spares").to_dict()}))
    steps = 4
    result = launch_workers(["--model", "mlp", "--schedule", "interleaved", "--steps", str(steps), "--timeout", "60",
                             "--plan", str(tmp_path / "plan.json"), "--checkpoint_dir", str(tmp_path / "ckpt"),
                             "--control_script", str(tmp_path / "switch.json")], 4, timeout=300)
    assert result.ok, result.summary()
    assert "switched to plan v1" in result.output(0) and "[rank 3 stage 3,7]" in result.output(3)
    checkpoint = load_checkpoint(tmp_path / "ckpt")
    assert checkpoint.extra["next_step"] == steps and checkpoint.world["plan"]["version"] == 1
    model = r.model(0)
    single_process_reference(model, r.criterion, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), r.data(8, 0),
                             TrainConfig(batch_size=8, num_microbatches=4), steps)
    got = checkpoint.params()
    for name, value in model.named_parameters():
        assert_relatively_close(got[state_key(name)], value.detach(), 1e-5, name)
