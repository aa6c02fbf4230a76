"""Memory benchmark: a worker's resident memory stays flat over a long run (issue 22, item 6).

    python bench/memory_flat.py                       # 20,000 steps (about two minutes on 2 cores)
    python bench/memory_flat.py --steps 300 --window 50 --out /tmp/m.json   # the smoke run tests use

Runs `PipelineTrainer` (the engine every worker runs, with its heartbeat thread) on the built-in
MLP in a one-rank gloo world in this process, writing per-step metrics JSONL like a worker does,
and samples the resident set size (VmRSS) every `--sample_every` steps. The memory a run keeps
per step (results, metrics records) is a window of the last `--window` steps (default: the
runtime's HISTORY_WINDOW / RECORD_WINDOW); the JSONL on disk keeps every step.

Writes JSON (atomically) to `--out` (default bench/results/memory_flat.json): the RSS samples, the
least-squares slope in bytes per step over the samples after the first `--warmup` fraction of the
run (allocator warm-up and the windows filling), the lengths of the in-memory containers at the
end, the number of JSONL lines, and whether the heartbeat thread still ran after `close()`.
Before the windows, RSS grew about 2 KB per step; flat means a slope of a few bytes per step.
"""
from __future__ import annotations

import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; elsewhere the peak, which can only grow)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of (step, bytes): bytes per step."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def run(steps: int, sample_every: int, window: int, warmup: float, workdir: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from model_parallel.api.trainer import PipelineTrainer
    from model_parallel.runtime import engine as engine_mod
    from model_parallel.runtime.build.zoo import recipe
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.launch import free_port
    from model_parallel.runtime.observe import metrics as metrics_mod

    if window:
        engine_mod.HISTORY_WINDOW = metrics_mod.RECORD_WINDOW = window
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    r = recipe("mlp")
    metrics_path = workdir / "rank{rank}.jsonl"
    config = TrainConfig(batch_size=8, num_microbatches=2)
    options = RunOptions(timeout=30.0, metrics=str(metrics_path), progress=False)
    trainer = PipelineTrainer(r.model(0), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), r.data(8, 0), config,
                              options=options, criterion=r.criterion)
    samples: list[tuple[int, int]] = []
    engine = trainer.runner
    finished = threading.Event()

    def sample() -> None:  # beside the training loop: one `train(steps)` call, as a worker makes it
        last = 0
        while not finished.wait(0.05):
            step = engine.next_step
            if step >= last + sample_every:
                samples.append((step, rss_bytes()))
                last = step

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    started = time.monotonic()
    sampler.start()
    try:
        trainer.train(steps)
    finally:
        finished.set()
        sampler.join()
        trainer.close()
    samples.append((engine.next_step, rss_bytes()))
    seconds = time.monotonic() - started
    heartbeat_alive = bool(trainer.health._thread is not None and trainer.health._thread.is_alive())
    lines = sum(1 for _ in open(str(metrics_path).replace("{rank}", "0"), encoding="utf-8"))
    dist.destroy_process_group()
    steady = [p for p in samples if p[0] > warmup * steps]
    return {
        "steps": steps,
        "seconds": round(seconds, 1),
        "window": window or engine_mod.HISTORY_WINDOW,
        "rss_samples": [{"step": s, "rss_mb": round(b / 2**20, 3)} for s, b in samples],
        "slope_bytes_per_step": round(slope(steady), 3),
        "growth_mb_after_warmup": round((steady[-1][1] - steady[0][1]) / 2**20, 3) if len(steady) > 1 else 0.0,
        "history_len": len(engine.history),
        "records_len": len(engine.metrics.records),
        "jsonl_lines": lines,
        "heartbeat_alive_after_close": heartbeat_alive,
    }


def main(argv: Any = None) -> int:
    from model_parallel.cli.common import ArgumentParser
    from model_parallel.fileio import atomic_write_json

    parser = ArgumentParser(prog="bench/memory_flat.py", description="RSS over a long run of one worker's engine.")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--sample_every", type=int, default=500, help="steps between two RSS samples (default 500)")
    parser.add_argument("--window", type=int, default=0, help="in-memory window (default: the runtime's)")
    parser.add_argument("--warmup", type=float, default=0.25, help="fraction of the run left out of the slope")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "memory_flat.json"))
    args = parser.parse_args(argv)
    if args.steps < 1 or args.sample_every < 1 or not 0 <= args.warmup < 1:
        parser.error("--steps and --sample_every must be >= 1 and --warmup in [0, 1)")
    with tempfile.TemporaryDirectory(prefix="memory_flat_") as workdir:
        result = run(args.steps, min(args.sample_every, args.steps), args.window, args.warmup, Path(workdir))
    atomic_write_json(Path(args.out), result)
    print(f"{result['steps']} steps in {result['seconds']} s: RSS slope {result['slope_bytes_per_step']} bytes/step "
          f"after warm-up ({result['growth_mb_after_warmup']} MB), history {result['history_len']}, records "
          f"{result['records_len']}, JSONL lines {result['jsonl_lines']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
