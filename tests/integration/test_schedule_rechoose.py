"""`--schedule auto` chosen again at a live switch, on 2 processes: a switch naming a schedule (`Command.schedule`)
runs the new plan under it on every rank and trains exactly as single-process training does (1e-5); under a
coordinator, `ctl set-plan` to a loop plan makes it choose a loop schedule for plan v1 (one stage per rank ->
2 per rank), logged on the coordinator and on rank 0."""
from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest

from model_parallel.graph.io import load_graph
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import launch_workers
from support.mlp import assert_params_close, mlp_job, reference_params

LOOP_LINE = (r"schedule auto after plan v1: chose (zbinterleaved|interleaved) \((?:list-built order, )?predicted [\d.]+ "
             r"ms/step, bubble \d+ %")  # zero bubble: priced in the order the workers list-build (list_order.py)


def loop_plan(graph_path: Path, version: int) -> dict:
    """The MLP cut into 4 stages, stage k on rank k % 2, as plan `version` (a dict, as ctl sends it)."""
    four = even_plan(load_graph(graph_path), 4)
    return replace(four, stages=tuple(replace(s, ranks=(s.stage_id % 2,)) for s in four.stages), version=version).to_dict()


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(400)
def test_a_switch_naming_a_schedule_runs_it_on_every_rank_exactly(tmp_path: Path) -> None:
    graph, plan = mlp_job(tmp_path, 2)
    steps = 5
    script = tmp_path / "switch.json"
    loop = Plan.from_dict(loop_plan(graph, 1), "test")
    script.write_text(json.dumps({2: Command.switch(loop, "test: a loop plan", schedule="interleaved").to_dict()}))
    result = launch_workers(["--model", "mlp", "--plan", str(plan), "--schedule", "auto", "--steps", str(steps),
                             "--batch_size", "8", "--num_microbatches", "4", "--timeout", "60",
                             "--checkpoint_dir", str(tmp_path / "ck"), "--control_script", str(script)], 2, timeout=300)
    assert result.ok, result.summary()
    out = result.output(0)
    start = re.search(r"schedule auto: chose (\w+)", out)
    assert start is not None and start.group(1) in ("1f1b", "gpipe", "zbh1"), out  # one stage per rank at the start
    assert re.search(rf"switched to plan v1 under schedule interleaved \(was {start.group(1)}\)", out), out
    assert "[rank 0 stage 0,2]" in out and "[rank 1 stage 1,3]" in result.output(1)
    checkpoint = load_checkpoint(tmp_path / "ck")
    assert checkpoint.extra["training"]["schedule"] == "auto"  # a resume chooses again: no schedule change
    assert checkpoint.extra["training"]["schedule_running"] == "interleaved"
    assert checkpoint.world["plan"]["version"] == 1
    assert_params_close(checkpoint.params(), reference_params(steps), "auto, switched to interleaved live")
    # Resumed with auto, it chooses again from the profile for the plan given (not the one it switched to): the
    # checkpoint says "auto", so whatever it picks is no schedule change, and training goes on exactly.
    resumed = launch_workers(["--model", "mlp", "--plan", str(plan), "--schedule", "auto", "--steps", str(steps + 2),
                              "--batch_size", "8", "--num_microbatches", "4", "--timeout", "60",
                              "--checkpoint_dir", str(tmp_path / "ck"), "--resume"], 2, timeout=300)
    assert resumed.ok, resumed.summary()
    assert re.search(r"schedule auto: chose (1f1b|gpipe|zbh1) ", resumed.output(0)), resumed.output(0)
    again = load_checkpoint(tmp_path / "ck")
    assert again.extra["next_step"] == steps + 2 and again.extra["training"]["schedule"] == "auto"
    assert_params_close(again.params(), reference_params(steps + 2), "auto, resumed after a live re-choice")


@pytest.mark.slow  # starts a coordinator and workers
@pytest.mark.timeout(400)
def test_the_coordinator_chooses_the_schedule_again_for_a_new_plan(tmp_path: Path) -> None:
    from model_parallel.coordinator.local import CoordinatorProcess
    from model_parallel.runtime.launch import LocalWorld, worker_commands

    graph, plan = mlp_job(tmp_path, 2)
    steps, token = 300, "schedule-rechoose-token"
    (tmp_path / "loop.json").write_text(json.dumps(loop_plan(graph, 1)))
    with CoordinatorProcess(graph, plan, token, workdir=tmp_path, extra=["--policy", "manual"]) as coord:
        args = ["--model", "mlp", "--plan", str(plan), "--schedule", "auto", "--steps", str(steps), "--batch_size", "8",
                "--num_microbatches", "4", "--checkpoint_dir", str(tmp_path / "ck"), "--timeout", "30",
                "--coordinator", coord.address, "--token", token]
        with LocalWorld(worker_commands(args, 2)) as world:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # both ranks registered and training: then the operator's new plan
                status = coord.ctl("status")
                if len(status.get("workers", {})) == 2 and all((w.get("step") or -1) >= 2 for w in status["workers"]):
                    break
                time.sleep(0.1)
            switched = coord.ctl("set-plan", plan=json.loads((tmp_path / "loop.json").read_text()))
            assert switched["switched"] and switched["version"] == 1, switched
            result = world.wait(timeout=300)
        assert result.ok, result.summary()
        assert coord.wait(timeout=20) == 0, coord.output()
    line = re.search(LOOP_LINE + r".*", coord.output())
    assert line is not None, coord.output()
    assert "1f1b refused: placement: several stages per rank" in line.group(0), line.group(0)
    assert "split F/B by the profile's ratio" in line.group(0)
    assert re.search(LOOP_LINE, result.output(0)), result.output(0)  # rank 0 logs the choice it runs
    # With steps this short the coordinator's view lags rank 0 by many steps: the switch stays pending until a report
    # of v1 confirms it (rebalancer.py gives a switch up only with its connection, or after PENDING_TIMEOUT_S).
    assert "plan v1 is live" in coord.output(), coord.output()
    assert re.search(rf"switched to plan v1 under schedule {line.group(1)} \(was (1f1b|gpipe|zbh1)\)", result.output(0))
    checkpoint = load_checkpoint(tmp_path / "ck")
    assert checkpoint.extra["training"]["schedule_running"] == line.group(1)
    assert_params_close(checkpoint.params(), reference_params(steps), "auto, chosen again at plan v1")
