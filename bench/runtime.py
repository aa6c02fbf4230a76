"""Runtime benchmark: our pipeline runtime vs torch.distributed.pipelining, same model, split, schedule, machine.

    python bench/runtime.py            # full run (3 rounds of 30 steps a side; about 8 minutes on 2 cores)
    python bench/runtime.py --quick    # about 3 minutes (1 round of 4 chunks of 4 steps a side), `make bench`
    python bench/runtime.py --models mlp --schedules 1f1b --steps 10
    python bench/runtime.py --bf16     # mixed precision on both sides (writes runtime_bf16.json)

Rows (model x schedule; `SHAPES`): torchvision resnet50 at 32x32 on 4 stages (batch 32, 4
microbatches), Hugging Face GPT-2 from a config (`GPT2LMHeadModel`, random init: 4 blocks, width 128,
64 tokens, vocabulary 512; traced by torch.export, cut between blocks; untied head, because torch's
pipelining has no tie across stages) on 4 stages (batch 32, 4 microbatches), the StackedMLP 256 -> 8 x 1024 -> 10 on 2 stages (batch 64, 4 microbatches);
1F1B and GPipe. The main process first calibrates the machine (`cli.calibrate`: link, optimizer
step per MB, the runtime's fixed cost per microbatch), then profiles each model at microbatch size
(its loss too), cuts it into stages of about equal measured compute (`runtime.build.stages.even_plan`)
and writes the graph and plan; both runtimes build their stage modules from that same graph and
plan (`codegen.build_stages`), so only the runtime differs. Every worker is its own process with
one thread (`torch.set_num_threads(1)`, OMP_NUM_THREADS=1), gloo on localhost; every world runs
under a deadline and is always reaped (`runtime.launch`).

Both runtimes run in the SAME world: each rank builds torch's stage and schedule and our engine, and
the two alternate chunks of `--chunk_steps` steps (the order flipping every chunk), each chunk timed
between barriers. This machine's speed moves by 1.36-1.59x between 5-second windows (docs/runtime.md),
so worlds run one after the other compared the load of two moments, not the runtimes; chunks timed
back to back see the same machine. `ratio` is the median over those chunk pairs, `--rounds` worlds
per model (each number the median over every chunk of every round).

- torch: `PipelineStage` (manual stage construction) + `Schedule1F1B` / `ScheduleGPipe`.
- ours: the worker API, `runtime.engine.PipelineEngine` (what test_parallel_0.py runs) with the
  same graph, plan, schedule, batch size, microbatches and data; its own per-step metrics
  (compute / comm / idle split per rank, `runtime.observe.metrics`) are stored in the row as well.
- both: SGD with momentum 0.9; steps/s = timed steps / wall time between two barriers, after
  warm-up steps (slowest rank), median over the chunks (every round's median is in the row too).
- ratio = ours / torch steps per second, the median over chunk pairs (goal >= 1.10); `chunk_ratios`.
- extra_ms = ours - torch ms per step, the median over the same chunk pairs (`chunk_extra_ms`). On the
  `tiny` row (a 16 -> 2 x 32 -> 10 MLP on 2 stages, batch 8, 4 microbatches: microseconds of compute)
  a step is little but the runtime's own fixed cost: issue #37 asks for extra_ms <= 0.5.
- CPU ms per step of each rank's process for both sides (`ours_cpu_ms_by_rank`, `torch_cpu_ms_by_rank`)
  and its split by thread (`*_threads_cpu_ms_by_rank`: "main", the training thread; "gloo", gloo's
  receive threads; "other"): whether one runtime does more work than the other.
- efficiency = ideal / measured step time, ideal = (m + p - 1) * max stage time, where a stage's
  time is its per-microbatch forward + backward measured in isolation (no communication, best of
  several repetitions) by its own rank at the start of each world (best over the rounds).
  `efficiency_on_cores`: the ideal is also no shorter than the stages' work spread over the cores
  (m * sum of stage times / min(p, cores)): with 4 ranks on 2 cores, what the machine allows.
- predicted_stage_ms / measured_stage_ms (ours, per stage, ms per step, on `stage_clock`): what a
  stage rank does in one step of m microbatches. On the CPU clock (default, `--clock`): the rank
  process's CPU time per step (`StepRecord.cpu_ms`, median over the timed steps), which neither
  waiting on a peer nor being descheduled (4 ranks on 2 cores, other processes) inflates; on the
  wall clock `runtime.observe.metrics.busy_ms`. Predicted: `optimizer.fidelity.predict_stage_ms` from a
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
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from model_parallel.optimizer.fidelity import share_errors
from runtime_worlds import SCHEDULES, recipes, worker  # bench/ is this script's directory: first on sys.path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "runtime.json"
RESULTS_BF16 = REPO / "bench" / "results" / "runtime_bf16.json"
# model -> (stages, batch size, microbatches): the issue's rows (resnet50 and the GPT at 4 stages, the MLP at 2).
SHAPES = {"mlp": (2, 64, 4), "resnet50": (4, 32, 4), "gpt2": (4, 32, 4), "resnet18": (2, 64, 4), "tiny": (2, 8, 4)}

logger = logging.getLogger("bench.runtime")


def prepare(model_name: str, spec: dict[str, Any], workdir: Path, calibration: Any) -> dict[str, Any]:
    """Profile at microbatch size, split into the model's stages of about equal compute, save graph +
    plan, and predict each stage's busy time per step (`optimizer.fidelity.predict_stage_ms`)."""
    from model_parallel.graph.io import save_graph
    from model_parallel.graph.plan import write_plan
    from model_parallel.profiler.api import profile
    from model_parallel.runtime.build.stages import even_plan

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
    # Every rank times between the same barriers: per chunk, the slowest rank (they differ by microseconds).
    out: dict[str, Any] = {"stage_ms": [r["stage_ms"] for r in per_rank], "schedules": {}}
    for schedule_name, sides in per_rank[0]["schedules"].items():
        for name, first in sides.items():
            ranks = [r["schedules"][schedule_name][name] for r in per_rank]
            row = {key: value for key, value in first.items() if key not in ("split", "threads_cpu_ms", "cpu_ms")}
            row["chunk_step_s"] = [max(chunk) for chunk in zip(*(r["chunk_step_s"] for r in ranks))]
            row["cpu_ms_by_rank"] = [r["cpu_ms"] for r in ranks]
            row["threads_cpu_ms_by_rank"] = [r["threads_cpu_ms"] for r in ranks]
            if "split" in first:
                row["split_by_rank"] = [r["split"] for r in ranks]
            out["schedules"].setdefault(schedule_name, {})[name] = row
    return out


