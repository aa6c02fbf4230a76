"""Schedules on emulated devices: every schedule of ours and of torch.distributed.pipelining, bubbles and stragglers.

    python bench/schedules.py                  # p = 4 and 8, m = p and 2p, and the straggler row
    python bench/schedules.py --quick          # p = 4 only, few steps (a couple of minutes; bench/gpu_check.sh)
    python bench/schedules.py --p 4 --m 8 --no_straggler
    python bench/schedules.py --straggler_only --straggler_schedule zbinterleaved   # the live loop rebalancer

Why emulated: on this machine (2 cores, 8 engineers) a rank that waits frees a core for another, so
bubbles are filled by other ranks' work and a 2x straggler costs little: ratios on real CPU compute
cannot show what a schedule or a rebalance is worth on dedicated devices. Here every layer's
compute is a calibrated sleep (bench/emulated.py: forward, input gradient and weight gradient each
of a set duration, through autograd, on separate autograd nodes so torch's zero-bubble stages really
split them), so p ranks on 2 cores behave like p devices, with real messages and each runtime's real
overhead. The model: `--layers_per_rank` x p EmulatedLayers (width 16), traced by our profiler (fx,
the layer a leaf) and cut into p stages of equal layer count for ours and single-stage torch
schedules, 2p for torch's multi-stage ones (looped or V placement).

Durations (the methodology since 2026-11-29; both runtimes always get the same worlds): every layer waits
`--forward_ms`, `--input_ms` and `--weight_ms` = 8 ms per microbatch (4 layers per rank: a stage's forward is
32 ms, 16 ms with 2 stages per rank). A message between two ranks here costs 0.2-2 ms whatever the compute
(bench/message_latency.py, 2026-11-29 06:48-06:51 UTC, load 0.2-1.6: one token round a ring of sleeping ranks
0.2-0.6 ms torch, 0.4-0.9 ms ours; every rank sending at once, as in a pipeline's steady state, 0.4-2.0 ms
for both, more at p = 8), so message / stage action is 1-12 % at 8 ms a layer against 3-50 % at the 2 ms used
before (4-8 ms actions): on dedicated accelerators an action is 10-100 ms and an activation transfer well under
1 ms (~1-5 %). At 2 ms the emulation overstated communication 5-10x: both runtimes' bubbles sat 5-16 points
above the simulated ones and our per-action Python (~0.25 ms) decided the close rows. Steps are 4x longer, so
a side runs 2 + 4 x 3 steps (was 3 + 6 x 4): a full run ~25 min. The old setting: `--forward_ms 2 --input_ms 2
--weight_ms 2 --warmup 3 --chunks 6 --chunk_steps 4` (the report header prints what a run used).

One world per (p, m): each rank builds every side — torch's GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV and our `SCHEDULE_NAMES` — and they train chunks of
`--chunk_steps` steps in turn, the order flipping every chunk, each timed between barriers
(runtime_worlds.SideRunner). A side torch refuses for this (p, m) is left out with the reason.

Rows (one per side): steps/s (median chunk); `ratio` = this side's steps/s over torch Schedule1F1B's,
the median over chunks of the same round (back to back: the same machine load); `bubble_by_rank` =
1 - emulated busy ms / step wall ms per rank (medians over chunks), `bubble` their mean, and
`analytic_bubble` (emulated.analytic_bubble; None where no formula is given), `simulated_bubble` (the same
order simulated at this m without latency, stage 0 as both runtimes run it — the model's input needs no gradient,
so its first layer waits no I —, per rank too: the formulas assume many microbatches and equal work), `periodic_bubble`
(the table's "steady": the same orders over steps run back to back, as both runtimes run them: no barrier between
steps, so a V's overlap and its period is shorter than one step; emulated.periodic); `cpu_ms_by_rank`: each
rank's CPU ms per step (the waits sleep, so this is the runtime's own cost), `main_cpu_ms_by_rank` its training
thread's (the table's "main %": its share of the step; on a rank's critical path it adds to the bubble over the
simulation, as each hand-off's latency does). Per world a summary:
our best schedule over torch's 1F1B (goal >= 1.15) and over torch's best (goal >= 1.0).

The straggler world (p = 4, m = 2p, `--straggler_layers_per_rank` 6, rank 1's waits x `--slowdown` from
step 0 on both sides): torch keeps its static equal split; ours runs `--straggler_schedule` (zbinterleaved, the
one schedule whose simulation reaches 0.95 of the ceiling at m = 8; or 1f1b, or interleaved; the loop ones on 2p stages in a loop, against torch's multi-stage schedules too, and torch's
Interleaved1F1B and InterleavedZeroBubble on our rebalanced loop plan, to tell its runtime from the plan) on that
static plan, on the plan the rebalancer's solver (`coordinator.solver.default_solver`; a loop plan under
interleaved) gives for the slow rank's speed, and live: a coordinator (auto policy) in this process, the
side's workers reporting to it (and naming their schedule), which must detect the straggler and switch plans
while training (`--settle_steps` untimed steps first; its switch steps are in the row). ratio_vs_ceiling =
ratio over torch's static 1F1B / (s x (p - 1 + 1/s) / p), goal >= 0.95 (1.66x at p = 4, s = 2);
plan_ceiling_ratio: what whole layers allow; solver_plan_sim_ratio: our schedule on the solver's plan, simulated.

Writes bench/results/schedules.json (atomically; `--out`; the docs quote bench/snapshot/schedules.json)
and prints the table with the machine load.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from emulated import EmulatedLayer  # bench/ is first on sys.path
from schedules_report import format_rows, side_rows, straggler_summary, summary
from schedules_worlds import TORCH_SCHEDULES, build_model, layer_counts, worker

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "schedules.json"  # bench/snapshot/ holds the copy the docs quote
logger = logging.getLogger("bench.schedules")
DEVICE_MS = 8.0  # per layer and part: message / stage action in the accelerator range (the docstring's numbers)
# bench/message_latency.py on this machine (2026-11-29, load 0.2-1.6), ms per message, both runtimes' transports
MEASURED_LATENCY_MS = (0.2, 2.0)


def methodology(args: argparse.Namespace) -> str:
    """The report header: the emulated durations, the message / compute ratio they give, and that both sides share them."""
    action = args.layers_per_rank * args.forward_ms  # one stage's forward (1 stage per rank); half with 2
    low, high = MEASURED_LATENCY_MS
    return (f"emulated devices: every layer waits F {args.forward_ms:g} / I {args.input_ms:g} / W {args.weight_ms:g} ms per "
            f"microbatch, {args.layers_per_rank} layers per rank: a stage forward {action:g} ms ({action / 2:g} ms with 2 "
            f"stages per rank; the straggler world {args.straggler_layers_per_rank} layers per rank); a message here {low:g}-{high:g} ms (bench/message_latency.py): message / action "
            f"{100 * low / action:.0f}-{100 * high / (action / 2):.0f} % (accelerators ~1-5 %). Both runtimes run the "
            f"same worlds, alternating chunks ({args.warmup} + {args.chunks} x {args.chunk_steps} steps per side).")


def equal_plan(graph: Any, num_stages: int) -> Any:
    """`num_stages` stages of equal layer count (the input with stage 0), stage k on rank k."""
    from model_parallel.graph.plan import Plan, StagePlan

    layers = [n.node_id for n in graph.nodes if n.layer is not None and n.layer.op == "call_module"]
    if len(layers) % num_stages:
        raise SystemExit(f"bench/schedules.py: {len(layers)} layers do not split into {num_stages} equal stages")
    per = len(layers) // num_stages
    members = [[layers[i] for i in range(k * per, (k + 1) * per)] for k in range(num_stages)]
    members[0] = [n.node_id for n in graph.nodes if n.node_id not in layers] + members[0]
    return Plan(stages=tuple(StagePlan(k, tuple(ids), ranks=(k,)) for k, ids in enumerate(members)))


def timed_graph(graph: Any, args: argparse.Namespace) -> Any:
    """The traced graph with its profile: every layer f ms forward, i + w ms backward (what the waits are), except the
    first, whose input (the model's) needs no gradient: its backward waits w only. Timed as i + w, rank 0 read ~6 %
    faster than the others to the live policy (17 of 18 waits at 6 layers), which, with a window's noise on another
    rank, gave rank 0 a layer too many (2026-11-29 07:31, the solved-for speeds logged: 1.00 / 0.47 / 0.93 / 0.85)."""
    layers = [n.node_id for n in graph.nodes if n.layer is not None and n.layer.op == "call_module"]
    return graph.replace_nodes([dataclasses.replace(
        n, forward_ms=args.forward_ms, backward_ms=args.weight_ms + (args.input_ms if n.node_id != layers[0] else 0.0))
        if n.node_id in layers else n for n in graph.nodes])


def rebalanced_plan(graph: Any, args: argparse.Namespace, p: int, v: int = 1) -> Any:
    """The rebalancer's solver on the timed graph with rank `--slow_rank` at speed 1/s: the plan our
    live rebalancer should move to (v = 2: a loop plan, stage k on rank k % p, as the policy re-plans interleaved),
    carrying the per-stage times the coordinator attaches to a plan it issues (`stage_times`: the profile's ms at
    those speeds), from which the workers list-build zero bubble's order (runtime/step/list_order.py)."""
    from model_parallel.coordinator.rechoose import measured_times
    from model_parallel.coordinator.solver import default_solver

    ranks = [k % p for k in range(v * p)]
    speeds = [1.0 / args.slowdown if r == args.slow_rank else 1.0 for r in ranks]  # one per stage: its rank's
    plan = default_solver(graph, ranks, speeds).with_default_ranks()
    # Calibration 1 over 1 microbatch: the profile's ms (per microbatch) as they are, the slow rank's over its speed
    times = measured_times(graph, plan, {args.slow_rank: 1.0 / args.slowdown}, 1.0, 1)
    return dataclasses.replace(plan, extra={**dict(plan.extra),
                                            "stage_times": [[t.forward_ms, t.input_ms, t.weight_ms] for t in times]})


def rank_layers(graph: Any, plan: Any, p: int) -> list[int]:
    """Emulated layers per rank of `plan` (a rank's stages summed; each stage on one rank)."""
    out = [0] * p
    for stage, count in zip(plan.stages, layer_counts(graph, plan)):
        out[stage.ranks[0]] += count
    return out


def loop_plan(plan: Any, p: int) -> Any:
    """`plan`'s stages with stage k on rank k % p (loop placement: ours interleaved and zbinterleaved)."""
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, ranks=(st.stage_id % p,)) for st in plan.stages))


