"""bench/schedules.py's rows and verdicts: a world's ranks' timings -> rows, the summaries against the goals, the table.

Per side: steps/s, `ratio` over torch's Schedule1F1B (median over chunk pairs), the bubble measured per rank
(1 - emulated busy / step wall), the analytic bubble (emulated.analytic_bubble), the same order simulated at this
m without latency (`simulated_bubble`), and CPU ms per step per rank. `summary` holds a world against issue #37's
goals (our best >= 1.15x torch's 1F1B and >= 1.0x torch's best); `straggler_summary` the straggler world against
the ceiling s x (p - 1 + 1/s) / p.
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any, Optional

from emulated import (BubbleCase, analytic_bubble, best_one_f_one_b_plan, one_f_one_b_step,  # bench/ is on sys.path
                      periodic, schedule_rows, schedule_step, straggler_ceiling)
from schedules_worlds import TORCH_SCHEDULES

# The same order in our runtime (runtime/step), whose step the simulator runs at this (p, m) without latency.
SIMULATED_AS = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "interleaved",
                "ScheduleInterleavedZeroBubble": "zbinterleaved", "ScheduleZBVZeroBubble": "zbv",
                **{name: name for name in ("gpipe", "1f1b", "interleaved", "zbh1", "zbinterleaved", "zbv")}}
# Bubble formula per schedule (emulated.analytic_bubble kinds); ours not listed (new schedules) get none.
BUBBLE_KIND = {"gpipe": "flush", "1f1b": "flush", "interleaved": "interleaved", "zbh1": "zb_h1",
               "zbinterleaved": "zb_interleaved", "zbv": "zb_v", "ScheduleGPipe": "flush", "Schedule1F1B": "flush",
               "ScheduleInterleaved1F1B": "interleaved", "ScheduleLoopedBFS": "interleaved",
               "ScheduleInterleavedZeroBubble": "zb_interleaved", "ScheduleZBVZeroBubble": "zb_v"}


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
            # Rank 0's first layer has no input gradient to wait (the model input needs none): it does 1/(3 x layers)
            # less work than the others, and its bubble reads that much higher on every side. The formulas assume
            # equal work; the simulation below runs stage 0 as it runs. This mean leaves rank 0 out.
            "bubble_ranks_1_on": statistics.mean(bubbles[1:]) if len(bubbles) > 1 else None,
            # CPU ms per step (the process, every thread): the waits take none, so this is the runtime's own cost.
            "cpu_ms_by_rank": [statistics.median(r[key]["chunk_cpu_ms"]) for r in ranks if "chunk_cpu_ms" in r[key]],
            # Of it, the training thread's (/proc ticks, 10 ms): it runs between the waits, so where it falls on a
            # rank's critical path it adds to the measured bubble over the simulated one (where the rank would wait
            # anyway, it costs nothing): with the hand-offs, what the simulation leaves out.
            "main_cpu_ms_by_rank": [statistics.median(r[key]["chunk_main_cpu_ms"]) for r in ranks
                                    if r[key].get("chunk_main_cpu_ms")],
            # A straggler unbalances the stages: the formulas assume equal ones.
            "analytic_bubble": None if spec.get("slow_rank") is not None else analytic_bubble(case),
            # The formulas hold for many microbatches (ZBV's 0 needs m >= 2p - 1 and more): the same order simulated
            # at this m with the emulated times and no message latency is what a runtime can reach here.
            **simulated_bubbles(None if spec.get("slow_rank") is not None else simulated(name, p, m, v, args)),
            "slow_rank": spec.get("slow_rank"), "slowdown": spec.get("slowdown"),
        })
        live = ranks[0][key]
        if "schedule_order" in live:  # ours: the order it ran last ("list": built from its plan's stage times)
            rows[-1]["schedule_order"] = live["schedule_order"]
        if "switch_steps" in live:  # the live side: when the coordinator switched, and to what
            rows[-1] |= {"switch_steps": live["switch_steps"], "switch_pauses_ms": live["switch_pauses_ms"],
                         "final_layers": live["layers"]}
    return rows


def simulated(name: str, p: int, m: int, v: int, args: argparse.Namespace) -> Optional[Any]:
    """Schedule `name` (ours or torch's counterpart, SIMULATED_AS) simulated (emulated.periodic: one step, and steps
    back to back) on equal stages of the emulated layers as both runtimes run them (stage 0's first layer waits no
    input gradient; optimizer/simulate.py, no message latency); None where there is no counterpart. Ours in the
    order our runtime runs (zero bubble's list-built from these times where it is faster: at m < 2p - 1 ZBV's fixed
    order idles more), torch's in its fixed order."""
    ours = SIMULATED_AS.get(name)
    if ours is None:
        return None
    layers = args.layers_per_rank // v
    rows, stage_rows, times = schedule_rows(ours, [layers] * (p * v), [1.0] * p, m, args.forward_ms, args.input_ms,
                                            args.weight_ms, list_order=name == ours, as_run=True)
    return periodic(rows, stage_rows, times, m)


