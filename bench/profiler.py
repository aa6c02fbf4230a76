"""Profiler benchmark: accuracy (sum of per-node times / a measured training step) and overhead, per model.

    python bench/profiler.py            # resnet18/50/152 at 32x32 and 224x224, batch 8 (several minutes)
    python bench/profiler.py --quick    # a subset in about a minute

Writes bench/results/profiler.json: {"rows": [{"model", "image_size", "batch_size", "accuracy_ratio",
"overhead_ratio", "measured_step_ms", "sum_layer_ms", ...}], "settings": {...}}. The accuracy bar is
0.85 <= accuracy_ratio <= 1.15. Timings are only meaningful on a quiet machine: the load average
before and after each row is recorded so a contended run can be recognised.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a plain script from a checkout
    try:
        import model_parallel  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import datetime
import os
import platform
from collections.abc import Sequence
from typing import Any, Optional

import torch

from model_parallel.fileio import atomic_write_json
from model_parallel.profiler.image_classification.classifier import profile_arch

FULL = [(arch, size) for arch in ("resnet18", "resnet50", "resnet152") for size in (32, 224)]
QUICK = [("resnet18", 32), ("resnet50", 32), ("resnet18", 224)]
LOW, HIGH = 0.85, 1.15
RESULTS = Path(__file__).resolve().parent / "results" / "profiler.json"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(f'{a}@{s}' for a, s in QUICK)}")
    parser.add_argument("--models", nargs="*", default=None, metavar="ARCH@SIZE", help="e.g. resnet50@224 (overrides the list)")
    parser.add_argument("-b", "--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadiest on a shared machine)")
    parser.add_argument("--rounds", type=int, default=2, help="profiling passes per model, interleaved with step timing")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--step-iterations", type=int, default=5, help="training steps timed before/between/after passes")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="'cpu' counts this process's CPU time only: use it on a machine shared with busy processes")
    parser.add_argument("--timing", choices=("auto", "insitu", "replay"), default="insitu",
                        help="node timing: 'insitu' (CPU only; default), 'replay', or 'auto' (what the command line uses: replay, resumable)")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def run_row(arch: str, size: int, args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    _, summary = profile_arch(arch, args.batch_size, size, device=args.device, warmup=args.warmup,
                              iterations=args.iterations, num_classes=1000, step_iterations=args.step_iterations,
                              rounds=args.rounds, clock=args.clock, node_timing=args.timing)
    return {
        "model": arch,
        "image_size": size,
        "batch_size": args.batch_size,
        "accuracy_ratio": round(summary["accuracy_ratio"], 4),
        "overhead_ratio": round(summary["overhead_ratio"], 2),
        "measured_step_ms": round(summary["measured_step_ms"], 3),
        "sum_layer_ms": round(summary["sum_layer_ms"], 3),
        "sum_forward_ms": round(summary["sum_forward_ms"], 3),
        "sum_backward_ms": round(summary["sum_backward_ms"], 3),
        "profiling_seconds": round(summary["profiling_seconds"], 2),
        "num_nodes": summary["num_nodes"],
        "within_bar": LOW <= summary["accuracy_ratio"] <= HIGH,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.models:
        todo = [(m.split("@")[0], int(m.split("@")[1]) if "@" in m else 224) for m in args.models]
    else:
        todo = QUICK if args.quick else FULL
    print(f"{'model':<10} {'size':>5} {'batch':>5} {'step ms':>10} {'layers ms':>10} {'ratio':>7} {'overhead':>9}  load", flush=True)
    rows = []
    for arch, size in todo:
        row = run_row(arch, size, args)
        rows.append(row)
        mark = "" if row["within_bar"] else f"  OUTSIDE {LOW}-{HIGH}"
        print(f"{arch:<10} {size:>5} {row['batch_size']:>5} {row['measured_step_ms']:>10.2f} {row['sum_layer_ms']:>10.2f} "
              f"{row['accuracy_ratio']:>7.3f} {row['overhead_ratio']:>8.1f}x  {row['load_average'][0]:.1f}->{row['load_average'][1]:.1f}{mark}",
              flush=True)
    result = {
        "rows": rows,
        "settings": {
            "quick": args.quick, "threads": args.threads, "rounds": args.rounds, "warmup": args.warmup,
            "iterations": args.iterations, "step_iterations": args.step_iterations, "device": args.device,
            "clock": args.clock, "timing": args.timing, "accuracy_bar": [LOW, HIGH],
        },
        "environment": {
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    atomic_write_json(args.output, result)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
