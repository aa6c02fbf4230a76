"""Interleaved 1F1B run by the runtime: the zoo MLP on 2 and 4 processes (2 stages per rank, loop placement)
against single-process training with the same data, microbatching and optimizer, within 1e-5; refusals."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model_parallel.codegen.naming import state_key
from model_parallel.errors import ConfigError, PlanError
from model_parallel.graph.plan import Plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.plancheck import check_plan, check_switchable
from model_parallel.runtime.trainer import single_process_reference

TOL = 1e-5


def _oracle(steps: int, batch: int, microbatches: int, lr: float, adamw: bool) -> dict[str, torch.Tensor]:
    r = recipe("mlp")
    model = r.model(0)
    if adamw:
        factory = lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0)  # noqa: E731  (the worker's default)
    else:
        factory = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    config = TrainConfig(batch_size=batch, num_microbatches=microbatches)
    single_process_reference(model, r.criterion, factory, r.data(batch, 0), config, steps)
    return {state_key(k): v.detach() for k, v in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("world, extra", [
    (2, ["--num_microbatches", "4"]),
    (4, ["--num_microbatches", "8", "--batch_size", "16", "--optimizer", "adamw", "--lr", "0.003",
         "--eval_every", "2", "--eval_data", "synthetic"]),
], ids=["p2_v2_m4", "p4_v2_m8_adamw_eval"])
def test_interleaved_matches_single_process(tmp_path, world, extra):
    steps = 4
    result = launch_workers(["--model", "mlp", "--schedule", "interleaved", "--steps", str(steps), "--timeout", "60",
                             "--checkpoint_dir", str(tmp_path / "ckpt"), *extra], world, timeout=300)
    assert result.ok, result.summary()
    assert f"[rank 0 stage 0,{world}]" in result.output(0)  # two stages on one rank, loop placement
    checkpoint = load_checkpoint(tmp_path / "ckpt")
    assert checkpoint.extra["next_step"] == steps
    assert [s["ranks"] for s in checkpoint.world["plan"]["stages"]] == [[k % world] for k in range(2 * world)]
    flags = dict(zip(extra[::2], extra[1::2]))
    want = _oracle(steps, int(flags.get("--batch_size", 8)), int(flags["--num_microbatches"]),
                   float(flags.get("--lr", 0.01)), flags.get("--optimizer") == "adamw")
    got = checkpoint.params()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        diff = torch.linalg.vector_norm(got[key].double() - value.double()).item()
        scale = max(torch.linalg.vector_norm(value.double()).item(), 1e-12)
        assert diff <= TOL * scale, f"{key} differs by {diff:.3g} (relative {diff / scale:.3g})"


@pytest.mark.slow
def test_interleaved_refusals_name_the_fix(tmp_path):
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    four = even_plan(graph, 4)
    loop = replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2,)) for s in four.stages))
    assert loop.stages_of_rank(0) == (0, 2) and loop.num_ranks == 2
    with pytest.raises(PlanError, match="use Plan.stages_of_rank"):
        loop.stage_of_rank(0)
    check_plan(graph, loop, 2, "interleaved")
    with pytest.raises(PlanError, match="only the interleaved schedule runs that"):
        check_plan(graph, loop, 2, "1f1b")
    with pytest.raises(PlanError, match="needs loop placement over p >= 2 ranks"):
        check_plan(graph, four, 4, "interleaved")  # one stage per rank
    one_rank = replace(four, stages=tuple(replace(s, ranks=(0,)) for s in four.stages))
    with pytest.raises(PlanError, match="needs loop placement over p >= 2 ranks"):
        check_plan(graph, one_rank, 1, "interleaved")  # p = 1: consecutive stages on one rank
    with pytest.raises(PlanError, match="does not support replicated stages"):
        check_plan(graph, even_plan(graph, 2, {0: 2}), 3, "interleaved")
    with pytest.raises(PlanError, match="a rank runs two stages"):  # not a loop: stage 1 beside stage 0
        Plan(stages=tuple(replace(s, ranks=((0, 0, 1, 1)[s.stage_id],)) for s in four.stages))
    with pytest.raises(PlanError, match="live plan switches are not supported under the interleaved schedule"):
        check_switchable("interleaved")
    check_switchable("1f1b")
    with pytest.raises(ConfigError, match="interleaved schedule does not run --bf16 or --recompute"):
        TrainConfig(schedule="interleaved", bf16=True)
    # m not a multiple of p, on the command line: exit 2 naming the fix, no hang.
    result = launch_workers(["--model", "mlp", "--schedule", "interleaved", "--steps", "1", "--timeout", "30",
                             "--num_microbatches", "3", "--batch_size", "6"], 2, timeout=120)
    assert not result.ok and "m=3 is not a multiple of p" in result.output(0), result.summary()
