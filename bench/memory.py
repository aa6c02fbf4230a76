"""Memory benchmark: a model bigger than one worker trains on 4 ranks, each holding only its own stage.

    python bench/memory.py                 # ~150M-parameter MLP (whole fp32 params+grads+Adam 2.4 GB), 4 ranks
    python bench/memory.py --width 1024 --depth 16   # a small smoke run

Every rank is a process of its own (one thread, gloo on localhost, reaped under a deadline). Before
it builds anything it caps its own memory with `RLIMIT_DATA` (private writable memory: the heap and
torch's allocations) at what it holds after `import torch` and joining the world, plus a budget of
`--budget` x its stage's share (fp32 parameters + gradients + Adam's two moments; the larger of its
shares before and after the switch) + `--slack` GB
(thread stacks, the allocator, messages in flight); the budget is
below the whole model's footprint, and below what a rank needs that holds the whole model's
parameters plus its stage's gradients and optimizer state (how every rank worked before issue 25).

1. stage-only run: the model is built on meta; each rank materializes its stage's layers
   (runtime/build/materialize.py), trains `--steps` steps with Adam, then a scripted live switch moves one
   layer from stage 1 to stage 0 (runtime/wire/migration.py) and it trains `--steps` more.
2. control: the same world and cap, but the model is materialized whole on every rank before the
   engine starts (what a rank that builds the whole model does): every rank is expected to fail with
   an allocation error.

Per rank, for each phase (before and after the switch): the footprint model's predicted peak
(optimizer/memory.py) next to the measured one (held parameters + gradients + Adam state + the peak of
what microbatches in flight keep for backward, `RunOptions(measure_memory=True)`), peak RSS (VmHWM,
reset between phases via /proc/self/clear_refs; the switch itself is a phase of its own, whose goal
uses the larger of the two shares), the bytes of its stage's parameters + gradients + optimizer state as held,
the whole model's (16 bytes per parameter) and the goal, peak RSS <= 1.25 x stage share + 0.5 GB.
Writes bench/results/memory.json (atomically).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model_parallel.runtime.observe.memory_probe import status_bytes  # noqa: E402

GB = 1e9
RESULT = "MEMORY_RESULT "


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _stage_bytes(engine) -> dict[str, int]:
    """The stage's parameters, gradients and optimizer state as held (runtime.observe.memory_probe.state_bytes)."""
    from model_parallel.runtime.observe.memory_probe import state_bytes

    if engine.stage is None:
        return {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0}
    held = state_bytes(engine.stage, engine.optimizer)
    return {"param_bytes": held["parameters"], "grad_bytes": held["gradients"], "optimizer_bytes": held["optimizer_state"]}


