"""Measure this machine's stage-time constants once (`optimizer.fidelity.Calibration`) and store them.

    python -m model_parallel.cli.calibrate --out profiles/calibration.json   # a 2-rank gloo world + the timeshare ring, ~30 s

Every number is on one clock (`--clock`, stored as `Calibration.clock`): "cpu" (default) = the
process's CPU time, the clock that holds on a shared machine (see optimizer/fidelity.py); "wall" =
perf_counter. Measurements, each in the conditions of a real run (one thread per rank, gloo on localhost):

- link: ping-pong between rank 0 and 1 through the runtime's message layer (`runtime.wire.comm`, as the
  engine sends a boundary), 4-byte and 1 MB messages alternating; latency = the median half round
  trip of 4 bytes, bandwidth = 1 MB / the median of each pair's difference (at least one copy of
  1 MB). On the CPU clock a round trip is one send and one receive of this rank: half of its CPU
  time prices either.
- optimizer: one `step()` of SGD (momentum 0.9) and AdamW on 64 MB of weights with gradients set, per MB.
- accumulate curve: a backward through linear layers with `.grad` set minus one with `.grad` empty,
  per MB: what autograd adds for every microbatch's weight gradient after the first (the profile's
  replays never accumulate), per tensor size (square layers of 256 to 2048, about 16 MB in all
  each): the price per MB grows about 4x from tensors the core's cache holds to ones it does not, so
  the model prices each node's weights at its size (`Calibration.accumulate_curve`); its 16 MB point
  is also stored as the flat `accumulate_ms_per_mb` that older calibrations had.
- timeshare factor (measured by the main process after the world): CPU ms per action of a
  transformer layer when 2 x cores processes time-share the cores in a ring that passes `cores`
  tokens (each forward or backward starts right after a blocking wait, on caches other processes
  used, as pipeline ranks do when they outnumber the cores) over the same actions in one process
  alone (`Calibration.timeshare_factor`, >= 1). Found by measurement (2 cores): the GPT stages'
  compute inside a 4-rank engine ran 1.07-1.15x their profile while the same stage modules timed
  alone matched it within 3 %; evicting the caches before every action reproduced it in one process.
- co-running factor (`Calibration.corun_factor`, >= 1; measured in the world): CPU time per forward
  + backward of the same transformer layer while both ranks compute at once, over one rank alone
  (the other waiting at a barrier), the median over 5 alternations. The profile times every node in
  one process alone; a pipeline's ranks compute at the same time. On the 2-core development VM the
  ratio read 1.01-1.46 in three measurements a minute apart (both cores are likely hyperthreads of
  one host core); on machines with real cores it reads about 1.
- runtime overhead: `PipelineEngine` training a 2-stage model of two 4x4 linear layers with 8
  microbatches, profiled on the same clock: (measured - predicted without overhead) / m per stage,
  median over the steps, the larger of the two ranks; so whatever the engine costs per microbatch
  beyond the priced terms is measured, and a faster (or slower) runtime is picked up by re-running.
  Measured is `optimizer.fidelity.measured_ms` (the same measure the benchmark and the demo compare
  predictions with).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
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

from model_parallel.cli.timeshare import timeshare_factor, timeshare_workload
from model_parallel.optimizer.fidelity import CLOCKS, Calibration, predict_stage_ms
from model_parallel.runtime.observe.metrics import measured_ms

logger = logging.getLogger(__name__)

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def now_s(clock: str) -> float:
    """Seconds on `clock`: the process's CPU time (all threads) or perf_counter."""
    return time.process_time() if clock == "cpu" else time.perf_counter()


def _best_ms(work: Any, clock: str, reps: int) -> float:
    """Best of `reps` timings of `work()` on `clock`, after two warm-ups."""
    samples = []
    for rep in range(reps + 2):
        start = now_s(clock)
        work()
        if rep >= 2:
            samples.append((now_s(clock) - start) * 1e3)
    return min(samples)


