"""Schedules on emulated devices: every schedule of ours and of torch.distributed.pipelining, bubbles and stragglers.

    python bench/schedules.py                  # p = 4 and 8, m = p and 2p, and the straggler row
    python bench/schedules.py --quick          # p = 4 only, few steps (a couple of minutes; bench/gpu_check.sh)
    python bench/schedules.py --p 4 --m 8 --no_straggler

Why emulated: on this machine (2 cores, 8 engineers) a rank that waits frees a core for another, so
bubbles are filled by other ranks' work and a 2x straggler costs little: ratios on real CPU compute
cannot show what a schedule or a rebalance is worth on dedicated devices. Here every layer's
compute is a calibrated sleep (bench/emulated.py: forward, input gradient and weight gradient each
of a set duration, through autograd, on separate autograd nodes so torch's zero-bubble stages really
split them), so p ranks on 2 cores behave like p devices, with real messages and each runtime's real
overhead. The model: `--layers_per_rank` x p EmulatedLayers (width 16), traced by our profiler (fx,
the layer a leaf) and cut into p stages of equal layer count for ours and single-stage torch
schedules, 2p for torch's multi-stage ones (looped or V placement).

One world per (p, m): each rank builds every side — torch's GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV and our `SCHEDULE_NAMES` — and they train chunks of
`--chunk_steps` steps in turn, the order flipping every chunk, each timed between barriers
(runtime_worlds.SideRunner). A side torch refuses for this (p, m) is left out with the reason.

Rows (one per side): steps/s (median chunk); `ratio` = this side's steps/s over torch Schedule1F1B's,
the median over chunks of the same round (back to back: the same machine load); `bubble_by_rank` =
1 - emulated busy ms / step wall ms per rank (medians over chunks), `bubble` their mean, and
`analytic_bubble` (emulated.analytic_bubble; None where no formula is given); `cpu_ms_by_rank`: each
rank's CPU ms per step (the waits sleep, so this is the runtime's own cost). Per world a summary:
our best schedule over torch's 1F1B (goal >= 1.15) and over torch's best (goal >= 1.0).

The straggler world (p = 4, m = 2p, `--straggler_layers_per_rank` 6, rank 1's waits x `--slowdown` from
step 0 on both sides): torch keeps its static equal split; ours runs `--straggler_schedule` (1f1b; or
interleaved / zbinterleaved on 2p stages in a loop, against torch's multi-stage schedules too) on that
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
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from emulated import (BubbleCase, EmulatedLayer, analytic_bubble, best_one_f_one_b_plan,  # bench/ is first on sys.path
                      one_f_one_b_step, schedule_simulation, schedule_step, straggler_ceiling)
from schedules_worlds import TORCH_SCHEDULES, build_model, layer_counts, worker

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "schedules.json"  # bench/snapshot/ holds the copy the docs quote
logger = logging.getLogger("bench.schedules")
# The same order in our runtime (runtime/step), whose step the simulator runs at this (p, m) without latency.
SIMULATED_AS = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "interleaved",
                "ScheduleInterleavedZeroBubble": "zbinterleaved", "ScheduleZBVZeroBubble": "zbv",
                **{name: name for name in ("gpipe", "1f1b", "interleaved", "zbh1", "zbinterleaved", "zbv")}}
# Bubble formula per schedule (emulated.analytic_bubble kinds); ours not listed (new schedules) get none.
BUBBLE_KIND = {"gpipe": "flush", "1f1b": "flush", "interleaved": "interleaved", "zbh1": "zb_h1",
               "zbinterleaved": "zb_interleaved", "zbv": "zb_v", "ScheduleGPipe": "flush", "Schedule1F1B": "flush",
               "ScheduleInterleaved1F1B": "interleaved", "ScheduleLoopedBFS": "interleaved",
               "ScheduleInterleavedZeroBubble": "zb_interleaved", "ScheduleZBVZeroBubble": "zb_v"}


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
    """The traced graph with its profile: every layer f ms forward, i + w ms backward (what the waits are)."""
    return graph.replace_nodes([dataclasses.replace(n, forward_ms=args.forward_ms, backward_ms=args.input_ms + args.weight_ms)
                                if n.layer is not None and n.layer.op == "call_module" else n for n in graph.nodes])


def rebalanced_plan(graph: Any, args: argparse.Namespace, p: int, v: int = 1) -> Any:
    """The rebalancer's solver on the timed graph with rank `--slow_rank` at speed 1/s: the plan our
    live rebalancer should move to (v = 2: a loop plan, stage k on rank k % p, as the policy re-plans interleaved)."""
    from model_parallel.coordinator.solver import default_solver

    ranks = [k % p for k in range(v * p)]
    speeds = [1.0 / args.slowdown if r == args.slow_rank else 1.0 for r in ranks]  # one per stage: its rank's
    return default_solver(graph, ranks, speeds)


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
    from model_parallel.graph.in_flight import LOOP_SCHEDULES, SCHEDULE_NAMES, V_SCHEDULES
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
            {"key": f"ours {ours} rebalanced", "runtime": "ours", "schedule": ours, "plan": "rebalanced"}]
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
    port = coordinator.start("127.0.0.1", 0)
    spec["sides"].append({"key": f"ours {ours} live", "runtime": "ours", "schedule": ours, "plan": static,
                          "coordinator": f"127.0.0.1:{port}", "token": token, "settle_steps": settle_steps})
    Path(spec["path"]).write_text(json.dumps(spec))
    return coordinator


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


def side_rows(spec: dict[str, Any], ranks: Sequence[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per side: steps/s, ratio over torch 1F1B (median chunk pair), bubble measured and analytic."""
    from model_parallel.graph.in_flight import MULTI_STAGE_SCHEDULES

    p, m = spec["p"], spec["m"]
    rows = []
    # Every rank times between the same barriers: per chunk, the slowest rank's wall time.
    chunk_s = {key: [max(c) for c in zip(*(r[key]["chunk_step_s"] for r in ranks))] for key in ranks[0]
               if "refused" not in ranks[0][key]}
    base = chunk_s.get("torch Schedule1F1B")
    for side in spec["sides"]:
        key, name = side["key"], side["schedule"]
        if key not in chunk_s:  # the schedule's constructor refused this (p, m): say why, time nothing
            rows.append({"p": p, "m": m, "runtime": side["runtime"], "schedule": name, "side": key,
                         "refused": ranks[0][key]["refused"]})
            continue
        wall = chunk_s[key]
        bubbles = [statistics.median(1.0 - busy / (s * 1000.0) for busy, s in zip(r[key]["chunk_busy_ms"], wall))
                   for r in ranks]
        v = TORCH_SCHEDULES[name][0] if side["runtime"] == "torch" else (2 if name in MULTI_STAGE_SCHEDULES else 1)
        layers = args.layers_per_rank
        case = BubbleCase(BUBBLE_KIND.get(name, "none"), p, m, v, layers * args.forward_ms, layers * args.input_ms,
                          layers * args.weight_ms)
        rows.append({
            "p": p, "m": m, "runtime": side["runtime"], "schedule": name, "side": key, "stages_per_rank": v,
            "steps_per_s": 1.0 / statistics.median(wall), "step_ms": 1000.0 * statistics.median(wall),
            "ratio": statistics.median(b / w for b, w in zip(base, wall)) if base else None,
            "chunk_ratios": [b / w for b, w in zip(base, wall)] if base else None,
            "bubble_by_rank": bubbles, "bubble": statistics.mean(bubbles),
            # CPU ms per step (the process, every thread): the waits take none, so this is the runtime's own cost.
            "cpu_ms_by_rank": [statistics.median(r[key]["chunk_cpu_ms"]) for r in ranks if "chunk_cpu_ms" in r[key]],
            # A straggler unbalances the stages: the formulas assume equal ones.
            "analytic_bubble": None if spec.get("slow_rank") is not None else analytic_bubble(case),
            # The formulas hold for many microbatches (ZBV's 0 needs m >= 2p - 1 and more): the same order simulated
            # at this m with the emulated times and no message latency is what a runtime can reach here.
            "simulated_bubble": None if spec.get("slow_rank") is not None else simulated_bubble(name, p, m, v, args),
            "slow_rank": spec.get("slow_rank"), "slowdown": spec.get("slowdown"),
        })
        live = ranks[0][key]
        if "switch_steps" in live:  # the live side: when the coordinator switched, and to what
            rows[-1] |= {"switch_steps": live["switch_steps"], "switch_pauses_ms": live["switch_pauses_ms"],
                         "final_layers": live["layers"]}
    return rows


