"""How much this machine's speed drifts: the same fixed work timed over and over, on the CPU clock.

    python bench/machine_drift.py              # 60 s alone, then 60 s with one copy per core
    python bench/machine_drift.py --seconds 20 # quicker

Predicted-vs-measured comparisons (bench/runtime.py, the demo's report) hold a profile taken at one
moment against a run at another. If the machine itself runs the same work at different speeds from
one moment to the next, that difference lands in the comparison whatever the cost model does. This
measures it: one process per copy, one thread each, each timing a fixed forward + backward (a
1024-wide, 4-layer MLP on 16 rows, about 10 ms, warm caches) back to back, its own CPU time
(`time.thread_time`: being descheduled is not counted). Reported per phase: median, 10th and 90th
percentile, the slowest and fastest 5-second window (median of each), and their ratio.
Writes bench/results/machine_drift.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "machine_drift.json"
WINDOW_S = 5.0


def _time_work(seconds: float) -> list[tuple[float, float]]:
    """(start, CPU ms) of each repetition of the fixed work for `seconds`."""
    import torch

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    x = torch.randn(16, 1024, generator=generator)
    samples: list[tuple[float, float]] = []
    end = time.time() + seconds
    while time.time() < end:
        start, cpu = time.time(), time.thread_time()
        layers(x).sum().backward()
        samples.append((start, (time.thread_time() - cpu) * 1000.0))
    return samples[3:]  # the first repetitions warm up


def summarize(samples: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Median, p10, p90 of the repetitions, and the slowest / fastest 5 s window's median."""
    times = sorted(ms for _, ms in samples)
    first = samples[0][0]
    windows: dict[int, list[float]] = {}
    for start, ms in samples:
        windows.setdefault(int((start - first) // WINDOW_S), []).append(ms)
    medians = [statistics.median(v) for v in windows.values() if len(v) >= 5]
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return {"repetitions": len(times), "median_ms": statistics.median(times), "p10_ms": pick(0.1), "p90_ms": pick(0.9),
            "window_medians_ms": medians, "slowest_over_fastest_window": max(medians) / min(medians) if medians else None}


def run_phase(copies: int, seconds: float) -> list[dict[str, Any]]:
    """`copies` processes timing the work at once; each one's summary."""
    command = [sys.executable, str(Path(__file__).resolve()), "--_copy", "--seconds", str(seconds)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(copies)]
    out = []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=seconds + 120)
            if proc.returncode != 0:
                raise SystemExit(f"bench/machine_drift.py: a timing process exited with {proc.returncode}")
            out.append(json.loads(stdout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds per phase (default 60)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--_copy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._copy:
        print(json.dumps(summarize(_time_work(args.seconds))))
        return 0
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    phases = {"alone": run_phase(1, args.seconds), "one_per_core": run_phase(cores, args.seconds)}
    report = {"benchmark": "machine_drift", "cores": cores, "seconds_per_phase": args.seconds,
              "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0], "phases": phases}
    from model_parallel.fileio import atomic_write_json

    atomic_write_json(args.out, report)
    print(f"fixed fwd+bwd, CPU ms per repetition (load before {load_before:.1f}, {cores} cores)")
    print(f"{'phase':<14} {'copy':>4} {'median':>7} {'p10':>6} {'p90':>6} {'fastest 5s':>10} {'slowest 5s':>10} {'ratio':>6}")
    for name, copies in phases.items():
        for index, s in enumerate(copies):
            medians = s["window_medians_ms"]
            print(f"{name:<14} {index:>4} {s['median_ms']:>7.2f} {s['p10_ms']:>6.2f} {s['p90_ms']:>6.2f} "
                  f"{min(medians):>10.2f} {max(medians):>10.2f} {s['slowest_over_fastest_window']:>6.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