def optimizer_ms_per_mb(kind: str, megabytes: float = 64.0, reps: int = 5, clock: str = "wall") -> float:
    """Milliseconds of one optimizer step per MB of float32 weights (best of `reps`, after two warm-ups).
    64 MB, more than the caches hold: in a run the weights went cold during the step's microbatches."""
    weight = nn.Parameter(torch.randn(int(megabytes * 1e6 / 4)))
    weight.grad = torch.randn_like(weight)
    optimizer = OPTIMIZERS[kind]([weight])
    return _best_ms(optimizer.step, clock, reps) / megabytes


def _accumulate_difference(model: nn.Module, x: torch.Tensor, reps: int, clock: str) -> float:
    """Ms per MB of `model`'s float32 weights that a backward costs more when `.grad` already holds a
    gradient (autograd adds into it) than when it is empty (autograd stores its result): best of `reps`
    each, the two cases interleaved."""
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    samples: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(reps + 2):
        for accumulate in (False, True):
            if not accumulate:
                model.zero_grad(set_to_none=True)
            loss = model(x).sum()
            start = now_s(clock)
            loss.backward()
            if rep >= 2:
                samples[accumulate].append((now_s(clock) - start) * 1e3)
    return max(min(samples[True]) - min(samples[False]), 0.0) / megabytes


CURVE_WIDTHS = (256, 512, 1024, 2048)  # square linear layers: 0.25, 1, 4 and 16 MB weight tensors


def accumulate_curve(reps: int = 7, clock: str = "wall", megabytes: float = 16.0) -> tuple[tuple[float, float], ...]:
    """((tensor bytes, accumulate ms per MB), ...): `_accumulate_difference` for layers of each width in
    `CURVE_WIDTHS`, about `megabytes` of weights each (batch 8)."""
    torch.manual_seed(0)
    curve = []
    for width in CURVE_WIDTHS:
        layers = max(1, round(megabytes * 1e6 / (width * width * 4)))
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        curve.append((float(width * width * 4), _accumulate_difference(model, torch.randn(8, width), reps, clock)))
    return tuple(curve)


def corun_factor(rank: int, world_size: int, phases: int = 5, pairs: int = 30) -> float:
    """This rank's CPU time per forward + backward of the reference stage (`timeshare_workload`) while
    every rank of the world computes it at once, over the same alone (the others waiting at a barrier,
    which costs no CPU): the median ratio over `phases` alternations, so a change of the machine's
    speed between the two hits both sides of one ratio. Every rank of the world calls it together."""
    module, x = timeshare_workload()
    inputs = x.clone().requires_grad_()

    def timed() -> float:  # median thread CPU ms per forward + backward
        samples = []
        for _ in range(pairs):
            start = time.thread_time()
            module(inputs).sum().backward()
            samples.append((time.thread_time() - start) * 1e3)
        return statistics.median(samples)

    timed()  # warm-up
    ratios = []
    for _ in range(phases):
        alone = math.nan
        for turn in range(world_size):
            dist.barrier()
            if turn == rank:
                alone = timed()
        dist.barrier()
        ratios.append(timed() / alone)
    return statistics.median(ratios)