def simulated_bubbles(steps: Optional[Any]) -> dict[str, Any]:
    """A row's simulated bubble, one step alone: the mean over ranks, per rank, and the mean over ranks 1 on (beside
    the measured); and over steps back to back (`periodic_*`: what a run of many steps can measure)."""
    if steps is None:
        return {"simulated_bubble": None}
    bubbles, steady = list(steps.one.bubbles), list(steps.bubbles)
    return {"simulated_bubble": statistics.mean(bubbles), "simulated_bubble_by_rank": bubbles,
            "simulated_bubble_ranks_1_on": statistics.mean(bubbles[1:]) if len(bubbles) > 1 else None,
            # steps back to back (emulated.periodic): what a run of many steps measures, where the order lets them overlap
            "periodic_bubble": statistics.mean(steady), "periodic_bubble_by_rank": steady,
            "periodic_step_ms": steps.period_ms}


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
                                           if r.get("simulated_bubble") is not None},
            "bubble_vs_periodic_points": {r["side"]: 100.0 * (r["bubble"] - r["periodic_bubble"]) for r in rows
                                          if r.get("periodic_bubble") is not None},
            "bubble_ranks_1_on_vs_simulated_points": {
                r["side"]: 100.0 * (r["bubble_ranks_1_on"] - r["simulated_bubble_ranks_1_on"]) for r in rows
                if r.get("simulated_bubble_ranks_1_on") is not None and r.get("bubble_ranks_1_on") is not None}}


def rebalanced_order_times(spec: dict[str, Any]) -> Optional[list[Any]]:
    """The stage times the rebalanced plan hands the workers (`stage_times`): what they list-build their order from."""
    from model_parallel.graph.plan import read_plan
    from model_parallel.runtime.step.auto import given_times

    given = given_times(read_plan(spec["plans"]["rebalanced"])) if "rebalanced" in spec.get("plans", {}) else None
    return None if given is None else list(given)


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
        solver_ms = schedule_step(ours, spec["rebalanced_layers"], scale, spec["m"], f, i, w, rebalanced_order_times(spec))
        out |= {"solver_plan_sim_ratio": static_ms / solver_ms, "ratio_vs_solver_plan_sim": ratio * solver_ms / static_ms}
        if ours == "1f1b":  # exhaustive over contiguous splits: the best any 1F1B plan reaches
            best_ms, best_layers = best_one_f_one_b_plan(spec["num_layers"], scale, spec["m"], f, i + w)
            out |= {"schedule_bound_ratio": static_ms / best_ms, "schedule_bound_layers": list(best_layers),
                    "ratio_vs_schedule_bound": ratio * best_ms / static_ms}
    fixed = by_side.get(f"ours {ours} rebalanced, fixed order")
    if fixed is not None:  # the same plan in torch's order: what the list-built one (list_order.py) gains, measured
        out |= {"fixed_order_ratio": fixed["ratio"], "list_over_fixed": ratio / fixed["ratio"],
                "rebalanced_order": by_side[f"ours {ours} rebalanced"].get("schedule_order")}
    live = by_side.get(f"ours {ours} live")
    if live is not None:
        out |= {"live_ratio": live["ratio"], "live_ratio_vs_ceiling": live["ratio"] / ceiling,
                "live_ratio_vs_torch_best": live["ratio"] / torch_best["ratio"],
                "live_steps_to_detect": live["switch_steps"][0] if live["switch_steps"] else None,
                "live_switch_steps": live["switch_steps"], "live_final_layers": live["final_layers"]}
    return out


