"""Runtime benchmark: our pipeline runtime vs torch.distributed.pipelining, same model, split, schedule, machine.

    python bench/runtime.py            # full run (about 15 minutes on 2 cores)
    python bench/runtime.py --quick    # about 5 minutes (2 rounds of 8 timed steps), `make bench`
    python bench/runtime.py --models mlp --schedules 1f1b --steps 10
    python bench/runtime.py --bf16     # mixed precision on both sides (writes runtime_bf16.json)

Rows (model x schedule; `SHAPES`): torchvision resnet50 at 32x32 on 4 stages (batch 32, 4
microbatches), Hugging Face GPT-2 from a config (`GPT2LMHeadModel`, random init: 4 blocks, width 128,
64 tokens, vocabulary 512; traced by torch.export, cut between blocks; untied head, because torch's
pipelining has no tie across stages) on 4 stages (batch 32, 4 microbatches), the StackedMLP 256 -> 8 x 1024 -> 10 on 2 stages (batch 64, 4 microbatches);
1F1B and GPipe. The main process first calibrates the machine (`cli.calibrate`: link, optimizer
step per MB, the runtime's fixed cost per microbatch), then profiles each model at microbatch size
(its loss too), cuts it into stages of about equal measured compute (`runtime.stages.even_plan`)
and writes the graph and plan; both runtimes build their stage modules from that same graph and
plan (`codegen.build_stages`), so only the runtime differs. Every worker is its own process with
one thread (`torch.set_num_threads(1)`, OMP_NUM_THREADS=1), gloo on localhost; every world runs
under a deadline and is always reaped (`runtime.launch`). The sides alternate model by model (torch
world, our world, next model), each world running every schedule, for `--rounds` rounds (the order
of the two sides flips every round, so a drift in machine load hits both alike); each number is
the median over the rounds.

- torch: `PipelineStage` (manual stage construction) + `Schedule1F1B` / `ScheduleGPipe`.
- ours: the worker API, `runtime.engine.PipelineEngine` (what test_parallel_0.py runs) with the
  same graph, plan, schedule, batch size, microbatches and data; its own per-step metrics
  (compute / comm / idle split per rank, `runtime.metrics`) are stored in the row as well.
- both: SGD with momentum 0.9; steps/s = timed steps / wall time between two barriers, after
  warm-up steps (slowest rank), median over the rounds (every round's value is in the row too).
- ratio = ours / torch steps per second (goal >= 1.10).
- efficiency = ideal / measured step time, ideal = (m + p - 1) * max stage time, where a stage's
  time is its per-microbatch forward + backward measured in isolation (no communication, best of
  several repetitions) by its own rank at the start of each world (best over that side's rounds).
- predicted_stage_ms / measured_stage_ms (ours, per stage, ms per step, on `stage_clock`): what a
  stage rank does in one step of m microbatches. On the CPU clock (default, `--clock`): the rank
  process's CPU time per step (`StepRecord.cpu_ms`, median over the timed steps), which neither
  waiting on a peer nor being descheduled (4 ranks on 2 cores, other processes) inflates; on the
  wall clock `runtime.metrics.busy_ms`. Predicted: `optimizer.fidelity.predict_stage_ms` from a
  profile on the same clock and the calibration (terms in `predicted_terms_ms`; the printed table
  puts them next to the rank's measured forward / backward / optimizer / send / recv, wall ms).
  `stage_error_pct` = (predicted - measured) / measured. Goal: within +-10 %.

`--bf16`: both sides train in mixed precision. Ours: `TrainConfig.bf16` (forwards under bf16
autocast, float32 boundary tensors and their gradients sent as bf16), profiled and priced at bf16
(`profile(..., precision="bf16")`). torch's: each stage module's forward wrapped in the same autocast
(`AutocastStage`) and the loss on the float32 output; its boundary tensors travel in the dtype the
stage produced (a float32 residual stream stays float32: torch's pipelining has no wire narrowing).
Every row carries its `precision`.

Writes `bench/results/runtime.json` (atomically; `runtime_bf16.json` with --bf16): {"rows": [{model, schedule, num_stages, ratio,
efficiency, predicted_stage_ms, measured_stage_ms, ours_split_ms_by_rank, machine: {cpus, load_1min
[min, max] over the row's worlds, processes, ...}, ...}], "machine": {..., "uptime"}, "calibration"}.
With more ranks than cores (4 stages on 2 cores) ranks time-share the cores: busy times then include
time a rank was runnable but descheduled, and efficiency is bounded by cores / ranks.
Timings on a shared 2-core machine are noisy: compare numbers taken in the same run only.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "runtime.json"
RESULTS_BF16 = REPO / "bench" / "results" / "runtime_bf16.json"
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
# model -> (stages, batch size, microbatches): the issue's rows (resnet50 and the GPT at 4 stages, the MLP at 2).
SHAPES = {"mlp": (2, 64, 4), "resnet50": (4, 32, 4), "gpt2": (4, 32, 4), "resnet18": (2, 64, 4)}

logger = logging.getLogger("bench.runtime")


# ----------------------------------------------------------------------------- models and shared set-up


def _bench_mlp() -> torch.nn.Module:
    from model_parallel.models import StackedMLP

    # 8 hidden 1024-wide layers: about 50 ms per fwd+bwd+SGD step at batch 64 on one core (ENV.md).
    return StackedMLP(in_features=256, width=1024, depth=8, num_classes=10)


def _bench_resnet50() -> torch.nn.Module:
    from model_parallel.compat import import_torchvision

    return import_torchvision().models.resnet50(num_classes=10)


def _bench_gpt2() -> torch.nn.Module:
    import transformers

    # Scaled to a 2-core machine: 4 blocks of width 128, 64 tokens of a 512-token vocabulary.
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False))


def _lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Token cross entropy of logits (B, T, V), or of a Hugging Face output's "logits", against ids (B, T)."""
    logits = output if isinstance(output, torch.Tensor) else output["logits"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def recipes() -> dict[str, Any]:
    """The benchmark's models, as worker-zoo recipes (seeded builder, loss, input shape)."""
    import torch.nn.functional as F

    from model_parallel.runtime.zoo import Recipe, recipe

    return {"mlp": Recipe("mlp", _bench_mlp, F.cross_entropy, (256,), 10), "resnet18": recipe("resnet18"),
            "resnet50": Recipe("resnet50", _bench_resnet50, F.cross_entropy, (3, 32, 32), 10),
            "gpt2": Recipe("gpt2", _bench_gpt2, _lm_loss, (64,), 512, kind="tokens")}


class AutocastStage(torch.nn.Module):
    """A stage module whose forward runs under bf16 autocast (torch's side of --bf16), as our
    `StepExecutor.forward` runs it; the parameters stay the inner module's (float32)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(*args)


def _float(output: Any) -> Any:
    """The model output in float32 for the criterion (runtime/output.py `float_output`)."""
    return output.float() if isinstance(output, torch.Tensor) and output.is_floating_point() else output


def _build(model_name: str, spec: dict[str, Any]):
    """(recipe, model, graph, plan, stage modules) exactly as every process of this benchmark builds them."""
    from model_parallel.codegen.build import build_stages
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import read_plan
    from model_parallel.runtime.stages import layer_modules

    entry = spec["models"][model_name]
    rec = recipes()[model_name]
    model = rec.model(spec["seed"])
    graph = load_graph(entry["graph"])
    plan = read_plan(entry["plan"])
    stages = build_stages(graph, plan, modules=layer_modules(graph, model))
    return rec, model, graph, plan, stages


def prepare(model_name: str, spec: dict[str, Any], workdir: Path, calibration: Any) -> dict[str, Any]:
    """Profile at microbatch size, split into the model's stages of about equal compute, save graph +
    plan, and predict each stage's busy time per step (`optimizer.fidelity.predict_stage_ms`)."""
    from model_parallel.graph.io import save_graph
    from model_parallel.graph.plan import write_plan
    from model_parallel.profiler.api import profile
    from model_parallel.runtime.stages import even_plan

    from model_parallel.optimizer.fidelity import predict_stage_ms

    rec = recipes()[model_name]
    num_stages, batch_size, microbatches = model_shape(model_name, spec)
    micro = batch_size // microbatches
    model = rec.model(spec["seed"])
    # The loss is profiled too (graph.metadata["profile"]): the last stage pays it per microbatch.
    example = rec.example(micro)
    target = rec.data(micro, spec["seed"]).batch(0)[1]
    # On the calibration's clock: prediction and measurement must be the same quantity (fidelity.py).
    graph = profile(model, example, iterations=spec["profile_iterations"], clock=calibration.clock,
                    loss_fn=lambda output: rec.criterion(output, target), precision=spec["precision"])
    plan = block_plan(graph, num_stages) if model_name == "gpt2" else even_plan(graph, num_stages)
    entry = {"graph": str(save_graph(graph, workdir / f"{model_name}.graph.json")),
             "plan": str(workdir / f"{model_name}.plan.json"), "num_stages": num_stages,
             "batch_size": batch_size, "microbatches": microbatches}
    write_plan(plan, entry["plan"])
    spec["models"][model_name] = entry
    entry["stage_nodes"] = [len(s.node_ids) for s in plan.stages]
    # Every rank runs on this host: more ranks than cores adds the timeshare term (fidelity.py).
    prediction = predict_stage_ms(graph, plan, num_microbatches=microbatches, calibration=calibration, optimizer="sgd",
                                  ranks_per_host=plan.num_ranks)
    entry["predicted_stage_ms"] = [p.total_ms for p in prediction]
    entry["predicted_terms_ms"] = [p.terms() for p in prediction]
    logger.info("%s: %d stages of %s nodes, predicted %s ms per step %s", model_name, num_stages,
                entry["stage_nodes"], calibration.clock, [round(t, 1) for t in entry["predicted_stage_ms"]])
    return entry


BLOCK_PARAMETER = re.compile(r"^(?:blocks|transformer\.h)\.(\d+)\.")  # TinyGPT's and HF GPT-2's block parameters


def block_plan(graph: Any, num_stages: int) -> Any:
    """Cuts between transformer blocks, blocks spread evenly over the stages: a stage starts at the first
    node reading a parameter of its first block (`blocks.<i>.` or `transformer.h.<i>.`).

    An even split by time may cut inside a block, where a Python int (a size) crosses the boundary:
    our runtime carries it, torch's `PipelineStage` refuses non-tensor stage arguments, and the
    benchmark needs a split both can run.
    """
    from model_parallel.graph.plan import Plan, StagePlan

    def block(node: Any) -> Optional[int]:
        match = BLOCK_PARAMETER.match(str(node.layer.target)) if node.layer is not None else None
        return int(match.group(1)) if match else None

    blocks = sorted({b for b in map(block, graph.nodes) if b is not None})
    if len(blocks) < num_stages:
        raise SystemExit(f"bench/runtime.py: {len(blocks)} transformer blocks cannot fill {num_stages} stages")
    first_of_stage = {blocks[len(blocks) * k // num_stages]: k for k in range(1, num_stages)}
    stage, members = 0, [[] for _ in range(num_stages)]
    for node in graph.nodes:  # topological (program) order
        index = block(node)
        if index is not None:
            stage = max(stage, first_of_stage.get(index, 0))
        members[stage].append(node.node_id)
    return Plan(stages=tuple(StagePlan(k, tuple(ids), ranks=(k,)) for k, ids in enumerate(members)))


def model_shape(model_name: str, spec: dict[str, Any]) -> tuple[int, int, int]:
    """(stages, batch size, microbatches) of a model in this run (SHAPES, or the command line's override)."""
    stages, batch, micro = SHAPES.get(model_name, (2, 64, 4))
    return (spec.get("num_stages") or stages, spec.get("batch_size") or batch, spec.get("microbatches") or micro)


def isolated_stage_ms(rec: Any, stages: Sequence[torch.nn.Module], micro: int, reps: int,
                      only: Optional[int] = None, bf16: bool = False) -> list[float]:
    """Best-of-`reps` forward+backward time of each stage (or of stage `only`) on one microbatch, no communication.

    The minimum, not the median: on a shared machine other processes only ever add time, so the
    fastest repetition is the closest to the stage's own cost. Repetitions alternate between stages.
    """
    inputs, target = rec.data(micro, 0).batch(0)
    stages = [AutocastStage(stage) for stage in stages] if bf16 else list(stages)
    stage_inputs: list[tuple[Any, ...]] = []
    boundary: tuple[Any, ...] = inputs
    with torch.no_grad():
        for stage in stages:
            stage_inputs.append(boundary)
            boundary = tuple(stage(*boundary))

    def fwd_bwd(index: int) -> float:
        stage, last = stages[index], index == len(stages) - 1
        args = tuple(x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                     for x in stage_inputs[index])
        start = time.perf_counter()
        out = stage(*args)
        if last:
            rec.criterion(_float(out[0]), target).backward()
        else:
            tensors = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        return (time.perf_counter() - start) * 1000.0

    indices = range(len(stages)) if only is None else [only]
    samples: list[list[float]] = [[] for _ in stages]
    for rep in range(reps + 2):  # two untimed warm-up rounds
        for index in indices:
            elapsed = fwd_bwd(index)
            if rep >= 2:
                samples[index].append(elapsed)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    return [min(samples[i]) for i in indices]


# ----------------------------------------------------------------------------- workers


def _timed(run_steps: Any, spec: dict[str, Any]) -> float:
    """Run warm-up steps, then time the measured steps between two barriers; seconds per step."""
    import torch.distributed as dist

    run_steps(0, spec["warmup"])
    dist.barrier()
    start = time.perf_counter()
    run_steps(spec["warmup"], spec["warmup"] + spec["steps"])
    dist.barrier()
    return (time.perf_counter() - start) / spec["steps"]


def torch_side(model_name: str, schedule_name: str, rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed.pipelining: PipelineStage (manual construction) + Schedule1F1B / ScheduleGPipe."""
    from torch.distributed import pipelining

    rec, _, _, _, stages = _build(model_name, spec)
    entry = spec["models"][model_name]
    module = AutocastStage(stages[rank]) if spec["precision"] == "bf16" else stages[rank]
    last = rank == world_size - 1
    data = rec.data(entry["batch_size"], spec["seed"])

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        # Stage modules return the tuple of their boundary outputs; the model output is its one element.
        return rec.criterion(_float(output[0] if isinstance(output, tuple) else output), target)

    stage = pipelining.PipelineStage(module, rank, world_size, torch.device("cpu"))
    schedule = getattr(pipelining, SCHEDULES[schedule_name])(stage, entry["microbatches"], loss_fn=loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=spec["lr"], momentum=0.9)

    def run_steps(first: int, end: int) -> None:
        for step in range(first, end):
            inputs, target = data.batch(step)
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(*inputs)
            elif last:
                schedule.step(target=target, losses=[])
            else:
                schedule.step()
            optimizer.step()

    return {"step_s": _timed(run_steps, spec)}


def ours_side(model_name: str, schedule_name: str, rank: int, world_size: int, spec: dict[str, Any],
              control_group: Any) -> dict[str, Any]:
    """Our runtime's worker API (`PipelineEngine`) with the same graph, plan, model, data and optimizer."""
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.engine import PipelineEngine

    from model_parallel.runtime.metrics import measured_ms
    from model_parallel.runtime.metrics import busy_ms

    rec, model, graph, plan, _ = _build(model_name, spec)
    entry = spec["models"][model_name]
    config = TrainConfig(batch_size=entry["batch_size"], num_microbatches=entry["microbatches"], schedule=schedule_name,
                         seed=spec["seed"], bf16=spec["precision"] == "bf16")
    engine = PipelineEngine(
        graph=graph, plan=plan, model=model, criterion=rec.criterion,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=spec["lr"], momentum=0.9),
        dataset=rec.data(entry["batch_size"], spec["seed"]), config=config, control_group=control_group,
        options=RunOptions(timeout=spec["op_timeout"], progress=False),
    )
    step_s = _timed(lambda first, end: engine.train(end, start_step=first), spec)
    # The engine's own per-step split (runtime.metrics), for the report: where did the time go?
    timed = [r for r in engine.metrics.records if r.step >= spec["warmup"]]
    split = {key: statistics.mean(getattr(r, key) for r in timed) for key in ("step_ms", "compute_ms", "comm_ms", "idle_ms")}
    split["busy_ms"] = statistics.median(busy_ms(r) for r in timed)
    # What predict_stage_ms predicts on the calibration's clock (CPU ms or busy ms per step), and the
    # measured breakdown to hold its terms against (wall ms, medians over the timed steps).
    split["measured_ms"] = statistics.median(measured_ms(r, spec["clock"]) for r in timed)
    split["cpu_ms"] = statistics.median(r.cpu_ms for r in timed)
    split["breakdown_ms"] = {key: statistics.median(getattr(r, key) for r in timed)
                             for key in ("forward_ms", "backward_ms", "optimizer_ms", "send_ms", "recv_ms", "allreduce_ms")}
    return {"step_s": step_s, "split": split}


def worker(side: str, model_name: str, rank: int, world_size: int, port: int, spec_path: str, result_path: str) -> int:
    """One rank of one world: every schedule of one model on one side (torch or ours), in sequence."""
    import torch.distributed as dist

    from model_parallel.allocator import keep_freed_memory
    from model_parallel.fileio import atomic_write_json

    torch.set_num_threads(1)
    keep_freed_memory()  # both sides: our workers tune the allocator, so the baseline gets it too
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=spec["op_timeout"]))
    results: dict[str, Any] = {}
    try:
        # Each rank times its own stage alone (no communication) under the same conditions as the
        # pipelined run that follows: one thread, the other rank busy on the other core.
        rec, _, _, _, stages = _build(model_name, spec)
        micro = spec["models"][model_name]["batch_size"] // spec["models"][model_name]["microbatches"]
        results["stage_ms"] = isolated_stage_ms(rec, stages, micro, spec["isolated_reps"], only=rank,
                                                bf16=spec["precision"] == "bf16")[0]
        dist.barrier()
        control_group = dist.new_group(backend="gloo") if side == "ours" else None
        for schedule_name in spec["schedules"]:
            if side == "torch":
                result = torch_side(model_name, schedule_name, rank, world_size, spec)
            else:
                result = ours_side(model_name, schedule_name, rank, world_size, spec, control_group)
            results.setdefault("schedules", {})[schedule_name] = result
            print(f"rank {rank}: {side} {model_name} {schedule_name}: {1.0 / result['step_s']:.2f} steps/s", flush=True)
    finally:
        dist.destroy_process_group()
    atomic_write_json(result_path, results)
    return 0


def run_world(side: str, model_name: str, spec_path: Path, workdir: Path, timeout: float, echo: bool) -> dict[str, Any]:
    """Start one world (a process per rank, under a deadline, always reaped).

    Returns {"stage_ms": [isolated fwd+bwd per microbatch, by stage], "schedules": {name: {"step_s", ...}}}.
    """
    from model_parallel.runtime.launch import free_port, launch, print_echo

    num_stages = json.loads(spec_path.read_text())["models"][model_name]["num_stages"]
    port = free_port()
    paths = [workdir / f"{side}_{model_name}_rank{rank}.json" for rank in range(num_stages)]
    commands = [
        [sys.executable, str(Path(__file__).resolve()), "--_worker", side, "--_model", model_name, "--_rank", str(rank),
         "--_port", str(port), "--_spec", str(spec_path), "--_result", str(paths[rank])]
        for rank in range(num_stages)
    ]
    result = launch(commands, timeout=timeout, echo=print_echo if echo else None)
    if not result.ok:
        raise RuntimeError(f"{side} world for {model_name} failed:\n{result.summary()}")
    per_rank = [json.loads(p.read_text()) for p in paths]
    # Both ranks time between the same barriers; take the slower one (they differ by microseconds).
    out: dict[str, Any] = {"stage_ms": [r["stage_ms"] for r in per_rank], "schedules": {}}
    for schedule_name, first in per_rank[0]["schedules"].items():
        row = dict(first, step_s=max(r["schedules"][schedule_name]["step_s"] for r in per_rank))
        if "split" in row:
            row["split_by_rank"] = [r["schedules"][schedule_name]["split"] for r in per_rank]
            del row["split"]
        out["schedules"][schedule_name] = row
    return out


def combine_rounds(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One side's worlds of one model over the rounds -> the `run_world` shape with medians.

    step_s: the median round (its engine split is kept with it); step_s_rounds: every round's value;
    stage_ms: the best per stage over the rounds (like `isolated_stage_ms`, load only adds time).
    """
    out: dict[str, Any] = {"stage_ms": [min(values) for values in zip(*(r["stage_ms"] for r in runs))], "schedules": {}}
    for schedule_name in runs[0]["schedules"]:
        rows = [r["schedules"][schedule_name] for r in runs]
        times = [row["step_s"] for row in rows]
        middle = sorted(rows, key=lambda row: row["step_s"])[(len(rows) - 1) // 2]
        out["schedules"][schedule_name] = dict(middle, step_s=statistics.median(times), step_s_rounds=times)
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions (about two minutes)")
    parser.add_argument("--models", default="mlp,resnet50,gpt2",
                        help="comma-separated: mlp, resnet50, gpt2, resnet18 (default mlp,resnet50,gpt2)")
    parser.add_argument("--schedules", default="1f1b,gpipe", help="comma-separated: 1f1b, gpipe")
    parser.add_argument("--batch_size", type=int, default=None, help="override every model's batch size (SHAPES)")
    parser.add_argument("--microbatches", type=int, default=None, help="override every model's microbatches")
    parser.add_argument("--num_stages", type=int, default=None, help="override every model's number of stages")
    parser.add_argument("--calibration", default=None,
                        help="a calibration JSON (runtime.calibrate); default: measure one at the start")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="what predicted and measured stage times are on: cpu = each rank's CPU ms per step "
                             "(holds with more ranks than cores; default), wall = busy ms (needs a core per rank)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 30, quick 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5, quick 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="worlds per side and model, sides alternating; medians are reported (default 3, quick 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds for each world of workers")
    parser.add_argument("--only", choices=("both", "torch", "ours"), default="both", help="run one side only (debugging)")
    parser.add_argument("--bf16", action="store_true",
                        help="mixed precision on both sides: our --bf16, torch's stages under the same autocast")
    parser.add_argument("--out", default=None, help=f"the report (default {RESULTS.name}, {RESULTS_BF16.name} with --bf16)")
    parser.add_argument("--echo", action="store_true", help="print worker output as it arrives")
    parser.add_argument("--_worker", choices=("torch", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--_model", help=argparse.SUPPRESS)
    parser.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args._worker is not None:
        world_size = json.loads(Path(args._spec).read_text())["models"][args._model]["num_stages"]
        return worker(args._worker, args._model, args._rank, world_size, args._port, args._spec, args._result)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    from model_parallel.allocator import keep_freed_memory

    keep_freed_memory()  # the profiles here predict workers that tune the allocator: pay what they pay (no page faults)
    models = [m for m in args.models.split(",") if m]
    schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise SystemExit(f"unknown schedule(s) {unknown}; choose from {sorted(SCHEDULES)}")
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {sorted(SHAPES)}")
    spec: dict[str, Any] = {
        "batch_size": args.batch_size,
        "microbatches": args.microbatches,
        "num_stages": args.num_stages,
        "steps": args.steps or (8 if args.quick else 30),
        "rounds": args.rounds or (2 if args.quick else 3),
        "warmup": args.warmup if args.warmup is not None else (2 if args.quick else 5),
        "lr": 0.01,
        "seed": 0,
        "schedules": schedules,
        "precision": "bf16" if args.bf16 else "fp32",
        "model_order": models,
        "models": {},
        "op_timeout": 120,
        # Medians of 5 (9) replays per node: a few seconds for these models, and a profile noisier than
        # the measurement it predicts would decide the comparison.
        "profile_iterations": 5 if args.quick else 9,
        "isolated_reps": 8 if args.quick else 20,
    }
    for model_name in models:
        _, batch, micro = model_shape(model_name, spec)
        if batch % micro:
            raise SystemExit(f"{model_name}: batch size {batch} must be a multiple of microbatches {micro}")
    started = time.perf_counter()
    from model_parallel.optimizer.fidelity import Calibration
    from model_parallel.cli.calibrate import calibrate

    if args.calibration:
        calibration = Calibration.from_json(json.loads(Path(args.calibration).read_text()), args.calibration)
    else:
        logger.info("calibrating (link, optimizer, runtime overhead per microbatch) ...")
        calibration = calibrate(timeout=args.timeout, clock=args.clock)
    spec["clock"] = calibration.clock  # a given calibration file decides the clock
    with tempfile.TemporaryDirectory(prefix="bench_runtime_") as tmp:
        workdir = Path(tmp)
        for model_name in models:
            prepare(model_name, spec, workdir, calibration)
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        sides = ["torch", "ours"] if args.only == "both" else [args.only]
        worlds: dict[tuple[str, str], list[dict[str, Any]]] = {}
        # Alternate the sides model by model and flip their order every round, so a change in
        # machine load hits both alike.
        for round_index in range(spec["rounds"]):
            for model_name in models:
                for side in (sides if round_index % 2 == 0 else sides[::-1]):
                    logger.info("%s: %s, schedules %s (round %d/%d) ...", model_name,
                                "torch.distributed.pipelining" if side == "torch" else "ours", schedules,
                                round_index + 1, spec["rounds"])
                    load = os.getloadavg()[0]
                    world = run_world(side, model_name, spec_path, workdir, args.timeout, args.echo)
                    world["load"] = [load, os.getloadavg()[0]]  # 1-min load average before and after
                    worlds.setdefault((side, model_name), []).append(world)
        measured = {key: combine_rounds(runs) for key, runs in worlds.items()}
    rows = []
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}

    for model_name in models:
        entry = spec["models"][model_name]
        m, p = entry["microbatches"], entry["num_stages"]

        def ideal_s(world: dict[str, Any]) -> Optional[float]:
            return (m + p - 1) * max(world["stage_ms"]) / 1000.0 if world else None

        ours_world, torch_world = measured.get(("ours", model_name), {}), measured.get(("torch", model_name), {})
        loads = [x for key in (("ours", model_name), ("torch", model_name)) for run in worlds.get(key, []) for x in run["load"]]
        for schedule in schedules:
            ours_result = ours_world.get("schedules", {}).get(schedule, {})
            ours, theirs = ours_result.get("step_s"), torch_world.get("schedules", {}).get(schedule, {}).get("step_s")
            split = ours_result.get("split_by_rank")
            rows.append({
                "model": model_name,
                "schedule": schedule,
                "precision": spec["precision"],
                "num_stages": p,
                "batch_size": entry["batch_size"],
                "microbatches": m,
                "ours_steps_per_s": 1.0 / ours if ours else None,
                "torch_steps_per_s": 1.0 / theirs if theirs else None,
                "ratio": theirs / ours if ours and theirs else None,
                "efficiency": ideal_s(ours_world) / ours if ours else None,
                "torch_efficiency": ideal_s(torch_world) / theirs if theirs else None,
                "ours_step_ms": ours * 1000.0 if ours else None,
                "torch_step_ms": theirs * 1000.0 if theirs else None,
                "ours_step_ms_rounds": [t * 1000.0 for t in ours_result.get("step_s_rounds", [])],
                "torch_step_ms_rounds": [t * 1000.0 for t in torch_world.get("schedules", {}).get(schedule, {})
                                         .get("step_s_rounds", [])],
                "ours_stage_ms": ours_world.get("stage_ms"),
                "torch_stage_ms": torch_world.get("stage_ms"),
                "predicted_stage_ms": entry["predicted_stage_ms"],
                "measured_stage_ms": [r["measured_ms"] for r in split] if split else None,
                "stage_clock": spec["clock"],
                "stage_error_pct": [100.0 * (want - got) / got for want, got in
                                    zip(entry["predicted_stage_ms"], [r["measured_ms"] for r in split])] if split else None,
                "predicted_terms_ms": entry["predicted_terms_ms"],
                "stage_nodes": entry["stage_nodes"],
                "ours_split_ms_by_rank": split,
                "machine": machine | {"load_1min": [min(loads), max(loads)] if loads else None,
                                      "processes": p, "threads_per_rank": 1},
            })
    report = {
        "benchmark": "runtime",
        "settings": {k: spec[k] for k in ("steps", "warmup", "rounds", "lr", "seed", "precision")}
        | {"shapes": {name: list(model_shape(name, spec)) for name in models}, "threads_per_rank": 1, "backend": "gloo",
           "quick": args.quick},
        "machine": machine | {"uptime": _uptime()},
        "calibration": calibration.to_json(),
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    from model_parallel.fileio import atomic_write_json

    out = args.out or str(RESULTS_BF16 if args.bf16 else RESULTS)
    atomic_write_json(out, report)
    print(format_rows(rows))
    print(f"wrote {out} in {report['seconds']:.0f} s (goal: ratio >= 1.1)")
    return 0


def _uptime() -> str:
    """`uptime`'s line (load averages): how busy the machine was; the rows carry the load per model."""
    load = os.getloadavg()
    return f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} on {os.cpu_count()} cpus"


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """The ratio table, then per row the stages' predicted vs measured ms (`stage_table`)."""
    def num(value: Optional[float], fmt: str) -> str:
        return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0]))

    lines = [f"{'model':<9} {'sched':<6} {'prec':<4} {'p':>2} {'ours st/s':>10} {'torch st/s':>11} {'ratio':>6} {'eff ours':>9} "
             f"{'eff torch':>10}  load"]
    for r in rows:
        load = r["machine"]["load_1min"]
        lines.append(
            f"{r['model']:<9} {r['schedule']:<6} {r.get('precision', 'fp32'):<4} {r['num_stages']:>2} {num(r['ours_steps_per_s'], '10.2f')} "
            f"{num(r['torch_steps_per_s'], '11.2f')} {num(r['ratio'], '6.2f')} {num(r['efficiency'], '9.2f')} "
            f"{num(r['torch_efficiency'], '10.2f')}  {load[0]:.1f}-{load[1]:.1f}" if load else "")
    for r in rows:
        if r["measured_stage_ms"] is None:
            continue
        what = "CPU ms" if r.get("stage_clock") == "cpu" else "busy ms"
        lines += ["", f"{r['model']} {r['schedule']} {r.get('precision', 'fp32')}: {what} per step by stage, predicted vs measured (ours); "
                      "predicted terms | measured wall fwd/bwd/opt/send/recv",
                  *stage_table(r)]
    return "\n".join(lines)


