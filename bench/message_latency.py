"""Per-message latency between sleeping ranks (torch's send/recv and our comm), and the message/compute ratio it gives.

    python bench/message_latency.py                     # p = 4 and 8; a rank sleeps 0, 2 and 8 ms per hop
    python bench/message_latency.py --p 4 --sleep_ms 8 --laps 50

What bench/schedules.py's emulated devices need to know: a pipeline hands each microbatch's activation (and its
gradient back) from rank to rank, and the receiver is usually asleep in an emulated wait or blocked in a receive.
Here tokens ([micro_batch, 16] float32, the emulated boundary) go round a ring of p ranks, in two patterns:
"one token": a rank receives it, sleeps `sleep_ms` (its "compute") and sends it on, the others wait (a pipeline's
fill); "every": every rank holds one, sleeps, sends it on and receives the previous rank's, all at once (the
steady state: p ranks wake, send and receive together on the machine's cores). One lap is p hops; the latency of
one message is (lap - p x slept) / p, the hand-off the emulation adds to every stage action on the critical path. Two transports, in turn, lap by lap:

- torch: `dist.isend` / `dist.irecv` of the tensor (what torch.distributed.pipelining's P2P ops post), wait;
- ours:  `runtime.wire.comm.send_values` / `PendingRecv` with a HeaderCache (the engine's hot path: one packed
  transfer, the receive pre-posted before the sleep, as our executor posts it before computing).

The report: per (p, sleep, transport) the median and p90 latency in ms and, per emulated setting, the ratio
latency / stage action (an action = layers_per_stage x the per-layer wait). Writes bench/results/message_latency.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "message_latency.json"


def _laps_torch(rank: int, p: int, sleep_s: float, laps: int, token: torch.Tensor, every: bool) -> list[float]:
    import torch.distributed as dist

    nxt, prv, out = (rank + 1) % p, (rank - 1) % p, []
    if every:  # every rank at once (a pipeline's steady state): sleep, send on, receive the previous rank's
        for _ in range(laps):
            start = time.perf_counter()
            for _ in range(p):
                time.sleep(sleep_s)
                work = dist.isend(token, nxt, tag=1)
                dist.irecv(token2 := torch.empty_like(token), prv, tag=1).wait()
                work.wait()
                token = token2
            out.append(time.perf_counter() - start)
        return out
    for _ in range(laps):
        start = time.perf_counter()
        if rank != 0:
            dist.irecv(token, prv, tag=1).wait()
        time.sleep(sleep_s)
        dist.isend(token, nxt, tag=1).wait()
        if rank == 0:
            dist.irecv(token, prv, tag=1).wait()
        out.append(time.perf_counter() - start)
    return out


def _laps_ours(rank: int, p: int, sleep_s: float, laps: int, token: torch.Tensor, every: bool) -> list[float]:
    from model_parallel.runtime.wire.comm import PendingRecv, send_values
    from model_parallel.runtime.wire.packed import HeaderCache

    nxt, prv, cache, out = (rank + 1) % p, (rank - 1) % p, HeaderCache(), []
    if every:
        for _ in range(laps):
            start = time.perf_counter()
            for _ in range(p):
                pending = PendingRecv(prv, 2, cache=cache, stream=0)
                time.sleep(sleep_s)
                handle = send_values([token], nxt, 2, cache=cache, stream=0)
                token = pending.wait(60.0)[0]
                handle.wait(60.0)
            out.append(time.perf_counter() - start)
        return out
    for _ in range(laps):
        start = time.perf_counter()
        pending = PendingRecv(prv, 2, cache=cache, stream=0)  # pre-posted, as the executor posts it before computing
        if rank != 0:
            token = pending.wait(60.0)[0]
        time.sleep(sleep_s)
        send_values([token], nxt, 2, cache=cache, stream=0).wait(60.0)
        if rank == 0:
            token = pending.wait(60.0)[0]
        out.append(time.perf_counter() - start)
    return out


def join_ring(rank: int, port: int, spec_path: str) -> dict[str, Any]:
    """A ring worker's start (this bench and message_bisect.py): one thread, its spec, the gloo group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=spec["p"],
                            timeout=timedelta(seconds=120))
    return spec


def run_ring(script: Path, spec: dict[str, Any], workdir: Path, timeout: float, what: str) -> Any:
    """Start spec["p"] ranks of `script` (`--_worker` ...) on this machine and return what rank 0 wrote."""
    from model_parallel.runtime.launch import free_port, launch

    p = spec["p"]
    spec_path, result_path = workdir / f"p{p}.spec.json", workdir / f"p{p}.result.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    commands = [[sys.executable, str(script.resolve()), "--_worker", str(r), "--_port", str(port),
                 "--_spec", str(spec_path), "--_result", str(result_path)] for r in range(p)]
    result = launch(commands, timeout=timeout)
    if not result.ok:
        raise RuntimeError(f"{what} world p={p} failed:\n{result.summary()}")
    return json.loads(result_path.read_text())


