"""Where one message's cost goes: torch's isend/irecv against our comm path, and the steps between them, per hop.

    python bench/message_bisect.py                       # p = 2 and 4, a rank sleeps 0, 2 and 8 ms per hop
    python bench/message_bisect.py --p 4 --sleep_ms 8 --laps 40

The same ring as bench/message_latency.py's "one token" (a rank receives, sleeps its "compute", sends on; the
others wait), with more transports, alternating lap block by lap block in the same world:

- torch:           `dist.isend` / `dist.irecv` posted when needed, `wait()` (bench/message_latency.py's torch);
- torch pre:       the receive posted before the lap, as ours is (a receive that lands while its rank sleeps);
- torch pre+td:    the same, every wait given a new `timedelta` (what our waits passed before);
- torch +calls:    torch pre+td plus the torch calls comm's cached path made per message before the
                   "cold calls" change (read_prefix, unpack; empty, zero_ the prefix, slice, view, copy_);
- ours:            `comm.send_values` / `PendingRecv` with a HeaderCache (whatever code PYTHONPATH imports);
- ours baseline:   with `--baseline DIR`, the same with DIR's runtime/wire/comm.py and packed.py (e.g. a `git
                   archive` of main), loaded beside ours: an A/B of two versions of the wire in the same world.

Per transport: the median latency of one message in ms ((lap - p x slept) / p, rank 0's laps) and the
thread context switches per hop (voluntary + involuntary over all of rank 0's threads, /proc): a cheap
proxy for wake-ups. Writes bench/results/message_bisect.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from message_latency import add_ring_flags, hop_stats, join_ring, measure_rings, run_ring  # bench/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "message_bisect.json"
TRANSPORTS = ("torch", "torch pre", "torch pre+td", "torch +calls", "ours")
TAG = 5


def _switches() -> int:
    """Context switches of all this process's threads so far."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[-1])
        except OSError:  # a thread that ended meanwhile
            continue
    return total


def _old_calls_after_receive(slot: torch.Tensor) -> None:
    """What comm's cached receive did per message before: read_prefix, then unpack's views (one tensor)."""
    int(slot[:8].view(torch.int64).item())
    slot[16:16 + 128].view(torch.float32).view(2, 16).requires_grad_(False)


def _old_calls_before_send(token: torch.Tensor) -> torch.Tensor:
    """What comm's cached send did per message before: a new buffer, its prefix zeroed, the tensor copied in."""
    buffer = torch.empty(144, dtype=torch.uint8)
    buffer[:16].zero_()
    buffer[16:144].view(torch.float32).view(2, 16).copy_(token.detach())
    return buffer


def _hop_torch(kind: str, rank: int, p: int) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """One lap of the ring for rank `rank` with torch's P2P calls, posted as `kind` says."""
    import torch.distributed as dist

    nxt, prv = (rank + 1) % p, (rank - 1) % p
    slot = torch.zeros(144, dtype=torch.uint8)

    def wait(work: Any) -> None:
        work.wait(timedelta(seconds=60.0)) if kind in ("torch pre+td", "torch +calls") else work.wait()

    def lap(token: torch.Tensor, sleep_s: float) -> torch.Tensor:
        incoming = torch.empty_like(token) if kind != "torch" else token  # as ours: a fresh buffer, posted now
        pre = dist.irecv(incoming, prv, tag=TAG) if kind != "torch" else None
        if rank != 0:
            wait(pre) if pre is not None else dist.irecv(token, prv, tag=TAG).wait()
            token = incoming
            if kind == "torch +calls":
                _old_calls_after_receive(slot)
        time.sleep(sleep_s)
        if kind == "torch +calls":
            _old_calls_before_send(token)
        wait(dist.isend(token, nxt, tag=TAG))
        if rank == 0:
            wait(pre) if pre is not None else dist.irecv(token, prv, tag=TAG).wait()
            token = incoming
            if kind == "torch +calls":
                _old_calls_after_receive(slot)
        return token
    return lap


