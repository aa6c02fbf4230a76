"""What the examples share: start (or skip) the torchrun process group, and leave it."""
from __future__ import annotations

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
    from model_parallel.runtime.run import Rendezvous, join_world

    # The project's own join: NCCL only where each rank of a node has a GPU of its own (else gloo on the CPUs),
    # and a store key space per torchrun restart.
    join_world(Rendezvous(timeout=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
