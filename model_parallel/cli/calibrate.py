"""Measure this machine's stage-time constants once (`optimizer.fidelity.Calibration`) and store them.

    python -m model_parallel.cli.calibrate --out profiles/calibration.json   # a 2-rank gloo world, ~10 s

Three measurements, each in the conditions of a real run (one thread per rank, gloo on localhost):

- link: ping-pong between rank 0 and 1; latency = half the round trip of a 4-byte tensor, bandwidth =
  bytes / (half the round trip of 4 MB - latency); medians.
- optimizer: one `step()` of SGD (momentum 0.9) and AdamW on 8 MB of weights with gradients set, per MB.
- runtime overhead: `PipelineEngine` training a 2-stage model of two 4x4 linear layers with 8
  microbatches, so compute is next to nothing: (busy - compute - optimizer) / m - one message latency,
  median over the steps, the larger of the two ranks. Busy is `busy_ms` below (the same measure the
  benchmark compares predictions with).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from model_parallel.optimizer.fidelity import Calibration
from model_parallel.runtime.metrics import busy_ms

logger = logging.getLogger(__name__)

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def optimizer_ms_per_mb(kind: str, megabytes: float = 8.0, reps: int = 5) -> float:
    """Milliseconds of one optimizer step per MB of float32 weights (best of `reps`, after two warm-ups)."""
    weight = nn.Parameter(torch.randn(int(megabytes * 1e6 / 4)))
    weight.grad = torch.randn_like(weight)
    optimizer = OPTIMIZERS[kind]([weight])
    samples = []
    for rep in range(reps + 2):
        start = time.perf_counter()
        optimizer.step()
        if rep >= 2:
            samples.append((time.perf_counter() - start) * 1e3)
    return min(samples) / megabytes


def link(rank: int, reps: int = 30) -> tuple[float, float]:
    """(latency ms, bandwidth bytes/s) between ranks 0 and 1, by ping-pong; both ranks call it."""
    def half_round_trip(numel: int, count: int) -> float:
        buffer = torch.zeros(numel)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            times.append((time.perf_counter() - start) / 2)
        return statistics.median(times[2:])

    latency = half_round_trip(1, reps)
    big = 1 << 20  # 4 MB of float32
    transfer = max(half_round_trip(big, max(reps // 3, 5)) - latency, 1e-6)
    return latency * 1e3, big * 4 / transfer


def runtime_overhead_ms(latency_ms: float, optimizer_kind: str = "sgd", steps: int = 30, microbatches: int = 8) -> float:
    """The engine's fixed cost per microbatch and stage on a model whose compute is next to nothing."""
    from model_parallel.profiler.api import profile
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.data import SyntheticData
    from model_parallel.runtime.engine import PipelineEngine
    from model_parallel.runtime.stages import even_plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    graph = profile(model, (torch.zeros(1, 4),), iterations=1, warmup=0)  # times only pick the cut
    engine = PipelineEngine(graph=graph, plan=even_plan(graph, 2), model=model, criterion=nn.functional.cross_entropy,
                            optimizer_factory=OPTIMIZERS[optimizer_kind], dataset=SyntheticData(microbatches, (4,), 4),
                            config=TrainConfig(batch_size=microbatches, num_microbatches=microbatches),
                            options=RunOptions(timeout=60, progress=False))
    engine.train(steps)
    records = list(engine.metrics.records)[5:]  # after warm-up
    per_step = [(busy_ms(r) - r.compute_ms) / microbatches - latency_ms for r in records]
    return max(statistics.median(per_step), 0.0)


def measure(rank: int, world_size: int) -> dict[str, Any]:
    """Every rank of an initialised world of 2 calls this; returns this rank's measurements."""
    latency, bandwidth = link(rank)
    overhead = runtime_overhead_ms(latency)
    return {"latency_ms": latency, "bandwidth": bandwidth, "overhead_ms": overhead,
            "optimizer_ms_per_mb": {kind: optimizer_ms_per_mb(kind) for kind in OPTIMIZERS}}


def combine(per_rank: Sequence[Mapping[str, Any]]) -> Calibration:
    """The ranks' measurements -> one Calibration (the slower rank's overhead, optimizer: the faster)."""
    return Calibration(
        microbatch_overhead_ms=max(r["overhead_ms"] for r in per_rank),
        link_latency_ms=statistics.mean(r["latency_ms"] for r in per_rank),
        link_bandwidth=statistics.mean(r["bandwidth"] for r in per_rank),
        optimizer_ms_per_mb={kind: min(r["optimizer_ms_per_mb"][kind] for r in per_rank) for kind in OPTIMIZERS},
        machine={"platform": platform.platform(), "cpus": os.cpu_count(), "threads_per_rank": 1,
                 "load": list(os.getloadavg()), "torch": torch.__version__},
    )


def _worker(rank: int, port: int, out: str) -> int:
    from model_parallel.fileio import atomic_write_json

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        result = measure(rank, 2)
    finally:
        dist.destroy_process_group()
    atomic_write_json(out, result)
    return 0


def calibrate(out: Optional[Path] = None, timeout: float = 180.0) -> Calibration:
    """Start a 2-rank world (under a deadline, always reaped), measure, and write `out` when given."""
    from model_parallel.fileio import atomic_write_json
    from model_parallel.runtime.launch import free_port, launch

    with tempfile.TemporaryDirectory(prefix="calibrate_") as tmp:
        port = free_port()
        paths = [Path(tmp) / f"rank{rank}.json" for rank in range(2)]
        commands = [[sys.executable, "-m", "model_parallel.cli.calibrate", "--_rank", str(rank), "--_port", str(port),
                     "--out", str(paths[rank])] for rank in range(2)]
        result = launch(commands, timeout=timeout, env={"OMP_NUM_THREADS": "1"})
        if not result.ok:
            raise RuntimeError(f"calibration world failed:\n{result.summary()}")
        calibration = combine([json.loads(p.read_text()) for p in paths])
    if out is not None:
        atomic_write_json(out, calibration.to_json())
    return calibration


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_parallel.cli.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="calibration JSON to write")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._rank is not None:
        return _worker(args._rank, args._port, args.out)
    try:
        calibration = calibrate(Path(args.out), args.timeout)
    except RuntimeError as error:
        parser.exit(2, f"{parser.prog}: error: {str(error).splitlines()[0]}\n")
    print(json.dumps(calibration.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
