"""Replicated stages: their process groups and the gradient all-reduce among a stage's replicas."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from model_parallel.graph.plan import Plan
from model_parallel.runtime.wire import comm


class ReplicaGroups:
    """The process group of every replicated stage, cached by rank tuple. Creating a group is a
    collective over the whole world, so every rank creates every group, in the same order."""

    def __init__(self, device: torch.device, timeout: float = 60.0) -> None:
        # Replica all-reduces of CPU tensors need gloo; on GPUs the default backend (NCCL) does them.
        self.backend = "gloo" if device.type == "cpu" else None
        self.timeout = timeout  # creating a group waits for every rank: at most this long (a PeerError then)
        self._groups: dict[tuple[int, ...], Any] = {}

    def group(self, ranks: Sequence[int]) -> Any:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = comm.new_group(self.timeout, key, self.backend, f"creating the group of ranks {list(key)}")
        return self._groups[key]

    def create_for(self, plan: Plan) -> None:
        """Every group `plan` needs (collective: every rank calls it with the same plan)."""
        for stage in plan.stages:
            if stage.num_replicas > 1:
                self.group(stage.ranks)


def all_reduce_grads(stage: nn.Module, group: Any, timeout: float, skip: Collection[int] = ()) -> None:
    """Sum the gradients of `stage` over its replicas (one flat all-reduce; the loss is already / m,
    so the sum is the gradient of the minibatch mean). A parameter without a gradient counts as zeros.
    `skip`: ids of parameters summed already (tied copies, runtime/build/tied.py: over every replica too)."""
    params = [p for p in stage.parameters() if id(p) not in skip]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.wait_work(dist.all_reduce(flat, group=group, async_op=True), timeout, -1, "replica all-reduce")
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).clone()
        offset += n