def main_share(row: dict[str, Any]) -> Optional[float]:
    """The training threads' CPU per step over the step's wall time, % (mean over ranks); None where not recorded."""
    main = row.get("main_cpu_ms_by_rank")
    return 100.0 * statistics.mean(main) / row["step_ms"] if main and row.get("step_ms") else None


def format_rows(rows: Sequence[dict[str, Any]], summaries: Sequence[dict[str, Any]], uptime: str) -> str:
    """The table: per side steps/s, ratio over torch 1F1B, bubble measured vs analytic (%), per-rank bubbles."""
    def num(value: Optional[float], fmt: str) -> str:
        return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0]))

    lines = [f"{'p':>2} {'m':>3} {'side':<36} {'steps/s':>8} {'step ms':>8} {'ratio':>6} {'bubble %':>9} "
             f"{'analytic %':>10} {'sim %':>6} {'steady %':>8} {'cpu ms':>6} {'main %':>6}  bubble % by rank"]
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['p']:>2} {r['m']:>3} {r['side']:<36} refused: {r['refused']}")
            continue
        analytic = 100.0 * r["analytic_bubble"] if r["analytic_bubble"] is not None else None
        simulated = 100.0 * r["simulated_bubble"] if r.get("simulated_bubble") is not None else None
        steady = 100.0 * r["periodic_bubble"] if r.get("periodic_bubble") is not None else None
        lines.append(f"{r['p']:>2} {r['m']:>3} {r['side']:<36} {r['steps_per_s']:>8.2f} {r['step_ms']:>8.1f} "
                     f"{num(r['ratio'], '6.2f')} {100.0 * r['bubble']:>9.1f} {num(analytic, '10.1f')} {num(simulated, '6.1f')} {num(steady, '8.1f')} "
                     f"{num(statistics.mean(r['cpu_ms_by_rank']) if r.get('cpu_ms_by_rank') else None, '6.1f')} "
                     f"{num(main_share(r), '6.1f')}  "
                     + " ".join(f"{100.0 * b:.0f}" for b in r["bubble_by_rank"]))
    lines.append("ratio: steps/s over torch Schedule1F1B's in the same world (median over chunk pairs); "
                 "bubble: 1 - emulated busy / step wall, per rank; sim: the same order simulated at this m without "
                 "latency, stage 0 as it runs (its first layer waits no input gradient); steady: the same over steps run "
                 "back to back (no barrier between steps in either runtime: an order that ends late on the ranks that "
                 "start late overlaps the next step, a V's does); cpu ms: CPU per step, mean "
                 "over ranks; main %: the training thread's CPU per step / step wall, mean over ranks (between the "
                 "waits: on a rank's critical path it adds to bubble - sim, as the hand-offs do)")
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
            if "fixed_order_ratio" in s:
                lines.append(f"  the rebalanced plan in torch's fixed order: {s['fixed_order_ratio']:.2f}; ours ran the "
                             f"{s['rebalanced_order']} order: {s['list_over_fixed']:.3f}x that")
            if "live_ratio" in s:
                lines.append(f"  live (coordinator, auto policy, slow from step 0): switches at steps {s['live_switch_steps']} "
                             f"to {s['live_final_layers']} layers; ratio {s['live_ratio']:.2f} after warm-up + settle "
                             f"({s['live_ratio_vs_ceiling']:.2f} of the ceiling, {s['live_ratio_vs_torch_best']:.2f} x torch's best)")
        else:
            lines.append(f"p={s['p']} m={s['m']}: our best ({s['ours_best']}) / torch 1F1B = {s['best_vs_torch_1f1b']:.2f} "
                         f"(goal >= 1.15), / torch best ({s['torch_best']}) = {s['best_vs_torch_best']:.2f} (goal >= 1.0)")
    lines.append(uptime)
    return "\n".join(lines)