def stage_table(row: dict[str, Any]) -> list[str]:
    """`format_fidelity`'s predicted / measured / error lines, each stage followed by its predicted
    terms (fidelity.StagePrediction) and the engine's measured wall-clock breakdown of that rank."""
    from model_parallel.optimizer.fidelity import format_fidelity

    table = format_fidelity(row["predicted_stage_ms"], row["measured_stage_ms"]).splitlines()
    short = {"compute_ms": "comp", "loss_ms": "loss", "accumulate_ms": "acc", "optimizer_ms": "opt",
             "allreduce_ms": "ar", "send_ms": "send", "recv_ms": "recv", "overhead_ms": "ovh", "timeshare_ms": "tsh"}
    lines = [table[0]]
    for stage, line in enumerate(table[1:]):
        terms = row["predicted_terms_ms"][stage]
        split = row["ours_split_ms_by_rank"][stage]
        b = split.get("breakdown_ms", {})
        measured = "/".join(f"{b.get(k, 0.0):.1f}" for k in ("forward_ms", "backward_ms", "optimizer_ms", "send_ms", "recv_ms"))
        lines.append(f"{line}   " + " ".join(f"{short[k]} {v:.1f}" for k, v in terms.items() if v)
                     + f" | {measured} (busy {split['busy_ms']:.1f}, step {split['step_ms']:.1f})")
    return lines


if __name__ == "__main__":
    sys.exit(main())
