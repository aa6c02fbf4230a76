"""The pipeline runtime against single-process training: one 4-rank world runs many jobs (`--jobs`).

Every job writes its final parameters as a checkpoint (keyed by layer); the test trains the
original model in this process with the same data, microbatching and optimizer and compares
every parameter within 1e-5 relative. A second, small world checks that a killed worker makes
the others exit naming it.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from model_parallel.cli.worker import main as worker_main
from model_parallel.codegen.naming import state_key
from model_parallel.graph.plan import Plan, StagePlan, write_plan
from model_parallel.messages import Command
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.data.batches import split_microbatches
from model_parallel.runtime.launch import LocalWorld, launch_workers, worker_commands
from model_parallel.runtime.trainer import single_process_reference

WORLD = 4
TOL = 1e-5


def _job(name: str, model: str, steps: int, *extra: str, whole_model: bool = False) -> dict:
    return {"name": name, "model": model, "steps": steps, "extra": list(extra), "whole_model": whole_model}


# name, model, steps, extra flags. Together: mlp / resnet18 / gpt on 2, 3 and 4 stages, with and
# without a replicated stage, SGD+momentum and AdamW, 1F1B and GPipe, clipping, LR schedule,
# recomputation, and plan switches (incl. onto fewer ranks, leaving spares).
JOBS = [
    _job("mlp2_20steps", "mlp", 20, "--num_stages", "2", "--clip_grad", "0.5", "--lr_schedule", "cosine:20"),
    _job("mlp4_adamw_gpipe", "mlp", 4, "--num_stages", "4", "--optimizer", "adamw", "--weight_decay", "0.01",
         "--schedule", "gpipe", "--lr", "0.003"),
    _job("mlp3_replicated", "mlp", 4, "--num_stages", "3", "--stage_to_num_ranks", "0:2", "--num_microbatches", "3",
         "--batch_size", "9"),
    _job("mlp_switching", "mlp", 8, "--num_stages", "4", "--optimizer", "adamw", "--lr", "0.003",
         "--control_script", "{switch_script}"),
    _job("resnet3", "resnet18", 3, "--num_stages", "3"),
    # Replicas sum their microbatch gradients in another order than one process does (fp32 is not
    # associative). That is invisible unless a gradient is itself rounding noise: BatchNorm over 2
    # samples at resnet18's 1x1 layer4 maps any input to +-1, so its input gradient is noise; hence
    # microbatches of 8 here. Adam also turns last-bit differences of near-zero gradients into small
    # update differences on near-zero parameters (BatchNorm biases): compared over the whole model.
    _job("resnet2_replicated_adamw", "resnet18", 2, "--num_stages", "2", "--stage_to_num_ranks", "1:2",
         "--optimizer", "adamw", "--lr", "0.001", "--batch_size", "16", "--num_microbatches", "2", whole_model=True),
    _job("resnet4", "resnet18", 2, "--num_stages", "4", "--num_microbatches", "2"),
    _job("gpt4_adamw_recompute", "gpt", 3, "--num_stages", "4", "--optimizer", "adamw", "--lr", "0.003",
         "--eps", "1e-6", "--recompute", "all"),
    _job("gpt2_replicated", "gpt", 3, "--num_stages", "2", "--stage_to_num_ranks", "0:2,1:2"),
    # A multi-level plan's placement (optimizer, `-n 2 2`): each stage on the same GPU of both servers.
    _job("mlp2_replicas_across_servers", "mlp", 3, "--plan", "{interleaved_plan}", "--num_microbatches", "2"),
    _job("gpt3", "gpt", 3, "--num_stages", "3", "--schedule", "gpipe"),
    # bf16 autocast per stage: boundary activations and their gradients cross as bf16 tensors; the
    # oracle is the same stages under the same autocast in one process (SingleProcessRunner). The
    # MLP's cuts are bf16 already (a Linear under autocast); the GPT's residual stream is float32
    # there, so it crosses rounded to bf16 both ways, and the oracle rounds at the same cuts.
    _job("mlp3_bf16", "mlp", 3, "--num_stages", "3", "--bf16"),
    _job("gpt3_bf16", "gpt", 2, "--num_stages", "3", "--bf16", "--schedule", "gpipe"),
    # bf16 across live switches: the cuts where values round to bf16 move with the plan, so the oracle switches
    # too (_switching_bf16_reference); lr 0.1 makes the rounding visible: the unswitched oracle is 4e-3 away.
    _job("gpt_switching_bf16", "gpt", 6, "--num_stages", "3", "--bf16", "--lr", "0.1",
         "--control_script", "{gpt_switch_script}"),
    # PipeDream's asynchronous 1F1B with weight stashing: compared with the same semantics run in
    # one process (grid order), see test_pipedream_single_process_semantics for that oracle.
    _job("mlp4_pipedream", "mlp", 3, "--num_stages", "4", "--schedule", "pipedream", "--lr", "0.02"),
    _job("gpt3_pipedream_adamw", "gpt", 2, "--num_stages", "3", "--schedule", "pipedream", "--optimizer", "adamw",
         "--lr", "0.003"),
    # bf16 under PipeDream: the oracle applies the same autocast and rounds at the same cuts (trainer.py).
    _job("gpt3_pipedream_bf16", "gpt", 2, "--num_stages", "3", "--schedule", "pipedream", "--bf16", "--lr", "0.02"),
    # Checkpoints are keyed by layer: 3 steps on 2 stages, then resume on 4 stages up to step 6.
    _job("mlp_resume_part1", "mlp", 3, "--num_stages", "2", "--checkpoint_dir", "{root}/mlp_resume"),
    _job("mlp_resume", "mlp", 6, "--num_stages", "4", "--resume", "--metrics", "{root}/metrics/rank{{rank}}.jsonl"),
]
CHECKED = [j for j in JOBS if not j["name"].endswith("_part1")]


def _switch_script(path: Path) -> Path:
    """Plans for the switching job: 4 stages -> 2 stages on ranks 2,3 (ranks 0,1 spare) ->
    3 stages with stage 0 replicated on 2 ranks -> 4 stages again."""
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    two = even_plan(graph, 2)
    two = Plan(stages=tuple(replace(s, ranks=(s.stage_id + 2,)) for s in two.stages), version=1)
    three = replace(even_plan(graph, 3, {0: 2}), version=2)
    four = replace(even_plan(graph, 4), version=3)
    script = {2: Command.switch(two, "onto fewer ranks"), 4: Command.switch(three, "replicate stage 0"),
              6: Command.switch(four, "back to 4 stages")}
    path.write_text(json.dumps({k: v.to_dict() for k, v in script.items()}))
    return path


def _gpt_switch_plans() -> dict[int, Plan]:
    """The bf16 switching job's plans by the step they start at: 3 stages cut elsewhere and on other ranks, then 2
    stages on ranks 3 and 1 (0 and 2 spare)."""
    r = recipe("gpt")
    graph, _ = trace_model(r.model(0), r.example(2))
    order = list(graph.topological_order)

    def cut(starts: list[int], ranks: list[int], version: int) -> Plan:
        bounds = [0, *starts, len(order)]
        return Plan(stages=tuple(StagePlan(k, tuple(order[a:b]), ranks=(ranks[k],))
                                 for k, (a, b) in enumerate(zip(bounds, bounds[1:]))), version=version)

    return {2: cut([len(order) // 4, len(order) // 2], [2, 0, 1], 1), 4: cut([2 * len(order) // 3], [3, 1], 2)}


def _switching_bf16_reference(job: dict, factory: Any, config: TrainConfig) -> dict[str, torch.Tensor]:
    """The pipeline's bf16 semantics plan by plan: a SingleProcessRunner per plan over the same layers, the
    optimizer state carried over at each switch (as the migration moves it with the layers)."""
    from model_parallel.runtime.trainer import SingleProcessRunner

    r = recipe(job["model"])
    model = r.model(0)
    graph, _ = trace_model(model, r.example(2))
    plans = {0: even_plan(graph, int(_flags(job["extra"])["num_stages"])), **_gpt_switch_plans()}
    starts = sorted(plans)
    runner = None
    for start, end in zip(starts, [*starts[1:], job["steps"]]):
        previous, runner = runner, SingleProcessRunner(graph, plans[start], model, r.criterion, factory,
                                                       r.data(config.batch_size, 0), config)
        if previous is not None:
            for param in runner.params:  # the same Parameter objects: the stages share the model's layers
                runner.optimizer.state[param] = previous.optimizer.state[param]
        runner.train(end, start)
    return {state_key(k): v.detach() for k, v in model.named_parameters()}


def _interleaved_plan(path: Path) -> Path:
    """2 stages, each replicated on ranks that are not adjacent: stage 0 on 0 and 2, stage 1 on 1 and 3."""
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    plan = even_plan(graph, 2, {0: 2, 1: 2})
    write_plan(replace(plan, stages=tuple(replace(s, ranks=(s.stage_id, s.stage_id + 2)) for s in plan.stages)), path)
    return path


def _flags(extra: list[str]) -> dict[str, str]:
    out, key = {}, None
    for item in extra:
        if item.startswith("--"):
            key = item[2:]
            out[key] = "true"
        elif key:
            out[key] = item
    return out


def _reference(job: dict) -> dict[str, torch.Tensor]:
    flags = _flags(job["extra"])
    r = recipe(job["model"])
    model = r.model(0)
    batch = int(flags.get("batch_size", 8))
    config = TrainConfig(batch_size=batch, num_microbatches=int(flags.get("num_microbatches", 4)),
                         clip_grad=float(flags["clip_grad"]) if "clip_grad" in flags else None,
                         lr_schedule=flags.get("lr_schedule", "constant"))
    lr, wd = float(flags.get("lr", 0.01)), float(flags.get("weight_decay", 0.0))
    if flags.get("optimizer") == "adamw":
        eps = float(flags.get("eps", 1e-8))
        factory = lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=wd, eps=eps)  # noqa: E731
    else:
        factory = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd)  # noqa: E731
    if flags.get("schedule") == "pipedream" or "bf16" in flags:
        from model_parallel.runtime.trainer import SingleProcessRunner

        config = replace(config, schedule=flags.get("schedule", config.schedule), bf16="bf16" in flags)
        if "control_script" in flags:
            return _switching_bf16_reference(job, factory, config)
        graph, _ = trace_model(model, r.example(2))
        runner = SingleProcessRunner(graph, even_plan(graph, int(flags["num_stages"])), model, r.criterion, factory,
                                     r.data(batch, 0), config)
        runner.train(job["steps"])
        return {state_key(k): v.detach() for k, v in model.named_parameters()}  # the stages share its layers
    single_process_reference(model, r.criterion, factory, r.data(batch, 0), config, job["steps"])
    return {state_key(k): v.detach() for k, v in model.named_parameters()}


def _assert_close(job: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], whole_model: bool = False) -> None:
    """Every parameter tensor within TOL relative (in norm); with `whole_model`, the concatenation."""
    assert sorted(got) == sorted(want), f"{job}: parameter names differ"
    if whole_model:
        got = {"all parameters": torch.cat([got[k].reshape(-1) for k in sorted(want)])}
        want = {"all parameters": torch.cat([want[k].reshape(-1) for k in sorted(want)])}
    for key, value in want.items():
        diff = torch.linalg.vector_norm(got[key].double() - value.double()).item()
        scale = max(torch.linalg.vector_norm(value.double()).item(), 1e-12)
        assert diff <= TOL * scale, f"{job}: {key} differs by {diff:.3g} in norm (relative {diff / scale:.3g})"


@pytest.fixture(scope="module")
def jobs_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime_jobs")
    script = _switch_script(root / "switch.json")
    gpt_script = root / "gpt_switch.json"
    gpt_script.write_text(json.dumps({k: Command.switch(p, "bf16 cuts move").to_dict() for k, p in _gpt_switch_plans().items()}))
    interleaved = _interleaved_plan(root / "interleaved.json")
    argv = []
    for job in JOBS:
        extra = [e.format(switch_script=script, gpt_switch_script=gpt_script, interleaved_plan=interleaved, root=root)
                 for e in job["extra"]]
        argv.append(["--model", job["model"], "--steps", str(job["steps"]), "--timeout", "60",
                     "--checkpoint_dir", str(root / job["name"]), *extra])
    (root / "jobs.json").write_text(json.dumps(argv))
    result = launch_workers(["--jobs", str(root / "jobs.json"), "--timeout", "60"], WORLD, timeout=400)
    assert result.ok, result.summary()
    return root, result


@pytest.mark.slow
@pytest.mark.parametrize("job", CHECKED, ids=[j["name"] for j in CHECKED])
def test_pipeline_matches_single_process(jobs_world, job):
    root, _ = jobs_world
    checkpoint = load_checkpoint(root / job["name"])
    assert checkpoint.extra["next_step"] == job["steps"]
    if "--bf16" in job["extra"]:  # mixed precision keeps float32 master weights
        assert {v.dtype for v in checkpoint.params().values()} == {torch.float32}, job["name"]
    _assert_close(job["name"], checkpoint.params(), _reference(job), job["whole_model"])


@pytest.mark.slow
def test_switches_report_pauses_and_end_on_the_last_plan(jobs_world):
    root, result = jobs_world
    checkpoint = load_checkpoint(root / "mlp_switching")
    assert checkpoint.world["plan"]["version"] == 3
    pauses = [line for line in result.output(0).splitlines() if "switched to plan" in line and "bf16" not in line]
    assert len(pauses) == 3 and all(re.search(r"in \d+\.\d ms", p) for p in pauses)
    # the resumed run wrote metrics only for the steps it ran, with pause_ms and plan versions
    from model_parallel.runtime.observe.metrics_read import read_metrics

    records = read_metrics(root / "metrics")
    assert sorted({r["step"] for r in records}) == [3, 4, 5]
    assert {r["rank"] for r in records} == {0, 1, 2, 3}
    # the rank that was a spare in plan v1 still finished every step
    assert re.search(r"\[rank 1 stage \d\] done: 8 step\(s\).*switch pauses ms \[[\d., ]+\]", result.output(1))


@pytest.mark.slow
def test_killed_worker_is_named_by_the_others(tmp_path):
    commands = worker_commands(["--model", "mlp", "--num_stages", "3", "--steps", "100000", "--timeout", "15",
                                "--batch_size", "4", "--num_microbatches", "2", "-v"], 3)
    with LocalWorld(commands) as world:
        world.wait_for_line(1, r"step 3 loss", timeout=120)
        world.kill(1)
        result = world.wait(timeout=60)
    assert not result.timed_out, result.summary()
    for rank in (0, 2):
        worker = result.workers[rank]
        assert worker.returncode not in (0, None), result.summary()
        assert re.search(r"rank 1 stopped responding", worker.output), result.summary()


def test_single_process_mode_matches_reference(capsys):
    # In this process: every stage in one process (debugging mode), 3 steps of the MLP on 3 stages.
    from model_parallel.runtime.trainer import SingleProcessRunner

    r = recipe("mlp")
    model = r.model(0)
    graph, _ = trace_model(model, r.example(2))
    config = TrainConfig(batch_size=8, num_microbatches=4)
    factory = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    runner = SingleProcessRunner(graph, even_plan(graph, 3), model, r.criterion, factory, r.data(8, 0), config)
    runner.train(3)
    want = _reference(_job("sp", "mlp", 3))
    _assert_close("single process", {k: v for k, v in runner.state_dict().items()}, want)
    assert worker_main(["--single_process", "--model", "mlp", "--steps", "2", "--num_stages", "2"]) == 0
    assert re.search(r"step 1 loss \d", capsys.readouterr().out)


def test_pipedream_single_process_semantics():
    # One stage: forward j runs on version j (every earlier update applied) = plain per-microbatch SGD.
    from model_parallel.runtime.trainer import SingleProcessRunner

    r = recipe("mlp")
    model, reference = r.model(0), r.model(0)
    graph, _ = trace_model(model, r.example(2))
    config = TrainConfig(batch_size=8, num_microbatches=4, schedule="pipedream")
    factory = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    SingleProcessRunner(graph, even_plan(graph, 1), model, r.criterion, factory, r.data(8, 0), config).train(2)
    optimizer = factory(list(reference.parameters()))
    for step in range(2):
        inputs, target = r.data(8, 0).batch(step)
        for (x,), y in split_microbatches(list(inputs), target, 4):
            r.criterion(reference(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_worker_command_line_errors():
    from model_parallel.errors import ModelParallelError, PlanError

    with pytest.raises(PlanError, match="give exactly one of --model, --package, --graph"):
        worker_main(["--single_process", "--steps", "1"])
    with pytest.raises(ModelParallelError, match="--clip_grad needs a flush schedule"):
        worker_main(["--single_process", "--model", "mlp", "--schedule", "pipedream", "--clip_grad", "1"])
    with pytest.raises(ModelParallelError, match="batch size 2 < 4 microbatches"):
        worker_main(["--single_process", "--model", "mlp", "--batch_size", "2"])
    with pytest.raises(ModelParallelError, match="bad --lr_schedule 'cosine:x'"):
        worker_main(["--single_process", "--model", "mlp", "--lr_schedule", "cosine:x"])
    with pytest.raises(ModelParallelError, match="unknown model 'vgg'"):
        worker_main(["--single_process", "--model", "vgg"])
    with pytest.raises(PlanError, match=r"rank and world size are unknown"):
        worker_main(["--model", "mlp"])
