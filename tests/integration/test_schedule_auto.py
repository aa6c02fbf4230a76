"""`--schedule auto` on 2 processes: the chosen schedule trains exactly as single-process training does (1e-5),
rank 0 logs the one line of the choice, and the plan table shows the predicted bubble."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import launch_workers
from support.mlp import assert_params_close, reference_params

STEPS = 3


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(400)
def test_auto_picks_a_schedule_that_trains_exactly_and_says_why(tmp_path: Path) -> None:
    common = ["--model", "mlp", "--schedule", "auto", "--steps", str(STEPS), "--batch_size", "8",
              "--num_microbatches", "4", "--timeout", "60"]
    jobs = [common + ["--checkpoint_dir", str(tmp_path / "free")],
            # Under a memory limit every candidate is priced (zbv's even V split checked per rank).
            common + ["--checkpoint_dir", str(tmp_path / "limited"), "--memory_per_worker", "1e10"],
            # Resumed with auto, it chooses again: the checkpoint recorded "auto", so that is no schedule change.
            [*common[:5], str(STEPS + 2), *common[6:], "--checkpoint_dir", str(tmp_path / "limited"), "--resume"]]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    result = launch_workers(["--jobs", str(tmp_path / "jobs.json"), "--timeout", "60"], 2, timeout=350)
    assert result.ok, result.summary()
    out = result.output(0)
    lines = re.findall(r"schedule auto: chose .*", out)
    assert len(lines) == 3, out
    # The MLP is traced, not profiled: it is priced by parameter bytes, as the even split is ("units"); with every
    # node weighted, the estimated I/W split favours a zero-bubble schedule in a loop.
    first = re.match(r"schedule auto: chose (zbinterleaved|interleaved) \(predicted [\d.]+ units/step, bubble \d+ %; "
                     r"1f1b [\d.]+ units, gpipe [\d.]+ units", lines[0])
    assert first is not None, lines[0]
    assert re.match(r"schedule auto: chose \w+ \(predicted [\d.]+ units/step, bubble \d+ %; ", lines[1]), lines[1]
    assert "zbv refused" not in lines[1] and "zbv " in lines[1], lines[1]  # priced under the limit (it fits 10 GB)
    tables = re.findall(r"schedule (\w+) \(chosen by auto\): predicted [\d.]+ units per step, bubble \d+ %", out)
    assert tables[0] == first.group(1), out
    assert "[rank 0 stage 0,2]" in out  # the first job runs the loop plan: 2 stages per rank
    assert "schedule auto" not in result.output(1)  # one line, on rank 0
    assert lines[2].startswith(f"schedule auto: chose {first.group(1)} ")  # no memory limit on the resume
    for name, steps in (("free", STEPS), ("limited", STEPS + 2)):
        checkpoint = load_checkpoint(tmp_path / name)
        assert checkpoint.extra["next_step"] == steps
        assert checkpoint.extra["training"]["schedule"] == "auto"
        assert_params_close(checkpoint.params(), reference_params(steps), f"--schedule auto ({name})")


@pytest.mark.slow  # starts a coordinator and workers
@pytest.mark.timeout(400)
def test_auto_under_a_coordinator_switches_plans_live_and_stays_exact(tmp_path: Path) -> None:
    from model_parallel.coordinator.local import CoordinatorProcess
    from model_parallel.runtime.launch import LocalWorld, worker_commands
    from support.mlp import mlp_job

    graph, plan = mlp_job(tmp_path, 2)
    steps, token = 40, "schedule-auto-token"
    with CoordinatorProcess(graph, plan, token, workdir=tmp_path,
                            extra=["--window", "3", "--cooldown-steps", "3", "--threshold", "0.05"]) as coord:
        # Rank 1 slows down 4x after step 2: the policy moves work off it while the run uses auto's schedule.
        args = ["--model", "mlp", "--plan", str(plan), "--schedule", "auto", "--steps", str(steps), "--batch_size", "8",
                "--num_microbatches", "4", "--checkpoint_dir", str(tmp_path / "ck"), "--timeout", "30",
                "--coordinator", coord.address, "--token", token,
                "--slowdown", "4", "--slowdown_rank", "1", "--slowdown_after_step", "2"]
        with LocalWorld(worker_commands(args, 2)) as world:
            result = world.wait(timeout=300)
        assert result.ok, result.summary()
        assert coord.wait(timeout=20) == 0, coord.output()
    line = re.search(r"schedule auto: chose .*", result.output(0))
    assert line is not None, result.output(0)
    # The plan given runs one stage per rank: neither a loop (interleaved) nor a V (zbv) can run it. (Under a
    # coordinator zbv is a candidate like any other: its policy re-plans a V, test_zbv_rebalance.py.)
    assert re.match(r"schedule auto: chose (1f1b|gpipe|zbh1) .*interleaved refused: the interleaved schedule needs loop "
                    r"placement.*zbv refused: the zbv schedule needs 2p stages on p >= 2 ranks in a V",
                    line.group(0)), line.group(0)
    assert "plan v1 is live" in coord.output(), coord.output()
    # Chosen again for the rebalanced plan, from the measured times (coordinator/rechoose.py), and run by every rank.
    again = re.search(r"schedule auto after plan v1: chose (1f1b|gpipe|zbh1) \(predicted [\d.]+ ms/step", coord.output())
    assert again is not None, coord.output()
    checkpoint = load_checkpoint(tmp_path / "ck")
    assert checkpoint.extra["training"]["schedule"] == "auto"
    if checkpoint.world["plan"]["version"] == 1:  # no later switch chose again
        assert checkpoint.extra["training"]["schedule_running"] == again.group(1)
    assert_params_close(checkpoint.params(), reference_params(steps), "auto, rebalanced live")