def link(rank: int, reps: int = 30, clock: str = "wall", timeout: float = 60.0) -> tuple[float, float]:
    """(latency ms, bandwidth bytes/s) of one boundary message between ranks 0 and 1, by ping-pong through
    the runtime's own message layer (`runtime.wire.comm` with a header cache, as the engine sends them), so
    its per-message Python and packing are priced with the link; both ranks call it."""
    from model_parallel.runtime.wire import comm

    cache = comm.HeaderCache()

    def half_round_trip(numel: int) -> float:
        value = [torch.zeros(numel)]
        start = now_s(clock)
        if rank == 0:
            comm.send_values(value, 1, comm.TAG_ACTIVATION, cache=cache, stream=numel).wait(timeout)
            comm.PendingRecv(1, comm.TAG_GRADIENT, cache=cache, stream=numel).wait(timeout)
        else:
            value = comm.PendingRecv(0, comm.TAG_ACTIVATION, cache=cache, stream=numel).wait(timeout)
            comm.send_values(value, 0, comm.TAG_GRADIENT, cache=cache, stream=numel).wait(timeout)
        return (now_s(clock) - start) / 2

    big = 1 << 18  # 1 MB of float32: the size of a typical boundary here, not a bulk transfer
    # Small and big messages alternate, and the transfer time is the median of each pair's difference:
    # measured one after the other, a change of machine load between the two series made the
    # difference anything (a 1 ms latency and 500 GB/s under load 4).
    small_times, differences = [], []
    for rep in range(reps + 2):  # the first two carry the headers
        small, large = half_round_trip(1), half_round_trip(big)
        if rep >= 2:
            small_times.append(small)
            differences.append(large - small)
    # A message is copied at least once on its way: the transfer takes no less than one copy of it here.
    source = torch.zeros(big)
    copy = _best_ms(lambda: source.clone(), clock, 5) / 1e3
    transfer = max(statistics.median(differences), copy)
    return statistics.median(small_times) * 1e3, big * 4 / transfer


def runtime_overhead_ms(partial: Calibration, optimizer_kind: str = "sgd", steps: int = 30, microbatches: int = 8) -> float:
    """The engine's fixed cost per microbatch and stage: on a model whose compute is next to nothing,
    what a step measures beyond the prediction of `partial` (every term but the overhead) per microbatch."""
    from model_parallel.graph.plan import Plan, StagePlan
    from model_parallel.profiler.api import profile
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.data.batches import SyntheticData
    from model_parallel.runtime.engine import PipelineEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    batch = torch.zeros(1, 4), torch.zeros(1, dtype=torch.long)
    graph = profile(model, (batch[0],), lambda out: nn.functional.cross_entropy(out, batch[1]), iterations=5,
                    clock=partial.clock)
    # Split by position, not by the profile's timings: each rank profiles on its own, and a split by
    # time could differ between them (the engine refuses ranks with different plans).
    order = [node.node_id for node in graph.nodes]
    half = len(order) // 2
    plan = Plan(stages=(StagePlan(0, tuple(order[:half]), ranks=(0,)), StagePlan(1, tuple(order[half:]), ranks=(1,))))
    engine = PipelineEngine(graph=graph, plan=plan, model=model, criterion=nn.functional.cross_entropy,
                            optimizer_factory=OPTIMIZERS[optimizer_kind], dataset=SyntheticData(microbatches, (4,), 4),
                            config=TrainConfig(batch_size=microbatches, num_microbatches=microbatches),
                            options=RunOptions(timeout=60, progress=False))
    engine.train(steps)
    stage = dist.get_rank()  # ranks are in stage order
    predicted = predict_stage_ms(graph, plan, num_microbatches=microbatches, calibration=partial,
                                 optimizer=optimizer_kind)[stage].total_ms
    records = list(engine.metrics.records)[5:]  # after warm-up
    per_step = [(measured_ms(r, partial.clock) - predicted) / microbatches for r in records]
    return max(statistics.median(per_step), 0.0)


def measure(rank: int, world_size: int, clock: str = "cpu") -> dict[str, Any]:
    """Every rank of an initialised world of 2 calls this; returns this rank's measurements."""
    latency, bandwidth = link(rank, clock=clock)
    optimizers = {kind: optimizer_ms_per_mb(kind, clock=clock) for kind in OPTIMIZERS}
    curve = accumulate_curve(clock=clock)
    accumulate = curve[-1][1]  # the flat coefficient of older calibrations: its largest size (16 MB tensors)
    partial = Calibration(link_latency_ms=latency, link_bandwidth=bandwidth, optimizer_ms_per_mb=optimizers,
                          accumulate_ms_per_mb=accumulate, accumulate_curve=curve, clock=clock)
    return {"latency_ms": latency, "bandwidth": bandwidth, "overhead_ms": runtime_overhead_ms(partial),
            "optimizer_ms_per_mb": optimizers, "accumulate_ms_per_mb": accumulate, "clock": clock,
            "accumulate_curve": [list(point) for point in curve], "corun_factor": corun_factor(rank, world_size)}


