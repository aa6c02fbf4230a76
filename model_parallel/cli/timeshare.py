"""The timeshare factor of `model-parallel calibrate`: stage processes outnumbering the cores, taking turns."""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Optional

import torch
from torch import nn


def timeshare_workload() -> tuple[nn.Module, torch.Tensor]:
    """The reference stage of the timeshare measurement: one transformer layer (width 128, 8 sequences
    of 64 tokens), the typical stage of today's models. Measured on this machine: weight-streaming
    stages inflate more (three 1024-wide linear layers: 1.29 where this layer gave 1.14)."""
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True), torch.randn(8, 64, 128)


def _ring_member(index: int, rounds: int, start_with_token: bool, receive: Any, send: Any, results: Any) -> None:
    """One process of `timeshare_factor`'s ring: per round 4 forwards then 4 backwards (a GPipe
    stage's actions), each after taking the token from its predecessor and passing it on after;
    puts the median CPU ms per action (after the first two rounds) into `results`."""
    torch.set_num_threads(1)
    module, x = timeshare_workload()
    inputs = [x.clone().requires_grad_() for _ in range(4)]
    samples, token = [], start_with_token
    for round_index in range(rounds):
        outputs: list[torch.Tensor] = []
        for action in range(8):
            if not token and not receive.poll(60.0):
                raise TimeoutError(f"timeshare ring member {index}: no token from its predecessor in 60 s")
            if not token:
                receive.recv_bytes()
            token = False
            start = time.process_time()
            if action < 4:
                outputs.append(module(inputs[action]))
            else:
                outputs.pop(0).sum().backward()
            if round_index >= 2:
                samples.append((time.process_time() - start) * 1e3)
            send.send_bytes(b"t")
    results.put((index, statistics.median(samples)))


def _ring(members: int, tokens: int, rounds: int, timeout: float) -> float:
    """Median over `members` processes (each started fresh, always reaped) of their CPU ms per action,
    `tokens` of them running at once."""
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may have used OpenMP threads
    pipes = [ctx.Pipe(duplex=False) for _ in range(members)]  # pipe k carries the token from k - 1 to k
    results = ctx.Queue()
    spacing = members // tokens
    processes = [ctx.Process(target=_ring_member, daemon=True,
                             args=(k, rounds, k % spacing == 0, pipes[k][0], pipes[(k + 1) % members][1], results))
                 for k in range(members)]
    for process in processes:
        process.start()
    try:
        return statistics.median([results.get(timeout=timeout)[1] for _ in processes])
    except queue.Empty:
        raise RuntimeError(f"timeshare ring of {members} processes: no result within {timeout:.0f} s (exit codes "
                           f"{[p.exitcode for p in processes]}); re-run the calibration on a less loaded machine") from None
    finally:
        for process in processes:
            process.join(5.0)
            if process.is_alive():
                process.terminate()
                process.join(5.0)


def timeshare_factor(cores: Optional[int] = None, rounds: int = 20, timeout: float = 120.0) -> float:
    """CPU time per action when 2 x `cores` stage processes time-share the cores, handing work on
    as a pipeline does (a ring passing `cores` tokens: every action starts right after a blocking
    wait, on caches the other processes used) over the same actions in this process alone (the
    profile's conditions; timed before and after, the smaller kept), at least 1. CPU time only."""
    import multiprocessing
    import queue

    cores = cores or os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def alone() -> float:
            receive, send = multiprocessing.Pipe(duplex=False)
            results: "queue.Queue[tuple[int, float]]" = queue.Queue()
            _ring_member(0, rounds, True, receive, send, results)
            return results.get_nowait()[1]

        before = alone()
        shared = _ring(2 * cores, cores, rounds, timeout)
        return max(shared / min(before, alone()), 1.0)
    finally:
        torch.set_num_threads(threads)