def _footprint(engine, args: argparse.Namespace) -> dict[str, float]:
    """The stage's predicted footprint (optimizer/memory.py, Adam, 1F1B) and its measured counterpart: the
    largest parameters + gradients + Adam state held after a step's backwards + the peak bytes microbatches in
    flight kept for backward (runtime/observe/memory_probe.StashMeter), over the steps of the current plan."""
    from model_parallel.runtime.observe.memory_table import predicted

    if engine.stage is None:
        return {}
    parts = predicted(engine.graph, engine.plan, "adam", 0.0, "1f1b", args.micro, args.batch // args.micro)
    records = [r for r in engine.metrics.records if r.plan_version == engine.plan.version]
    held = max(r.extra["held_bytes"] for r in records)
    stash = max(r.extra["stash_peak_bytes"] for r in records)
    return {"predicted_peak_bytes": parts[engine.stage_id]["total"], "measured_peak_bytes": held + stash,
            "predicted_activation_bytes": parts[engine.stage_id]["activations"], "measured_stash_peak_bytes": stash}


def worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from model_parallel.graph.plan import Plan, StagePlan
    from model_parallel.models import StackedMLP
    from model_parallel.profiler.trace import trace_model
    from model_parallel.runtime.build.materialize import materialize_model
    from model_parallel.runtime.build.stages import even_plan
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.data.batches import SyntheticData
    from model_parallel.runtime.engine import PipelineEngine
    from model_parallel.runtime.wire.migration import switch_plan

    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    with torch.device("meta"):
        model = StackedMLP(in_features=args.width, width=args.width, depth=args.depth, num_classes=10)
    graph, _ = trace_model(model, (torch.zeros(args.batch // args.micro, args.width, device="meta"),))
    total = sum(p.numel() for p in model.parameters())
    whole = 16 * total  # fp32 parameters + gradients + Adam's exp_avg and exp_avg_sq
    plan = even_plan(graph, world).with_default_ranks()
    # One Linear+ReLU moves from stage 1 to stage 0 after `--steps`: a live switch with layer values and Adam state.
    ids = [list(s.node_ids) for s in plan.stages]
    moved, ids[1] = ids[1][:2], ids[1][2:]
    ids[0] += moved
    new = Plan(stages=tuple(StagePlan(i, tuple(n)) for i, n in enumerate(ids)), version=1).with_default_ranks()
    # This rank's share under either plan (4 x its parameter bytes): the cap follows the larger one, so a rank
    # that receives layers may hold them, and stays far below the whole model.
    share = max(4 * sum(graph[n].parameter_size for k in p.stages_of_rank(rank) for n in p.stages[k].node_ids)
                for p in (plan, new))  # several stages per rank (loop placement): all of them
    baseline = status_bytes("VmData")
    cap = baseline + int(args.budget * share + args.slack * GB)  # slack: thread stacks, allocator, messages
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    report: dict = {"rank": rank, "mode": args.mode, "whole_model_bytes": whole, "parameters": total,
                    "cap_bytes": cap, "baseline_vmdata_bytes": baseline, "budget_bytes": cap - baseline}
    try:
        if args.mode == "whole":
            materialize_model(model, 0, graph)  # every rank holding the whole model, as before issue 25
        engine = PipelineEngine(graph=graph, plan=plan, model=model, criterion=torch.nn.functional.cross_entropy,
                                optimizer_factory=lambda p: torch.optim.Adam(p, lr=1e-4), dataset=SyntheticData(
                                    args.batch, (args.width,), 10, seed=0),
                                config=TrainConfig(batch_size=args.batch, num_microbatches=args.micro, seed=0),
                                options=RunOptions(measure_memory=True))
        engine.train(args.steps)
        report["before"] = {**_stage_bytes(engine), **_footprint(engine, args), "peak_rss_bytes": status_bytes("VmHWM")}
        _reset_peak()
        pause = switch_plan(engine, new)
        # The switch itself holds the leaving layers until the arriving ones are in: its own peak, then the
        # steady state after it (the engine returns the memory of layers that left to the OS).
        switch_peak, rss_after_switch = status_bytes("VmHWM"), status_bytes("VmRSS")
        _reset_peak()
        engine.train(2 * args.steps, start_step=args.steps)
        report["after"] = {**_stage_bytes(engine), **_footprint(engine, args), "peak_rss_bytes": status_bytes("VmHWM"),
                           "switch_pause_s": pause, "switch_peak_rss_bytes": switch_peak,
                           "rss_after_switch_bytes": rss_after_switch}
        report["final_loss"] = engine.history[-1].loss if engine.history else None
        report["ok"] = True
    except (MemoryError, RuntimeError) as error:
        report["ok"] = False
        report["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        report["peak_rss_bytes_at_failure"] = status_bytes("VmHWM")
    print(RESULT + json.dumps(report), flush=True)
    if report["ok"]:
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(0)  # peers are blocked on this rank; the launcher's deadline reaps them


def run_world(args: argparse.Namespace, mode: str) -> list[dict]:
    from model_parallel.runtime.launch import free_port, launch

    port = free_port()
    commands = [[sys.executable, __file__, "--worker", "--mode", mode, "--rank", str(r), "--world", str(args.world),
                 "--port", str(port), "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
                 "--micro", str(args.micro), "--steps", str(args.steps), "--budget", str(args.budget), "--slack", str(args.slack)]
                for r in range(args.world)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = launch(commands, timeout=args.timeout if mode == "stage" else 120, env=env)
    return result_rows(result, RESULT)


def result_rows(result, marker: str) -> list[dict]:
    """Each worker's JSON result line (after `marker`), or a row saying it gave none, with its output's tail."""
    rows = []
    for w in result.workers:
        line = next((x for x in w.output.splitlines() if x.startswith(marker)), None)
        rows.append(json.loads(line[len(marker):]) if line else {"rank": w.rank, "ok": False,
                                                                   "error": f"no result (exit {w.returncode})",
                                                                   "tail": w.output[-600:]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="stage", choices=("stage", "whole"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=34, help="hidden Linear(width, width) layers")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps before and after the switch")
    parser.add_argument("--budget", type=float, default=1.1, help="cap above the baseline, in stage shares (+ slack)")
    parser.add_argument("--slack", type=float, default=0.25, help="cap above the baseline, GB, on top of the shares")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    start = time.monotonic()
    stage = run_world(args, "stage")
    control = run_world(args, "whole")
    goal = lambda row, phase: row[phase]["peak_rss_bytes"] <= 1.25 * row[phase]["stage_share_bytes"] + 0.5 * GB  # noqa: E731
    for row in stage:
        for phase in ("before", "after"):
            if row.get("ok"):
                # Gradients are dropped after each update (set to None), so count them at their size during the step.
                row[phase]["stage_share_bytes"] = 2 * row[phase]["param_bytes"] + row[phase]["optimizer_bytes"]
                row[phase]["meets_goal"] = bool(goal(row, phase))
                row[phase]["goal_bytes"] = int(1.25 * row[phase]["stage_share_bytes"] + 0.5 * GB)
    for row in stage:
        if row.get("ok"):  # during the switch a rank may hold both its old and its new stage's layers
            after = row["after"]
            after["switch_goal_bytes"] = int(1.25 * max(row["before"]["stage_share_bytes"], after["stage_share_bytes"])
                                             + 0.5 * GB)
            after["switch_meets_goal"] = after["switch_peak_rss_bytes"] <= after["switch_goal_bytes"]
    summary = {
        "stage_only_ok": all(r.get("ok") for r in stage),
        "goal_met": all(r.get("ok") and r["before"]["meets_goal"] and r["after"]["meets_goal"]
                        and r["after"]["switch_meets_goal"] for r in stage),
        "control_failed_on_every_rank": all(not r.get("ok") for r in control),
    }
    out = {"settings": {k: v for k, v in vars(args).items() if k not in ("worker", "mode", "rank", "port")},
           "machine": platform.platform(), "seconds": round(time.monotonic() - start, 1), "summary": summary,
           "stage_only": stage, "whole_model_control": control}
    from model_parallel.fileio import atomic_write_json

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, out)
    for row in stage:
        if not row.get("ok"):
            print(f"rank {row['rank']}: FAILED {row.get('error')}")
            continue
        for phase in ("before", "after"):
            p = row[phase]
            print(f"rank {row['rank']} {phase:6s}: peak RSS {p['peak_rss_bytes'] / GB:.3f} GB, stage share "
                  f"{p['stage_share_bytes'] / GB:.3f} GB (params {p['param_bytes'] / GB:.3f}, grads as params, "
                  f"Adam {p['optimizer_bytes'] / GB:.3f}), whole model {row['whole_model_bytes'] / GB:.3f} GB, cap "
                  f"{row['budget_bytes'] / GB:.3f} GB above baseline, goal {'met' if p['meets_goal'] else 'MISSED'}")
            if phase == "after":
                print(f"    the switch itself: peak RSS {p['switch_peak_rss_bytes'] / GB:.3f} GB (goal from the larger share: "
                      f"{p['switch_goal_bytes'] / GB:.3f} GB, {'met' if p['switch_meets_goal'] else 'MISSED'}), RSS right "
                      f"after it {p['rss_after_switch_bytes'] / GB:.3f} GB")
            error = 100.0 * (p["predicted_peak_bytes"] - p["measured_peak_bytes"]) / p["measured_peak_bytes"]
            print(f"    footprint: predicted {p['predicted_peak_bytes'] / GB:.3f} GB, measured (tensor-accounted) "
                  f"{p['measured_peak_bytes'] / GB:.3f} GB ({error:+.0f}%); activations predicted "
                  f"{p['predicted_activation_bytes'] / 1e6:.3f} MB, measured {p['measured_stash_peak_bytes'] / 1e6:.3f} MB")
    for row in control:
        print(f"control rank {row['rank']}: {'failed as expected: ' + row.get('error', '') if not row.get('ok') else 'DID NOT FAIL'}")
    print(json.dumps(summary), f"-> {args.out}")
    return 0 if summary["stage_only_ok"] and summary["control_failed_on_every_rank"] else 1


if __name__ == "__main__":
    sys.exit(main())
