"""What the examples share: start (or skip) the process group, and give every rank rank 0's plan."""
from __future__ import annotations

import datetime
import json
import os
from typing import Optional

import torch
import torch.distributed as dist

from model_parallel import Plan


def init_distributed(timeout_s: float = 60.0) -> tuple[int, int]:
    """Join the torchrun world (env:// rendezvous) if there is one; returns (rank, world_size).

    Without torchrun there is no process group and the trainer runs every stage in this process.
    """
    torch.set_num_threads(1)  # one intra-op thread per worker: several workers share the cores
    if "RANK" not in os.environ:
        return 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def share_plan(plan: Optional[Plan]) -> Plan:
    """Rank 0 profiled and partitioned; every rank must train the same plan, so broadcast it as JSON.

    (Profiling times differ from process to process: partitioning on each rank could disagree.)
    """
    if not dist.is_initialized():
        assert plan is not None
        return plan
    payload = json.dumps(plan.to_dict()).encode() if dist.get_rank() == 0 else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(length, src=0)
    buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(buffer, src=0)
    return Plan.from_dict(json.loads(buffer.numpy().tobytes().decode()), "plan from rank 0")


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
