"""Interleaved 1F1B run by the runtime: the zoo MLP on 2 and 4 processes (2 stages per rank, loop placement)
against single-process training with the same data, microbatching and optimizer, within 1e-5 (the plan's rules:
tests/unit/runtime/test_interleaved_plan.py)."""
from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path


import pytest
import torch

from model_parallel.codegen.naming import state_key
from model_parallel.messages import Command
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import free_port, launch, launch_workers
from model_parallel.runtime.step.evaluate import single_process_evaluate
from model_parallel.runtime.trainer import single_process_reference
from support.eval_cases import EVAL_STEPS, STEPS, make_case

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


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        diff = torch.linalg.vector_norm(got[key].double() - value.double()).item()
        scale = max(torch.linalg.vector_norm(value.double()).item(), 1e-12)
        assert diff <= TOL * scale, f"{key} differs by {diff:.3g} (relative {diff / scale:.3g})"


@pytest.mark.slow
@pytest.mark.parametrize("world, extra", [
    (2, ["--num_microbatches", "4"]),
    (2, ["--num_microbatches", "2", "--num_stages", "6"]),  # v = 3
    (4, ["--num_microbatches", "8", "--batch_size", "16", "--optimizer", "adamw", "--lr", "0.003",
         "--eval_every", "2", "--eval_data", "synthetic"]),
], ids=["p2_v2_m4", "p2_v3_m2", "p4_v2_m8_adamw_eval"])
def test_interleaved_matches_single_process(tmp_path, world, extra):
    steps = 4
    result = launch_workers(["--model", "mlp", "--schedule", "interleaved", "--steps", str(steps), "--timeout", "60",
                             "--checkpoint_dir", str(tmp_path / "ckpt"), *extra], world, timeout=300)
    assert result.ok, result.summary()
    flags = dict(zip(extra[::2], extra[1::2]))
    stages = int(flags.get("--num_stages", 2 * world))
    held = ",".join(str(k) for k in range(0, stages, world))
    assert f"[rank 0 stage {held}]" in result.output(0)  # several stages on one rank, loop placement
    # The memory table: one row per rank, its stages' predictions summed (memory_table.rank_stages).
    assert re.search(rf"^\s+0\s+{held}\s+\d+\.\d+\s+n/a", result.output(0), re.MULTILINE), result.output(0)
    checkpoint = load_checkpoint(tmp_path / "ckpt")
    assert checkpoint.extra["next_step"] == steps
    assert [s["ranks"] for s in checkpoint.world["plan"]["stages"]] == [[k % world] for k in range(stages)]
    want = _oracle(steps, int(flags.get("--batch_size", 8)), int(flags["--num_microbatches"]),
                   float(flags.get("--lr", 0.01)), flags.get("--optimizer") == "adamw")
    _assert_close(checkpoint.params(), want)
    if "--eval_every" in flags:  # validation ran through the rank's stages in order (run_forward)
        assert "val_loss" in result.output(0)


@pytest.mark.slow
def test_command_line_refusals_end_the_world_naming_the_fix():
    # The command line: every rank exits naming the fix, no hang.
    result = launch_workers(["--model", "mlp", "--schedule", "interleaved", "--steps", "1", "--timeout", "30",
                             "--num_microbatches", "3", "--batch_size", "6"], 2, timeout=120)
    assert [w.returncode for w in result.workers] == [2, 2], result.summary()
    assert "m=3 is not a multiple of p; use m=4" in result.output(1)


@pytest.mark.slow
def test_resume_from_a_1f1b_checkpoint_and_a_switch_is_refused(tmp_path):
    """Checkpoints stay keyed by layer: 2 steps of 1f1b on 2 stages, then interleaved (4 stages on 2 ranks)
    resumes to step 4; a switch command before step 3 to a plan that is not a loop is refused and training goes
    on, equal to the oracle (switches between loop plans: test_interleaved_switch.py)."""
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    script = tmp_path / "switch.json"
    script.write_text(json.dumps({3: Command.switch(replace(even_plan(graph, 2), version=1), "test").to_dict()}))
    common = ["--model", "mlp", "--timeout", "60", "--checkpoint_dir", str(tmp_path / "ckpt")]
    first = launch_workers([*common, "--steps", "2", "--num_stages", "2"], 2, timeout=300)
    assert first.ok, first.summary()
    result = launch_workers([*common, "--steps", "4", "--schedule", "interleaved", "--resume", "--allow_config_change",
                             "--control_script", str(script)], 2, timeout=300)
    assert result.ok, result.summary()
    assert "refusing the switch to plan v1" in result.output(0)
    assert "needs loop placement over p >= 2 ranks" in result.output(0)  # one stage per rank: not a loop
    checkpoint = load_checkpoint(tmp_path / "ckpt")
    assert checkpoint.extra["next_step"] == 4 and checkpoint.world["plan"]["version"] == 0
    _assert_close(checkpoint.params(), _oracle(4, 8, 4, 0.01, False))


@pytest.mark.slow
def test_pipeline_trainer_evaluates_as_the_model(tmp_path):
    """`PipelineTrainer` with schedule="interleaved" on 2 processes (4 stages): after training, `evaluate` runs
    the rank's stages in order, in eval mode (a ViT's dropout off), and equals single-process evaluation of the same
    trained model."""
    worker, port = Path(__file__).parents[1] / "support" / "eval_worker.py", free_port()
    result = launch([[sys.executable, str(worker), str(rank), "2", str(port), str(tmp_path), "interleaved"]
                     for rank in range(2)], timeout=300)
    assert result.ok, result.summary()
    results = json.loads((tmp_path / "world2_interleaved.json").read_text())
    for name in ("mlp", "vit_dropout"):  # the ViT: its stages' traced dropout must be off (they were left in train mode)
        got, case = results[name], make_case(name)
        single_process_reference(case.model, case.loss, case.sgd, case.train_data, case.config, STEPS)
        want = single_process_evaluate(case.model, case.loss, case.eval_data, case.config.num_microbatches, EVAL_STEPS,
                                       case.metric)
        assert got["loss"] == pytest.approx(want.loss, abs=1e-5), name
        assert got["metric"] == pytest.approx(want.metric, abs=1e-6), name
