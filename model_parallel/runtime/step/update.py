"""The one optimizer update: learning-rate schedule, clipping by global gradient norm, step, zero_grad.

Every trainer applies it the same way - the pipeline engine (after the flush, with the norm all-reduced
over every rank; PipeDream: after each microbatch's backward), `SingleProcessRunner` and the
single-process reference - so a pipeline run and its oracle differ only in where gradients come from.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

import torch

from model_parallel.errors import ConfigError
from model_parallel.runtime.step.offload import step_optimizer


def lr_factor(schedule: str, step: int) -> float:
    """Learning-rate multiplier at `step` for a schedule spec (see TrainConfig.lr_schedule)."""
    kind, _, rest = schedule.partition(":")
    try:
        if kind == "constant":
            return 1.0
        # Every count must be >= 1 and gamma finite and >= 0: warmup:-1 would be a negative learning rate.
        if kind == "cosine" and int(rest) >= 1:
            total = int(rest)
            return 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
        if kind == "warmup" and int(rest) >= 1:
            return min(1.0, (step + 1) / int(rest))
        if kind == "step":
            every, gamma = rest.split(":")
            if int(every) >= 1 and math.isfinite(float(gamma)) and float(gamma) >= 0:
                return float(gamma) ** (step // int(every))
    except (ValueError, ZeroDivisionError):
        pass
    raise ConfigError(f"bad --lr_schedule {schedule!r}; use constant, cosine:<total_steps>, warmup:<steps> "
                      "or step:<every>:<gamma> (counts >= 1, gamma >= 0)")


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s scale factor."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def squared_grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """Sum of the squared gradient norms (in float64; 0.0 when no parameter has a gradient)."""
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.stack(torch._foreach_norm(grads)).double().pow(2).sum())


def set_lr(optimizer: torch.optim.Optimizer, schedule: str, step: int) -> float:
    """Every group's lr <- its initial lr x the schedule's factor at `step`; returns the first group's."""
    factor = lr_factor(schedule, step)
    for group in optimizer.param_groups:
        # The factory's lr is the schedule's base: remembered before the first update changes it.
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * factor
    return optimizer.param_groups[0]["lr"]


def apply_update(optimizer: torch.optim.Optimizer, step: int, *, lr_schedule: str = "constant",
                 clip_grad: Optional[float] = None, total_norm: Optional[float] = None) -> float:
    """Clip the optimizer's gradients to `clip_grad` (by `total_norm`, the global norm; computed from
    these gradients when not given), set this step's lr, step and zero the gradients. Returns the lr."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if clip_grad is not None:
        norm = total_norm if total_norm is not None else squared_grad_norm(params) ** 0.5
        coef = clip_coefficient(norm, clip_grad)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
    lr = set_lr(optimizer, lr_schedule, step)
    step_optimizer(optimizer)  # chunked through the disk where the state is offloaded (runtime/step/offload.py)
    optimizer.zero_grad(set_to_none=True)
    return lr