def simulated_bubble(name: str, p: int, m: int, v: int, args: argparse.Namespace) -> Optional[float]:
    """The mean bubble over ranks of schedule `name` (ours or torch's counterpart, SIMULATED_AS) simulated on equal
    stages of the emulated layers (optimizer/simulate.py, no message latency); None where there is no counterpart."""
    ours = SIMULATED_AS.get(name)
    if ours is None:
        return None
    layers = args.layers_per_rank // v
    return schedule_simulation(ours, [layers] * (p * v), [1.0] * p, m, args.forward_ms, args.input_ms,
                               args.weight_ms).bubble


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A world's verdict: our best schedule against torch's 1F1B (goal >= 1.15) and torch's best (goal >= 1.0)."""
    rows = [r for r in rows if "refused" not in r]
    # Best by the chunk-paired ratio (the same machine moments for every side), not by each side's own median.
    ours = max((r for r in rows if r["runtime"] == "ours"), key=lambda r: r["ratio"])
    theirs = max((r for r in rows if r["runtime"] == "torch"), key=lambda r: r["ratio"])
    return {"p": rows[0]["p"], "m": rows[0]["m"], "ours_best": ours["schedule"], "torch_best": theirs["schedule"],
            "best_vs_torch_1f1b": ours["ratio"], "best_vs_torch_best": ours["ratio"] / theirs["ratio"],
            "bubble_error_points": {r["side"]: 100.0 * (r["bubble"] - r["analytic_bubble"]) for r in rows
                                    if r["analytic_bubble"] is not None},
            "bubble_vs_simulated_points": {r["side"]: 100.0 * (r["bubble"] - r["simulated_bubble"]) for r in rows
                                           if r.get("simulated_bubble") is not None}}