def combine(per_rank: Sequence[Mapping[str, Any]]) -> Calibration:
    """The ranks' measurements -> one Calibration (the slower rank's overhead; optimizer, accumulate: the faster)."""
    return Calibration(
        microbatch_overhead_ms=max(r["overhead_ms"] for r in per_rank),
        link_latency_ms=statistics.mean(r["latency_ms"] for r in per_rank),
        link_bandwidth=statistics.mean(r["bandwidth"] for r in per_rank),
        optimizer_ms_per_mb={kind: min(r["optimizer_ms_per_mb"][kind] for r in per_rank) for kind in OPTIMIZERS},
        accumulate_ms_per_mb=min(r["accumulate_ms_per_mb"] for r in per_rank),
        clock=per_rank[0]["clock"],
        accumulate_curve=tuple((points[0][0], min(y for _, y in points))
                               for points in zip(*(r["accumulate_curve"] for r in per_rank))),
        # Older rank files have no co-running measurement: 1.0, no term.
        corun_factor=max(statistics.median(r.get("corun_factor", 1.0) for r in per_rank), 1.0),
        machine={"platform": platform.platform(), "cpus": os.cpu_count(), "threads_per_rank": 1,
                 "load": list(os.getloadavg()), "torch": torch.__version__},
    )


def _worker(rank: int, port: int, out: str, clock: str = "cpu") -> int:
    from model_parallel.fileio import atomic_write_json

    from model_parallel.allocator import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # as every worker does: allocation costs as in a run
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        result = measure(rank, 2, clock)
    finally:
        dist.destroy_process_group()
    atomic_write_json(out, result)
    return 0


def calibrate(out: Optional[Path] = None, timeout: float = 180.0, clock: str = "cpu") -> Calibration:
    """Start a 2-rank world (under a deadline, always reaped), measure on `clock`, and write `out` when given."""
    from model_parallel.fileio import atomic_write_json
    from model_parallel.runtime.launch import free_port, launch

    with tempfile.TemporaryDirectory(prefix="calibrate_") as tmp:
        port = free_port()
        paths = [Path(tmp) / f"rank{rank}.json" for rank in range(2)]
        commands = [[sys.executable, "-m", "model_parallel.cli.calibrate", "--_rank", str(rank), "--_port", str(port),
                     "--out", str(paths[rank]), "--clock", clock] for rank in range(2)]
        result = launch(commands, timeout=timeout, env={"OMP_NUM_THREADS": "1"})
        if not result.ok:
            raise RuntimeError(f"calibration world failed:\n{result.summary()}")
        calibration = combine([json.loads(p.read_text()) for p in paths])
    # After the world: its ranks would time-share the cores with the ring.
    calibration = dataclasses.replace(calibration, timeshare_factor=timeshare_factor(timeout=timeout))
    if out is not None:
        atomic_write_json(out, calibration.to_json())
    return calibration


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_parallel.cli.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="calibration JSON to write")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--clock", choices=CLOCKS, default="cpu",
                        help="cpu: process CPU time (holds on a shared machine; default); wall: perf_counter")
    parser.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._rank is not None:
        return _worker(args._rank, args._port, args.out, args.clock)
    try:
        calibration = calibrate(Path(args.out), args.timeout, args.clock)
    except RuntimeError as error:
        parser.exit(2, f"{parser.prog}: error: {str(error).splitlines()[0]}\n")
    print(json.dumps(calibration.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