def _load_wire(root: str) -> Any:
    """comm.py from the checkout at `root`, with that checkout's packed.py (both under names of their own)."""
    import importlib.util

    import model_parallel.runtime.wire.comm  # noqa: F401  ours first: its packed is the one sys.modules keeps

    wire, name = Path(root) / "model_parallel" / "runtime" / "wire", "model_parallel.runtime.wire.packed"
    ours = sys.modules[name]
    modules = []
    for module in ("packed", "comm"):
        spec = importlib.util.spec_from_file_location(f"baseline_{module}", wire / f"{module}.py")
        assert spec is not None and spec.loader is not None, wire
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = loaded
        if module == "comm":
            sys.modules[name] = modules[0]  # the baseline comm imports the baseline packed
        try:
            spec.loader.exec_module(loaded)
        finally:
            sys.modules[name] = ours
        modules.append(loaded)
    return modules[1]


def _hop_ours(rank: int, p: int, comm: Any = None) -> Callable[[torch.Tensor, float], torch.Tensor]:
    if comm is None:
        from model_parallel.runtime.wire import comm
    PendingRecv, send_values = comm.PendingRecv, comm.send_values

    nxt, prv, cache = (rank + 1) % p, (rank - 1) % p, comm.HeaderCache()

    def lap(token: torch.Tensor, sleep_s: float) -> torch.Tensor:
        pending = PendingRecv(prv, TAG, cache=cache, stream=0)
        if rank != 0:
            token = pending.wait(60.0)[0]
        time.sleep(sleep_s)
        send_values([token], nxt, TAG, cache=cache, stream=0).wait(60.0)
        if rank == 0:
            token = pending.wait(60.0)[0]
        return token
    return lap


def worker(rank: int, port: int, spec_path: str, result_path: str) -> int:
    import torch.distributed as dist

    from model_parallel.fileio import atomic_write_json

    spec = join_ring(rank, port, spec_path)
    p = spec["p"]
    results: dict[str, Any] = {}
    baseline = _load_wire(spec["baseline"]) if spec["baseline"] else None
    transports = TRANSPORTS + (("ours baseline",) if baseline is not None else ())
    try:
        for sleep_ms in spec["sleep_ms"]:
            laps: dict[str, list[float]] = {name: [] for name in transports}
            switches: dict[str, int] = {name: 0 for name in transports}
            for block in range(spec["blocks"]):
                order = transports if block % 2 == 0 else transports[::-1]
                for name in order:
                    lap = (_hop_ours(rank, p) if name == "ours" else _hop_ours(rank, p, baseline)
                           if name == "ours baseline" else _hop_torch(name, rank, p))
                    token = torch.zeros(2, 16)
                    dist.barrier()
                    token = lap(token, sleep_ms / 1000.0)  # warm-up lap (ours: the header goes once)
                    before = _switches()
                    for _ in range(spec["laps"]):
                        start = time.perf_counter()
                        token = lap(token, sleep_ms / 1000.0)
                        laps[name].append(time.perf_counter() - start)
                    switches[name] += _switches() - before
            results[str(sleep_ms)] = {"laps": laps, "switches": switches}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        atomic_write_json(result_path, results)
    return 0


def measure(p: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = {"p": p, "sleep_ms": args.sleep_ms, "laps": args.laps, "blocks": args.blocks, "baseline": args.baseline}
    rows: dict[str, Any] = {}
    for sleep_ms, found in run_ring(Path(__file__), spec, workdir, args.timeout, "bisect").items():
        for name, seconds in found["laps"].items():
            row = hop_stats(seconds, p, float(sleep_ms))
            rows[f"sleep {sleep_ms} ms, {name}"] = row | {"switches_per_hop": found["switches"][name] / (row["laps"] * p)}
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", default="2,4", help="comma-separated ring sizes")
    parser.add_argument("--sleep_ms", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 2.0, 8.0])
    parser.add_argument("--laps", type=int, default=20, help="timed laps per block")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per transport, alternating")
    parser.add_argument("--baseline", default="", help="a checkout whose runtime/wire to time beside ours")
    add_ring_flags(parser, RESULTS)
    args = parser.parse_args(argv)
    if args._worker is not None:
        return worker(args._worker, args._port, args._spec, args._result)
    report, load = measure_rings(args, lambda p, tmp: measure(p, args, tmp), "bench_bisect_",
                                 "one message's cost, bisected")
    print(f"per-message latency, ms (median / p90 over rank 0's laps), context switches per hop "
          f"(load {load[0]:.1f}-{load[1]:.1f} on {os.cpu_count()} cpus)")
    for world, rows in report.items():
        for key, row in rows.items():
            print(f"  {world} {key:<28} {row['median_ms']:6.3f} / {row['p90_ms']:6.3f}   {row['switches_per_hop']:5.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
