"""What the examples share: start (or skip) the torchrun process group, and leave it."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float = 60.0) -> tuple[int, int]:
    """Join the torchrun world (env:// rendezvous) if there is one; returns (rank, world_size).

    Without torchrun there is no process group and the trainer runs every stage in this process.
    """
    torch.set_num_threads(1)  # one intra-op thread per worker: several workers share the cores
    if "RANK" not in os.environ:
        return 0, 1
    # NCCL needs a GPU of its own for each rank on this node; otherwise (2 ranks on a 1-GPU machine) gloo on the CPUs.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if 0 < int(os.environ.get("LOCAL_WORLD_SIZE", 1)) <= gpus else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