def straggler_summary(rows: Sequence[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """ours rebalanced over torch's static 1F1B (and over torch's best static schedule), against the ceiling
    s x (p - 1 + 1/s) / p."""
    by_side = {r["side"]: r for r in rows if "refused" not in r}
    p, ours = spec["p"], spec.get("straggler_schedule", "1f1b")
    ceiling = spec["slowdown"] * straggler_ceiling(p, spec["slowdown"])
    ratio = by_side[f"ours {ours} rebalanced"]["ratio"]
    torch_best = max((r for r in by_side.values() if r["side"].startswith("torch ") and "our rebalanced" not in r["side"]),
                     key=lambda r: r["ratio"])
    # What whole layers allow: the static slowest rank (s x its layers) over the rebalanced plan's slowest.
    scale = [spec["slowdown"] if r == spec["slow_rank"] else 1.0 for r in range(p)]
    per_rank = spec.get("rebalanced_rank_layers", spec["rebalanced_layers"])
    plan_ceiling = spec["slowdown"] * spec["num_layers"] / p / max(n * f for n, f in zip(per_rank, scale))
    out = {"p": p, "m": spec["m"], "schedule": ours, "slow_rank": spec["slow_rank"], "slowdown": spec["slowdown"],
           "rebalanced_layers": spec["rebalanced_layers"], "rebalanced_rank_layers": per_rank,
           "plan_ceiling_ratio": plan_ceiling, "ratio": ratio, "ceiling_ratio": ceiling,
           "ratio_vs_ceiling": ratio / ceiling, "ours_static_ratio": by_side[f"ours {ours} static"]["ratio"],
           "torch_best": torch_best["side"].split(" ", 1)[1], "torch_best_ratio": torch_best["ratio"],
           "ratio_vs_torch_best": ratio / torch_best["ratio"],
           "plan_source": "the rebalancer's solver on the emulated times with the slow rank's speed, from step 0"}
    emulation = spec.get("emulation")
    if emulation is not None:  # what a plan can reach under the schedule at this m (emulated.py): fill and drain stay
        f, i, w = emulation["forward_ms"], emulation["input_ms"], emulation["weight_ms"]
        static_ms = one_f_one_b_step([spec["num_layers"] // p] * p, scale, spec["m"], f, i + w)
        solver_ms = schedule_step(ours, spec["rebalanced_layers"], scale, spec["m"], f, i, w)
        out |= {"solver_plan_sim_ratio": static_ms / solver_ms, "ratio_vs_solver_plan_sim": ratio * solver_ms / static_ms}
        if ours == "1f1b":  # exhaustive over contiguous splits: the best any 1F1B plan reaches
            best_ms, best_layers = best_one_f_one_b_plan(spec["num_layers"], scale, spec["m"], f, i + w)
            out |= {"schedule_bound_ratio": static_ms / best_ms, "schedule_bound_layers": list(best_layers),
                    "ratio_vs_schedule_bound": ratio * best_ms / static_ms}
    live = by_side.get(f"ours {ours} live")
    if live is not None:
        out |= {"live_ratio": live["ratio"], "live_ratio_vs_ceiling": live["ratio"] / ceiling,
                "live_ratio_vs_torch_best": live["ratio"] / torch_best["ratio"],
                "live_steps_to_detect": live["switch_steps"][0] if live["switch_steps"] else None,
                "live_switch_steps": live["switch_steps"], "live_final_layers": live["final_layers"]}
    return out


def format_rows(rows: Sequence[dict[str, Any]], summaries: Sequence[dict[str, Any]], uptime: str) -> str:
    """The table: per side steps/s, ratio over torch 1F1B, bubble measured vs analytic (%), per-rank bubbles."""
    def num(value: Optional[float], fmt: str) -> str:
        return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0]))

    lines = [f"{'p':>2} {'m':>3} {'side':<36} {'steps/s':>8} {'step ms':>8} {'ratio':>6} {'bubble %':>9} "
             f"{'analytic %':>10} {'sim %':>6} {'cpu ms':>6}  bubble % by rank"]
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['p']:>2} {r['m']:>3} {r['side']:<36} refused: {r['refused']}")
            continue
        analytic = 100.0 * r["analytic_bubble"] if r["analytic_bubble"] is not None else None
        simulated = 100.0 * r["simulated_bubble"] if r.get("simulated_bubble") is not None else None
        lines.append(f"{r['p']:>2} {r['m']:>3} {r['side']:<36} {r['steps_per_s']:>8.2f} {r['step_ms']:>8.1f} "
                     f"{num(r['ratio'], '6.2f')} {100.0 * r['bubble']:>9.1f} {num(analytic, '10.1f')} {num(simulated, '6.1f')} "
                     f"{num(statistics.mean(r['cpu_ms_by_rank']) if r.get('cpu_ms_by_rank') else None, '6.1f')}  "
                     + " ".join(f"{100.0 * b:.0f}" for b in r["bubble_by_rank"]))
    lines.append("ratio: steps/s over torch Schedule1F1B's in the same world (median over chunk pairs); "
                 "bubble: 1 - emulated busy / step wall, per rank; sim: the same order simulated at this m without "
                 "latency; cpu ms: CPU per step, mean over ranks")
    for s in summaries:
        if "ceiling_ratio" in s:
            lines.append(f"straggler p={s['p']} m={s['m']} rank {s['slow_rank']} x{s['slowdown']:g}: ours {s['schedule']} "
                         f"rebalanced {s['rebalanced_layers']} layers / torch static 1F1B = {s['ratio']:.2f} (ceiling "
                         f"{s['ceiling_ratio']:.2f}, {s['ratio_vs_ceiling']:.2f} of it; goal >= 0.95; whole layers allow "
                         f"{s['plan_ceiling_ratio']:.2f}); / torch's best static ({s['torch_best']}) = "
                         f"{s['ratio_vs_torch_best']:.2f}; ours static {s['ours_static_ratio']:.2f}")
            if "solver_plan_sim_ratio" in s:
                bound = (f"the best 1F1B plan {s['schedule_bound_layers']} reaches {s['schedule_bound_ratio']:.2f} "
                         f"({s['schedule_bound_ratio'] / s['ceiling_ratio']:.2f} of the ceiling), "
                         if "schedule_bound_ratio" in s else "")
                lines.append(f"  {s['schedule']} at m={s['m']} (simulated, no latency): {bound}the solver's plan "
                             f"{s['solver_plan_sim_ratio']:.2f} ({s['solver_plan_sim_ratio'] / s['ceiling_ratio']:.2f} of the "
                             f"ceiling); measured {s['ratio_vs_solver_plan_sim']:.2f} of that")
            if "live_ratio" in s:
                lines.append(f"  live (coordinator, auto policy, slow from step 0): switches at steps {s['live_switch_steps']} "
                             f"to {s['live_final_layers']} layers; ratio {s['live_ratio']:.2f} after warm-up + settle "
                             f"({s['live_ratio_vs_ceiling']:.2f} of the ceiling, {s['live_ratio_vs_torch_best']:.2f} x torch's best)")
        else:
            lines.append(f"p={s['p']} m={s['m']}: our best ({s['ours_best']}) / torch 1F1B = {s['best_vs_torch_1f1b']:.2f} "
                         f"(goal >= 1.15), / torch best ({s['torch_best']}) = {s['best_vs_torch_best']:.2f} (goal >= 1.0)")
    lines.append(uptime)
    return "\n".join(lines)


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
    parser.add_argument("--forward_ms", type=float, default=2.0, help="each layer's forward wait, ms per microbatch")
    parser.add_argument("--input_ms", type=float, default=2.0, help="each layer's input-gradient wait")
    parser.add_argument("--weight_ms", type=float, default=2.0, help="each layer's weight-gradient wait")
    parser.add_argument("--micro_batch", type=int, default=2, help="samples per microbatch (real compute stays tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per side (default 3, quick 2)")
    parser.add_argument("--chunks", type=int, default=None, help="timed chunks per side (default 6, quick 2)")
    parser.add_argument("--chunk_steps", type=int, default=None, help="steps per chunk (default 4, quick 3)")
    parser.add_argument("--no_straggler", action="store_true", help="leave out the straggler row")
    parser.add_argument("--straggler_only", action="store_true", help="only the straggler world")
    parser.add_argument("--no_live", action="store_true", help="straggler row without the live coordinator side")
    parser.add_argument("--settle_steps", type=int, default=None,
                        help="untimed steps the live side trains first, for the coordinator to detect and switch (default 15, quick 10)")
    parser.add_argument("--straggler_schedule", default="1f1b", choices=("1f1b", "interleaved", "zbinterleaved"),
                        help="our schedule in the straggler world; interleaved and zbinterleaved run 2p stages in a loop, "
                             "re-planned as loop plans, against torch's multi-stage schedules too")
    parser.add_argument("--slowdown", type=float, default=2.0, help="the straggler's factor s")
    parser.add_argument("--slow_rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds for each world")
    parser.add_argument("--out", default=str(RESULTS), help="the report (JSON)")
    parser.add_argument("--echo", action="store_true", help="print worker output as it arrives")
    for hidden in ("--_worker", "--_port"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.chunks = args.chunks if args.chunks is not None else (2 if args.quick else 6)
    args.chunk_steps = args.chunk_steps or (3 if args.quick else 4)
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
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__, "uptime": _uptime()}
    report = {"benchmark": "schedules (emulated devices)", "settings": {k: v for k, v in vars(args).items()
                                                                      if not k.startswith("_")},
              "machine": machine, "seconds": time.perf_counter() - started, "summaries": summaries, "rows": rows}
    from model_parallel.fileio import atomic_write_json

    atomic_write_json(args.out, report)
    print(format_rows(rows, summaries, machine["uptime"]))
    print(f"wrote {args.out} in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