def prepare(args: argparse.Namespace, p: int, m: int, workdir: Path, straggler: bool) -> dict[str, Any]:
    """Trace the emulated model, write its graph and plans, and the world's spec (which sides run)."""
    from model_parallel.graph.in_flight import LOOP_SCHEDULES, SCHEDULE_NAMES, V_SCHEDULES, ZERO_BUBBLE_SCHEDULES
    from model_parallel.graph.io import save_graph
    from model_parallel.graph.plan import write_plan
    from model_parallel.profiler.trace import trace_model

    spec: dict[str, Any] = {
        "p": p, "m": m, "num_layers": (args.straggler_layers_per_rank if straggler else args.layers_per_rank) * p,
        "batch_size": m * args.micro_batch, "seed": 0,
        "lr": 0.01, "op_timeout": 120, "warmup": args.warmup, "chunks": args.chunks, "chunk_steps": args.chunk_steps,
        "emulation": {"width": 16, "forward_ms": args.forward_ms, "input_ms": args.input_ms, "weight_ms": args.weight_ms},
    }
    model = build_model(spec)
    graph = timed_graph(trace_model(model, (torch.zeros(args.micro_batch, 16),), (EmulatedLayer,), route="fx")[0], args)
    name = f"p{p}_m{m}{'_straggler' if straggler else ''}"
    spec["graph"] = str(save_graph(graph, workdir / f"{name}.graph.json"))
    spec["plans"] = {}
    plans = {str(p): equal_plan(graph, p)}
    torch_names = [s for s in args.torch_schedules.split(",") if s]
    if straggler:
        ours = args.straggler_schedule
        multi = ours in LOOP_SCHEDULES  # interleaved, zbinterleaved: 2p stages in a loop, re-planned as a loop
        plans["rebalanced"] = rebalanced_plan(graph, args, p, 2 if multi else 1)
        spec |= {"slow_rank": args.slow_rank, "slowdown": args.slowdown, "straggler_schedule": ours}
        spec["rebalanced_layers"] = layer_counts(graph, plans["rebalanced"])
        spec["rebalanced_rank_layers"] = rank_layers(graph, plans["rebalanced"], p)
        static = str(p)
        if multi:  # torch's multi-stage schedules run too (their static 2p stages): ours is held to torch's best
            plans[str(2 * p)] = equal_plan(graph, 2 * p)
            static = f"{2 * p}loop"
            plans[static] = loop_plan(plans[str(2 * p)], p)
        spec["static_plan"] = static
        spec["sides"] = [{"key": f"torch {s}", "runtime": "torch", "schedule": s} for s in ["Schedule1F1B"] + [
            s for s in torch_names if multi and TORCH_SCHEDULES[s][0] > 1]] + [
            # torch's runtime on our rebalanced loop plan (not a plan torch makes: what its runtime costs on it)
            {"key": f"torch {s} on our rebalanced plan", "runtime": "torch", "schedule": s, "plan": "rebalanced"}
            for s in torch_names if multi and TORCH_SCHEDULES[s] == (2, "loop") and s != "ScheduleLoopedBFS"] + [
            {"key": f"ours {ours} static", "runtime": "ours", "schedule": ours, "plan": static},
            {"key": f"ours {ours} rebalanced", "runtime": "ours", "schedule": ours, "plan": "rebalanced"}] + [
            # The same plan in torch's fixed order (--schedule_order fixed): what the list-built order is worth
            {"key": f"ours {ours} rebalanced, fixed order", "runtime": "ours", "schedule": ours, "plan": "rebalanced",
             "order": "fixed"} for _ in [ours] if ours in ZERO_BUBBLE_SCHEDULES]
    else:
        plans[str(2 * p)] = equal_plan(graph, 2 * p)  # torch's schedules with 2 stages per rank
        # Ours interleaved: the same 2p stages, stage k on rank k % p (loop placement).
        plans[f"{2 * p}loop"] = loop_plan(plans[str(2 * p)], p)
        # Ours zbv: the same 2p stages in a V, stage k on rank k, then 2p-1-k.
        plans[f"{2 * p}v"] = dataclasses.replace(plans[str(2 * p)], stages=tuple(
            dataclasses.replace(st, ranks=(min(st.stage_id, 2 * p - 1 - st.stage_id),)) for st in plans[str(2 * p)].stages))
        spec["sides"] = [{"key": f"torch {s}", "runtime": "torch", "schedule": s} for s in torch_names] + [
            {"key": f"ours {s}", "runtime": "ours", "schedule": s,
             "plan": f"{2 * p}loop" if s in LOOP_SCHEDULES else f"{2 * p}v" if s in V_SCHEDULES else str(p)}
            for s in SCHEDULE_NAMES]
    for key, plan in plans.items():
        spec["plans"][key] = str(workdir / f"{name}.plan{key}.json")
        write_plan(plan, spec["plans"][key])
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    spec["path"] = str(spec_path)
    return spec


