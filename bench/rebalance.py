"""Rebalance benchmark: a balanced 4-stage pipeline, one worker slowed 2x at step S, the coordinator re-plans live.

    python bench/rebalance.py            # full run (a few minutes on 2 cores)
    python bench/rebalance.py --quick    # about two minutes

Model: an MLP of `--depth` Linear(width, width)+ReLU blocks (`FlatMLP`, StackedMLP's layers under
flat attribute names), so the per-layer cost is controlled and uniform. The main process profiles it at microbatch size (`model_parallel.profile`) and writes
graph.json; the starting plan is the optimizer's for 4 equal workers (balanced).

Two worlds of 4 workers (`test_parallel_0.py`, one thread each, gloo on localhost), each with its
own per-step metrics JSONL:

1. **live**: coordinator (`test_socket.py --policy auto`) + workers with `--slowdown 2
   --slowdown_rank R --slowdown_after_step S`. The coordinator must notice, re-solve with the
   measured speeds and switch plans while training.
2. **best static**: no coordinator; workers start on the plan the optimizer gives for the new speeds
   (rank R at 0.5) with the same slowdown from step 0 — the best fixed plan for the slowed machine.

Throughput of a step = samples / step time of the slowest rank (`samples_per_s`, minimum over ranks);
phases use medians: before = [warm-up, S), slowed = [S, switch), after = [switch + 2, end), where
"switch" is the first plan switch after S (a switch before S is the policy correcting the profile
to the measured stage times; "before" leaves out the 2 steps from such a switch).
Reported: steps_to_detect (first step on a new plan after S, minus S), pause_ms (largest migration time of the
switch step over ranks), the three throughputs, fraction_of_best_static = after / static, and
fraction_of_ceiling = after / (before * (p - 1 + 1/s) / p) with s = 2 (the most a p-worker pipeline
can keep when one worker runs at 1/s speed).

Writes `bench/results/rebalance.json` (atomically) and `bench/results/rebalance.png` (throughput
over steps, slowdown and switches marked). Timings on a shared 2-core machine are noisy: 4 workers
share 2 cores, so compare numbers from one run only.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from model_parallel.coordinator.local import CoordinatorProcess  # noqa: E402
from model_parallel.coordinator.policy import default_solver  # noqa: E402
from model_parallel.fileio import atomic_write, atomic_write_json  # noqa: E402
from model_parallel.graph.io import save_graph  # noqa: E402
from model_parallel.graph.plan import write_plan  # noqa: E402
from model_parallel.runtime.launch import LocalWorld, worker_commands  # noqa: E402
from model_parallel.runtime.observe.metrics_read import read_metrics  # noqa: E402

logger = logging.getLogger("bench.rebalance")
TOKEN = "bench-rebalance"
RESULTS = REPO / "bench" / "results"


class FlatMLP(torch.nn.Module):
    """`depth` Linear(width, width)+ReLU blocks as flat attributes `layer0..` and a `head`: uniform per-layer cost.

    (Flat attribute names rather than StackedMLP's nn.Sequential "0", "1", ...: the worker's
    `--graph` path looks layers up by their original dotted target.)
    """

    def __init__(self, width: int, depth: int, num_classes: int = 10) -> None:
        super().__init__()
        self.depth = depth
        for index in range(depth):
            setattr(self, f"layer{index}", torch.nn.Linear(width, width))
        self.head = torch.nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index in range(self.depth):
            x = torch.relu(getattr(self, f"layer{index}")(x))
        return self.head(x)


def build_graph(args: argparse.Namespace, directory: Path):
    """Profile the MLP at microbatch size; the workers rebuild it from graph.json (same seed, same weights)."""
    import torch.nn.functional as F

    from model_parallel.profiler.api import profile

    torch.manual_seed(0)
    model = FlatMLP(args.width, args.depth)
    micro = args.batch_size // args.num_microbatches
    example = torch.randn(micro, args.width)
    target = torch.randint(0, 10, (micro,))
    graph = profile(model, (example,), lambda out: F.cross_entropy(out, target), iterations=5)
    save_graph(graph, directory / "graph.json")
    return graph


def run_world(args: argparse.Namespace, directory: Path, plan: Path, steps: int, slowdown_after: int,
              coordinator: str = "") -> Path:
    metrics = directory / "metrics"
    worker_args = ["--graph", directory / "graph.json", "--plan", plan, "--steps", steps, "--batch_size", args.batch_size,
                   "--num_microbatches", args.num_microbatches, "--metrics", metrics / "rank{rank}.jsonl",
                   "--slowdown", args.factor, "--slowdown_rank", args.slow_rank, "--slowdown_after_step", slowdown_after,
                   "--timeout", 60]
    if coordinator:
        worker_args += ["--coordinator", coordinator, "--token", TOKEN]
    with LocalWorld(worker_commands(worker_args, args.workers)) as world:
        result = world.wait(timeout=args.world_timeout)
    if not result.ok:
        raise SystemExit(f"a benchmark world failed:\n{result.summary()}")
    return metrics


def per_step(metrics: Path) -> list[dict]:
    """One row per step: pipeline throughput (slowest rank), plan version, largest migration time."""
    by_step: dict[int, list[dict]] = {}
    for record in read_metrics(metrics):
        by_step.setdefault(int(record["step"]), []).append(record)
    rows = []
    for step in sorted(by_step):
        records = by_step[step]
        rows.append({
            "step": step,
            "samples_per_s": min(r["samples_per_s"] for r in records),
            "plan_version": max(r["plan_version"] for r in records),
            "migration_ms": max(r.get("migration_ms", 0.0) for r in records),
        })
    return rows


def median_of(rows: list[dict], start: int, stop: int, skip: tuple[int, ...] = ()) -> float:
    """Median throughput over steps [start, stop), leaving out the steps in `skip`."""
    values = [r["samples_per_s"] for r in rows if start <= r["step"] < stop and r["step"] not in skip]
    return statistics.median(values) if values else float("nan")


def plot(rows: list[dict], static: list[dict], args: argparse.Namespace, switches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([r["step"] for r in rows], [r["samples_per_s"] for r in rows], label="live (coordinator, auto policy)")
    if static:
        value = median_of(static, args.warmup, 10 ** 9)
        ax.axhline(value, color="green", linestyle=":", label=f"best static plan for the new speeds ({value:.0f}/s)")
    ax.axvline(args.slow_step, color="red", linestyle="--", label=f"rank {args.slow_rank} slowed {args.factor:g}x")
    for index, step in enumerate(switches):
        ax.axvline(step, color="black", linestyle="-.", label="plan switch" if index == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s (slowest rank)")
    ax.set_title(f"Live rebalancing: {args.workers}-stage MLP (width {args.width}, depth {args.depth})")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, lambda f: f.write(buffer.getvalue()), binary=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (about two minutes)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--num_microbatches", type=int, default=4)
    parser.add_argument("--factor", type=float, default=2.0, help="slowdown factor s")
    parser.add_argument("--slow_rank", type=int, default=1)
    parser.add_argument("--slow_step", type=int, default=None, help="step S at which the worker slows (default 40, quick 20)")
    parser.add_argument("--steps", type=int, default=None, help="steps of the live run (default 150, quick 70)")
    parser.add_argument("--static_steps", type=int, default=None, help="steps of the static run (default 60, quick 30)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world_timeout", type=float, default=300.0)
    parser.add_argument("--out", default=str(RESULTS / "rebalance.json"))
    args = parser.parse_args(argv)
    args.slow_step = args.slow_step if args.slow_step is not None else (20 if args.quick else 40)
    args.steps = args.steps or (70 if args.quick else 150)
    args.static_steps = args.static_steps or (30 if args.quick else 60)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    started = time.perf_counter()
    ranks = list(range(args.workers))
    with tempfile.TemporaryDirectory(prefix="bench_rebalance_") as tmp:
        work = Path(tmp)
        bar = tqdm(total=3, desc="rebalance bench", unit="phase")
        graph = build_graph(args, work)
        balanced = default_solver(graph, ranks, [1.0] * args.workers)
        speeds = [1.0 / args.factor if r == args.slow_rank else 1.0 for r in ranks]
        best_static = default_solver(graph, ranks, speeds)
        write_plan(balanced, work / "plan_balanced.json")
        write_plan(best_static, work / "plan_static.json")
        bar.update(1)
        bar.set_postfix_str("live run")
        with CoordinatorProcess(work / "graph.json", work / "plan_balanced.json", TOKEN, workdir=work / "coordinator",
                                extra=["--policy", "auto", "--window", "8", "--cooldown-steps", "10",
                                       "--threshold", "0.1"]) as coordinator:
            live_dir = work / "live"
            live_dir.mkdir()
            (live_dir / "graph.json").write_bytes((work / "graph.json").read_bytes())
            live = per_step(run_world(args, live_dir, work / "plan_balanced.json", args.steps, args.slow_step,
                                      coordinator.address))
            coordinator.wait(timeout=30)
            coordinator_status = json.loads(coordinator.status_file.read_text()) if coordinator.status_file.exists() else {}
        bar.update(1)
        bar.set_postfix_str("best static run")
        static_dir = work / "static"
        static_dir.mkdir()
        (static_dir / "graph.json").write_bytes((work / "graph.json").read_bytes())
        static = per_step(run_world(args, static_dir, work / "plan_static.json", args.static_steps, 0))
        bar.update(1)
        bar.close()

    switches = [r["step"] for prev, r in zip(live, live[1:]) if r["plan_version"] > prev["plan_version"]]
    # A switch before S is the policy correcting the profile (calibration), not the straggler.
    early = [s for s in switches if s <= args.slow_step]
    late = [s for s in switches if s > args.slow_step]
    first_switch = late[0] if late else None
    before = median_of(live, args.warmup, args.slow_step, skip=tuple(s + k for s in early for k in (0, 1)))
    slowed = median_of(live, args.slow_step + 1, first_switch if first_switch is not None else 10 ** 9)
    after = median_of(live, first_switch + 2, 10 ** 9) if first_switch is not None else float("nan")
    static_tp = median_of(static, args.warmup, 10 ** 9)
    p, s = args.workers, args.factor
    ceiling = (p - 1 + 1 / s) / p
    pause = max((r["migration_ms"] for r in live if r["step"] == first_switch), default=float("nan"))

    def clean(value: float) -> float | None:
        return None if value != value else round(value, 4)

    result = {
        "steps_to_detect": (first_switch - args.slow_step) if first_switch is not None else None,
        "pause_ms": clean(pause),
        "throughput_before": clean(before),
        "throughput_slowed": clean(slowed),
        "throughput_after": clean(after),
        "throughput_best_static": clean(static_tp),
        "fraction_of_best_static": clean(after / static_tp) if first_switch is not None else None,
        "fraction_of_ceiling": clean(after / (before * ceiling)) if first_switch is not None else None,
        "ceiling_fraction_of_before": round(ceiling, 4),
        "switch_steps": switches,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "plans": {"balanced": [len(st.node_ids) for st in balanced.stages],
                  "best_static": [len(st.node_ids) for st in best_static.stages],
                  "final_live": [len(st["node_ids"]) for st in coordinator_status.get("plan", {}).get("stages", [])]},
        "coordinator_history": coordinator_status.get("history", []),
        "coordinator_decisions": coordinator_status.get("decisions", []),
        "live_steps": live,
        "static_steps": static,
        "seconds": round(time.perf_counter() - started, 1),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
    }
    out = Path(args.out)
    atomic_write_json(out, result)
    plot(live, static, args, switches, out.with_suffix(".png"))
    print(f"steps to detect {result['steps_to_detect']}, pause {result['pause_ms']} ms")
    print(f"throughput (samples/s): before {result['throughput_before']}, slowed {result['throughput_slowed']}, "
          f"after {result['throughput_after']}, best static {result['throughput_best_static']}")
    print(f"after / best static = {result['fraction_of_best_static']} (goal >= 0.95); "
          f"after / ceiling = {result['fraction_of_ceiling']}")
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