def hop_stats(lap_seconds: Sequence[float], p: int, sleep_ms: float) -> dict[str, Any]:
    """One message's latency from whole laps of a p-rank ring: (lap - p x slept) / p, median and p90, ms."""
    per_hop = sorted((s * 1000.0 - p * sleep_ms) / p for s in lap_seconds)
    return {"median_ms": statistics.median(per_hop), "p90_ms": per_hop[int(0.9 * (len(per_hop) - 1))],
            "laps": len(per_hop)}


def add_ring_flags(parser: argparse.ArgumentParser, out: Path) -> None:
    """The flags both ring benches share: the deadline, the report, and the worker's hidden ones."""
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=str(out))
    for hidden in ("--_worker", "--_port"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_spec", help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)


def measure_rings(args: argparse.Namespace, measure: Any, prefix: str, benchmark: str) -> tuple[dict[str, Any], list[float]]:
    """`measure(p, workdir)` for each of `args.p`'s ring sizes in a temporary folder; writes the report (`args.out`,
    atomically, with the load and the settings) and returns the rows and the load."""
    import tempfile

    from model_parallel.fileio import atomic_write_json

    load_before, report = os.getloadavg()[0], {}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for p in [int(x) for x in args.p.split(",")]:
            report[f"p={p}"] = measure(p, Path(tmp))
    load = [load_before, os.getloadavg()[0]]
    atomic_write_json(args.out, {"benchmark": benchmark, "load_1min": load, "cpus": os.cpu_count(),
                                 "settings": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                                 "rows": report})
    return report, load


def worker(rank: int, port: int, spec_path: str, result_path: str) -> int:
    """One rank: every (sleep, transport) in turn, the transports alternating lap block by lap block."""
    import torch.distributed as dist

    from model_parallel.fileio import atomic_write_json

    spec = join_ring(rank, port, spec_path)
    p = spec["p"]
    token = torch.zeros(spec["micro_batch"], 16)
    results: dict[str, Any] = {}
    try:
        for pattern in ("one", "every"):
            for sleep_ms in spec["sleep_ms"]:
                laps: dict[str, list[float]] = {"torch": [], "ours": []}
                for block in range(spec["blocks"]):
                    for name in (("torch", "ours") if block % 2 == 0 else ("ours", "torch")):
                        run = _laps_torch if name == "torch" else _laps_ours
                        dist.barrier()
                        # lap 0 warms up
                        laps[name] += run(rank, p, sleep_ms / 1000.0, spec["laps"], token.clone(), pattern == "every")[1:]
                results[f"{pattern} {sleep_ms}"] = laps
    finally:
        dist.destroy_process_group()
    if rank == 0:  # rank 0 times whole laps
        atomic_write_json(result_path, results)
    return 0


def measure(p: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = {"p": p, "micro_batch": args.micro_batch, "sleep_ms": args.sleep_ms, "laps": args.laps, "blocks": args.blocks}
    rows = {}
    for key, laps in run_ring(Path(__file__), spec, workdir, args.timeout, "latency").items():
        pattern, sleep_ms = key.split()
        for name, seconds in laps.items():
            rows[f"{pattern} token{'s' if pattern == 'every' else ''}, sleep {sleep_ms} ms, {name}"] = hop_stats(
                seconds, p, float(sleep_ms))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", default="4,8", help="comma-separated ring sizes")
    parser.add_argument("--sleep_ms", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 2.0, 8.0],
                        help="each rank's wait per hop, ms (comma-separated)")
    parser.add_argument("--laps", type=int, default=21, help="laps per block (the first of each block is not timed)")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per transport, alternating")
    parser.add_argument("--micro_batch", type=int, default=2, help="rows of the [micro_batch, 16] token")
    add_ring_flags(parser, RESULTS)
    args = parser.parse_args(argv)
    if args._worker is not None:
        return worker(args._worker, args._port, args._spec, args._result)
    torch.set_num_threads(1)
    report, load = measure_rings(args, lambda p, tmp: measure(p, args, tmp), "bench_latency_",
                                 "message latency between sleeping ranks")
    print(f"per-message latency, ms (median / p90 over laps; load {load[0]:.1f}-{load[1]:.1f} on {os.cpu_count()} cpus)")
    for world, rows in report.items():
        for key, row in rows.items():
            print(f"  {world} {key:<34} {row['median_ms']:6.2f} / {row['p90_ms']:6.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