def start_coordinator(spec: dict[str, Any], settle_steps: int) -> Any:
    """Our coordinator (auto policy), in this process, on the world's static plan (equal stages; a loop of 2p under
    interleaved), and a live side that reports to it: the straggler is in effect from step 0, so its first plan
    switch is the detection."""
    import secrets

    from model_parallel.coordinator.server import Coordinator
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.loader import register_layer_classes
    from model_parallel.graph.plan import read_plan

    register_layer_classes(EmulatedLayer)  # the graph was traced from this process's model
    token = secrets.token_hex(16)
    static, ours = spec["static_plan"], spec["straggler_schedule"]
    # The workers name their schedule when they register: the coordinator checks (and re-plans) under its rules.
    coordinator = Coordinator(load_graph(spec["graph"]), read_plan(spec["plans"][static]), token.encode(), policy="auto")
    watch_issues(coordinator)
    port = coordinator.start("127.0.0.1", 0)
    spec["sides"].append({"key": f"ours {ours} live", "runtime": "ours", "schedule": ours, "plan": static,
                          "coordinator": f"127.0.0.1:{port}", "token": token, "settle_steps": settle_steps})
    Path(spec["path"]).write_text(json.dumps(spec))
    return coordinator


def watch_issues(coordinator: Any) -> None:
    """Record (and log) the per-rank speeds each plan the coordinator issues was solved for, in
    `coordinator.issued_speeds`: what explains a plan that gives the slow rank a layer too many (its speed
    estimated above 1/s). Wraps the instance's `issue`; the coordinator's modules are not changed."""
    rebalancer, issued = coordinator.rebalancer, []
    inner = rebalancer.issue

    def issue(plan: Any, reason: str, step: int, send: Any, predicted: bool, speeds: Any = None) -> Any:
        if speeds is not None:
            issued.append({"step": step, "speeds": {int(r): round(float(v), 3) for r, v in speeds.items()}})
            logger.info("the coordinator solved its plan after step %d for speeds %s", step,
                        ", ".join(f"rank {r} {v:.3f}" for r, v in sorted(issued[-1]["speeds"].items())))
        return inner(plan, reason, step, send, predicted, speeds)

    rebalancer.issue = issue
    coordinator.issued_speeds = issued