def ideal_step_s(stage_ms: Sequence[float], microbatches: int, cores: Optional[int] = None) -> float:
    """The shortest step a flush schedule allows, in seconds, from each stage's isolated forward + backward
    ms per microbatch: (m + p - 1) x the slowest stage; with `cores`, also no shorter than every stage's
    m microbatches spread over min(p, cores) cores (4 ranks on 2 cores cannot all compute at once)."""
    p = len(stage_ms)
    pipeline = (microbatches + p - 1) * max(stage_ms)
    if cores is None:
        return pipeline / 1000.0
    return max(pipeline, microbatches * sum(stage_ms) / min(p, cores)) / 1000.0


def combine_rounds(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The worlds of one model over the rounds -> per schedule and side: `step_s` the median chunk over
    every round, `ratio` (torch step time / ours) the median over chunks timed back to back in one world,
    the engine split of the median round, and `stage_ms` the best per stage over the rounds (like
    `isolated_stage_ms`: load only adds time)."""
    out: dict[str, Any] = {"stage_ms": [min(values) for values in zip(*(r["stage_ms"] for r in runs))], "schedules": {}}
    for schedule_name in runs[0]["schedules"]:
        combined: dict[str, Any] = {}
        for name in runs[0]["schedules"][schedule_name]:
            rows = [r["schedules"][schedule_name][name] for r in runs]
            middle = sorted(rows, key=lambda row: statistics.median(row["chunk_step_s"]))[(len(rows) - 1) // 2]
            chunks = [t for row in rows for t in row["chunk_step_s"]]
            combined[name] = dict(middle, step_s=statistics.median(chunks), step_s_rounds=[
                statistics.median(row["chunk_step_s"]) for row in rows])
        if "torch" in combined and "ours" in combined:
            pairs = [t / o for run in runs for t, o in zip(run["schedules"][schedule_name]["torch"]["chunk_step_s"],
                                                           run["schedules"][schedule_name]["ours"]["chunk_step_s"])]
            combined["ratio"], combined["chunk_ratios"] = statistics.median(pairs), pairs
            # What ours adds per step (ms), pair by pair: with tiny stages, the runtime's fixed cost per step.
            extra = [1e3 * (o - t) for run in runs for t, o in zip(run["schedules"][schedule_name]["torch"]["chunk_step_s"],
                                                                    run["schedules"][schedule_name]["ours"]["chunk_step_s"])]
            combined["extra_ms"], combined["chunk_extra_ms"] = statistics.median(extra), extra
        out["schedules"][schedule_name] = combined
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions (about two minutes)")
    parser.add_argument("--models", default="mlp,resnet50,gpt2",
                        help="comma-separated: mlp, resnet50, gpt2, resnet18, tiny (default mlp,resnet50,gpt2)")
    parser.add_argument("--schedules", default="1f1b,gpipe", help="comma-separated: 1f1b, gpipe")
    parser.add_argument("--batch_size", type=int, default=None, help="override every model's batch size (SHAPES)")
    parser.add_argument("--microbatches", type=int, default=None, help="override every model's microbatches")
    parser.add_argument("--num_stages", type=int, default=None, help="override every model's number of stages")
    parser.add_argument("--calibration", default=None,
                        help="a calibration JSON (runtime.calibrate); default: measure one at the start")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="what predicted and measured stage times are on: cpu = each rank's CPU ms per step "
                             "(holds with more ranks than cores; default), wall = busy ms (needs a core per rank)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per side, schedule and round (default 30, quick 16)")
    parser.add_argument("--chunk_steps", type=int, default=None,
                        help="steps per chunk: the two runtimes alternate chunks in one world (default 5, quick 4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5, quick 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="worlds per model, each running both sides; medians are reported (default 3, quick 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds for each world of workers")
    parser.add_argument("--only", choices=("both", "torch", "ours"), default="both", help="run one side only (debugging)")
    parser.add_argument("--bf16", action="store_true",
                        help="mixed precision on both sides: our --bf16, torch's stages under the same autocast")
    parser.add_argument("--out", default=None, help=f"the report (default {RESULTS.name}, {RESULTS_BF16.name} with --bf16)")
    parser.add_argument("--echo", action="store_true", help="print worker output as it arrives")
    parser.add_argument("--_worker", choices=("torch", "ours", "both"), help=argparse.SUPPRESS)
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
        "chunk_steps": args.chunk_steps or (4 if args.quick else 5),
        "rounds": args.rounds or (1 if args.quick else 3),
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
    steps = args.steps or (16 if args.quick else 30)
    spec["chunks"] = max(2, -(-steps // spec["chunk_steps"]))  # at least one chunk in each order
    spec["steps"] = spec["chunks"] * spec["chunk_steps"]
    for model_name in models:
        _, batch, micro = model_shape(model_name, spec)
        if batch % micro:
            raise SystemExit(f"{model_name}: batch size {batch} must be a multiple of microbatches {micro}")
    started = time.perf_counter()
    from model_parallel.cli.calibrate import calibrate
    from model_parallel.optimizer.fidelity import Calibration

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
        worlds: dict[str, list[dict[str, Any]]] = {}
        # Both runtimes run in the same world (the same processes, cores and time window), alternating
        # chunks of steps whose order flips every chunk, so a change in machine load hits both alike.
        for round_index in range(spec["rounds"]):
            for model_name in models:
                logger.info("%s: %s, schedules %s (round %d/%d) ...", model_name, {
                    "both": "torch.distributed.pipelining and ours, alternating", "torch": "torch.distributed.pipelining",
                    "ours": "ours"}[args.only], schedules, round_index + 1, spec["rounds"])
                load = os.getloadavg()[0]
                world = run_world(args.only, model_name, spec_path, workdir, args.timeout, args.echo)
                world["load"] = [load, os.getloadavg()[0]]  # 1-min load average before and after
                worlds.setdefault(model_name, []).append(world)
        measured = {key: combine_rounds(runs) for key, runs in worlds.items()}
    rows = []
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}

    for model_name in models:
        entry = spec["models"][model_name]
        m, p = entry["microbatches"], entry["num_stages"]

        def ideal_s(world: dict[str, Any]) -> Optional[float]:
            return ideal_step_s(world["stage_ms"], m) if world else None

        def ideal_on_cores_s(world: dict[str, Any]) -> Optional[float]:
            return ideal_step_s(world["stage_ms"], m, cores=os.cpu_count() or 1) if world else None

        world = measured.get(model_name, {})
        loads = [x for run in worlds.get(model_name, []) for x in run["load"]]
        for schedule in schedules:
            sides = world.get("schedules", {}).get(schedule, {})
            ours_result, torch_result = sides.get("ours", {}), sides.get("torch", {})
            ours, theirs = ours_result.get("step_s"), torch_result.get("step_s")
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
                # The median over chunks timed back to back in one world (not the ratio of the two medians).
                "ratio": sides.get("ratio"),
                "chunk_ratios": sides.get("chunk_ratios"),
                # ours - torch ms per step, the median over the same chunk pairs (the `tiny` row: the fixed cost).
                "extra_ms": sides.get("extra_ms"),
                "chunk_extra_ms": sides.get("chunk_extra_ms"),
                "efficiency": ideal_s(world) / ours if ours else None,
                "torch_efficiency": ideal_s(world) / theirs if theirs else None,
                # Against what this machine's cores allow: every stage's work must also fit on `cores`.
                "efficiency_on_cores": ideal_on_cores_s(world) / ours if ours else None,
                "torch_efficiency_on_cores": ideal_on_cores_s(world) / theirs if theirs else None,
                "ours_step_ms": ours * 1000.0 if ours else None,
                "torch_step_ms": theirs * 1000.0 if theirs else None,
                "ours_step_ms_rounds": [t * 1000.0 for t in ours_result.get("step_s_rounds", [])],
                "torch_step_ms_rounds": [t * 1000.0 for t in torch_result.get("step_s_rounds", [])],
                # CPU ms per step of each rank's process, and its split by thread (main / gloo / other).
                "ours_cpu_ms_by_rank": ours_result.get("cpu_ms_by_rank"),
                "torch_cpu_ms_by_rank": torch_result.get("cpu_ms_by_rank"),
                "ours_threads_cpu_ms_by_rank": ours_result.get("threads_cpu_ms_by_rank"),
                "torch_threads_cpu_ms_by_rank": torch_result.get("threads_cpu_ms_by_rank"),
                "stage_ms": world.get("stage_ms"),
                "predicted_stage_ms": entry["predicted_stage_ms"],
                "measured_stage_ms": [r["measured_ms"] for r in split] if split else None,
                "stage_clock": spec["clock"],
                "stage_error_pct": [100.0 * (want - got) / got for want, got in
                                    zip(entry["predicted_stage_ms"], [r["measured_ms"] for r in split])] if split else None,
                # The error of each stage's share of the step's work: what a partition balances, and
                # what a machine uniformly slower or faster than at the profile does not move.
                "stage_share_error_pct": share_errors(entry["predicted_stage_ms"], [r["measured_ms"] for r in split])
                if split else None,
                "predicted_terms_ms": entry["predicted_terms_ms"],
                "stage_nodes": entry["stage_nodes"],
                "ours_split_ms_by_rank": split,
                "machine": machine | {"load_1min": [min(loads), max(loads)] if loads else None,
                                      "processes": p, "threads_per_rank": 1},
            })
    report = {
        "benchmark": "runtime",
        "settings": {k: spec[k] for k in ("steps", "chunks", "chunk_steps", "warmup", "rounds", "lr", "seed", "precision")}
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

    lines = [f"{'model':<9} {'sched':<6} {'prec':<4} {'p':>2} {'ours st/s':>10} {'torch st/s':>11} {'ratio':>6} {'+ms':>6} {'eff ours':>9} "
             f"{'eff torch':>10} {'on cores':>9} {'torch':>6}  load"]
    for r in rows:
        load = r["machine"]["load_1min"]
        lines.append(
            f"{r['model']:<9} {r['schedule']:<6} {r.get('precision', 'fp32'):<4} {r['num_stages']:>2} {num(r['ours_steps_per_s'], '10.2f')} "
            f"{num(r['torch_steps_per_s'], '11.2f')} {num(r['ratio'], '6.2f')} {num(r.get('extra_ms'), '6.2f')} "
            f"{num(r['efficiency'], '9.2f')} "
            f"{num(r['torch_efficiency'], '10.2f')} {num(r.get('efficiency_on_cores'), '9.2f')} "
            f"{num(r.get('torch_efficiency_on_cores'), '6.2f')}  " + (f"{load[0]:.1f}-{load[1]:.1f}" if load else ""))
    lines.append("+ms: ours - torch ms per step (median over chunk pairs); eff: ideal (m + p - 1) x slowest isolated stage / step; on cores: the ideal also no shorter than every "
                 "stage's work spread over the cores (ours, then torch)")
    lines += ["", "CPU ms per step by rank, main thread + gloo threads (ours | torch):"]
    for r in rows:
        def threads(key: str) -> str:
            return " ".join(f"{t['main']:.0f}+{t['gloo']:.0f}" for t in r.get(key) or [])
        lines.append(f"{r['model']:<9} {r['schedule']:<6} {threads('ours_threads_cpu_ms_by_rank')} | "
                     f"{threads('torch_threads_cpu_ms_by_rank')}   chunk ratios "
                     + " ".join(f"{x:.2f}" for x in r.get("chunk_ratios") or []))
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
             "allreduce_ms": "ar", "send_ms": "send", "recv_ms": "recv", "overhead_ms": "ovh", "corun_ms": "cor", "timeshare_ms": "tsh"}
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