def run_world(spec: dict[str, Any], workdir: Path, timeout: float, echo: bool) -> list[dict[str, Any]]:
    """Start the world (a process per rank, under a deadline, always reaped); every rank's results."""
    from model_parallel.runtime.launch import free_port, launch, print_echo

    port = free_port()
    paths = [workdir / f"{Path(spec['path']).stem}.rank{r}.json" for r in range(spec["p"])]
    commands = [[sys.executable, str(Path(__file__).resolve()), "--_worker", str(r), "--_port", str(port),
                 "--_spec", spec["path"], "--_result", str(paths[r])] for r in range(spec["p"])]
    result = launch(commands, timeout=timeout, echo=print_echo if echo else None)
    if not result.ok:
        raise RuntimeError(f"world p={spec['p']} m={spec['m']} failed:\n{result.summary()}")
    return [json.loads(path.read_text()) for path in paths]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p = 4 only, few steps (a couple of minutes)")
    parser.add_argument("--p", default=None, help="comma-separated rank counts (default 4,8; quick 4)")
    parser.add_argument("--m", default=None, help="comma-separated microbatch counts (default: p and 2p)")
    parser.add_argument("--torch_schedules", default=",".join(TORCH_SCHEDULES), help="torch schedules to run")
    parser.add_argument("--layers_per_rank", type=int, default=4, help="emulated layers per rank (even: 2p stages)")
    parser.add_argument("--straggler_layers_per_rank", type=int, default=6,
                        help="layers per rank in the straggler world (6: whole layers allow 0.98 of the ceiling at p=4, s=2; "
                             "1F1B at m=8 reaches 0.80 of it with any count: straggler_summary)")
    parser.add_argument("--forward_ms", type=float, default=DEVICE_MS,
                        help=f"each layer's forward wait, ms per microbatch (default {DEVICE_MS:g}: message/compute in the "
                             "accelerator range, see the docstring; 2 is the setting before 2026-11-29)")
    parser.add_argument("--input_ms", type=float, default=DEVICE_MS, help="each layer's input-gradient wait")
    parser.add_argument("--weight_ms", type=float, default=DEVICE_MS, help="each layer's weight-gradient wait")
    parser.add_argument("--micro_batch", type=int, default=2, help="samples per microbatch (real compute stays tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per side (default 2, quick 1)")
    parser.add_argument("--chunks", type=int, default=None, help="timed chunks per side (default 4, quick 2)")
    parser.add_argument("--chunk_steps", type=int, default=None, help="steps per chunk (default 3, quick 2)")
    parser.add_argument("--no_straggler", action="store_true", help="leave out the straggler row")
    parser.add_argument("--straggler_only", action="store_true", help="only the straggler world")
    parser.add_argument("--no_live", action="store_true", help="straggler row without the live coordinator side")
    parser.add_argument("--settle_steps", type=int, default=None,
                        help="untimed steps the live side trains first, for the coordinator to detect and switch (default 15, quick 10)")
    parser.add_argument("--straggler_schedule", default="zbinterleaved", choices=("1f1b", "interleaved", "zbinterleaved"),
                        help="our schedule in the straggler world; interleaved and zbinterleaved run 2p stages in a loop, "
                             "re-planned as loop plans, against torch's multi-stage schedules too")
    parser.add_argument("--slowdown", type=float, default=2.0, help="the straggler's factor s")
    parser.add_argument("--slow_rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1200.0, help="deadline in seconds for each world")
    parser.add_argument("--out", default=str(RESULTS), help="the report (JSON)")
    parser.add_argument("--echo", action="store_true", help="print worker output as it arrives")
    for hidden in ("--_worker", "--_port"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.chunks = args.chunks if args.chunks is not None else (2 if args.quick else 4)
    args.chunk_steps = args.chunk_steps or (2 if args.quick else 3)
    args.settle_steps = args.settle_steps if args.settle_steps is not None else (10 if args.quick else 15)
    if args.layers_per_rank < 2 or args.layers_per_rank % 2:
        parser.error(f"--layers_per_rank must be even and >= 2 (2 stages per rank), got {args.layers_per_rank}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args._worker is not None:
        return worker(args._worker, args._port, args._spec, args._result)
    from runtime import _uptime  # bench/runtime.py: the machine-load line every report carries

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    logger.info("%s", methodology(args))
    ps = [int(x) for x in (args.p or ("4" if args.quick else "4,8")).split(",")]
    started, rows, summaries, loads = time.perf_counter(), [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_schedules_") as tmp:
        worlds = [] if args.straggler_only else [
            (p, m, False) for p in ps for m in ([int(x) for x in args.m.split(",")] if args.m else [p, 2 * p])]
        if not args.no_straggler:
            worlds.append((4, 8, True))
        for p, m, straggler in worlds:
            spec = prepare(args, p, m, Path(tmp), straggler)
            logger.info("world p=%d m=%d%s: %d sides ...", p, m, " (straggler)" if straggler else "", len(spec["sides"]))
            coordinator = start_coordinator(spec, args.settle_steps) if straggler and not args.no_live else None
            load = os.getloadavg()[0]
            try:
                world_rows = side_rows(spec, run_world(spec, Path(tmp), args.timeout, args.echo), args)
            finally:
                if coordinator is not None:
                    coordinator.stop()
            loads.append([load, os.getloadavg()[0]])
            for row in world_rows:
                row["load_1min"] = loads[-1]
            rows += world_rows
            summaries.append(straggler_summary(world_rows, spec) if straggler else summary(world_rows))
            if coordinator is not None:  # why the live plan is what it is: the speeds it was solved for, the policy's words
                summaries[-1] |= {"live_solved_for_speeds": coordinator.issued_speeds,
                                  "live_decisions": list(coordinator.rebalancer.decisions)}
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__, "uptime": _uptime()}
    report = {"benchmark": "schedules (emulated devices)", "methodology": methodology(args), "settings": {k: v for k, v in vars(args).items()
                                                                      if not k.startswith("_")},
              "machine": machine, "seconds": time.perf_counter() - started, "summaries": summaries, "rows": rows}
    from model_parallel.fileio import atomic_write_json

    atomic_write_json(args.out, report)
    print(methodology(args))
    print(format_rows(rows, summaries, machine["uptime"]))
    print(f"wrote {args.out} in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
