"""The one optimizer update: learning-rate schedule, clipping by global gradient norm, step, zero_grad.

Every trainer applies it the same way - the pipeline engine (after the flush, with the norm all-reduced
over every rank; PipeDream: after each microbatch's backward), `SingleProcessRunner` and the
single-process reference - so a pipeline run and its oracle differ only in where gradients come from.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Optional

import torch

from model_parallel.errors import ConfigError
from model_parallel.runtime.step.offload import step_optimizer


def lr_factor(schedule: str, step: int) -> float:
    """Learning-rate multiplier at `step` for a schedule spec (see TrainConfig.lr_schedule). Each is a torch or
    transformers schedule stepped once per optimizer update: cosine:T is CosineAnnealingLR(T_max=T) (0 past T),
    warmup:N is LinearLR(start_factor=1/N, total_iters=N-1), step:E:G is StepLR(step_size=E, gamma=G), and
    linear:W:T / cosine:W:T are transformers' get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup(opt,
    W, T) (0 at step 0 when W > 0; cosine: 0 past T, where transformers' would rise again)."""
    kind, _, rest = schedule.partition(":")
    try:
        if kind == "constant":
            return 1.0
        if kind in ("linear", "cosine") and rest.count(":") == 1:
            warmup, total = (int(part) for part in rest.split(":"))
            if 0 <= warmup <= total and total >= 1:
                return _warmup_then_decay(kind, warmup, total, step)
            raise ValueError(schedule)
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
    raise ConfigError(f"bad --lr_schedule {schedule!r}; use constant, cosine:<total_steps>, warmup:<steps>, "
                      "step:<every>:<gamma>, linear:<warmup>:<total> or cosine:<warmup>:<total> (counts >= 1, "
                      "0 <= warmup <= total, gamma >= 0)")


def _warmup_then_decay(kind: str, warmup: int, total: int, step: int) -> float:
    """transformers' get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup (num_cycles 0.5) factor."""
    if step < warmup:
        return step / max(1, warmup)
    if kind == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def refuse_lr_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """A torch LR scheduler built on the optimizer (in its factory) would be overwritten every step by the run's own
    lr schedule, without a word: refused, naming the `lr_schedule` spec that does the same."""
    step = getattr(optimizer, "step", None)
    if getattr(step, "_wrapped_by_lr_sched", False) or getattr(step, "_with_counter", False):
        raise ConfigError(
            "the optimizer has a torch LR scheduler built on it (torch.optim.lr_scheduler, transformers' get_*_schedule*): "
            "the run sets every step's lr itself from TrainConfig.lr_schedule (--lr_schedule) and would overwrite the "
            "scheduler's, and the factory is called again on a plan switch; build no scheduler in the optimizer factory "
            "and give lr_schedule='linear:W:T' for get_linear_schedule_with_warmup(opt, W, T), 'cosine:W:T' for "
            "get_cosine_schedule_with_warmup(opt, W, T), 'cosine:T' for CosineAnnealingLR(opt, T), 'step:E:G' for "
            "StepLR(opt, E, G), 'warmup:N' for LinearLR(opt, 1/N, total_iters=N-1)")


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
    refuse_lr_scheduler(optimizer)
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


def build_optimizer(factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                    named: Sequence[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """`factory` over the parameters of `named` (a stage's), refused when its optimizer leaves out a trainable one: a
    factory that groups the original model's `named_parameters()` (Hugging Face's no-decay idiom) instead of the
    parameters it is given steps other tensors (a model built on meta: none of the stage's), and those parameters
    never moved while the run went on."""
    optimizer = factory([p for _, p in named])
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left = [(name, p) for name, p in named if p.requires_grad and id(p) not in held]
    if left:
        name, p = left[0]
        raise ConfigError(
            f"the optimizer factory's optimizer leaves out {len(left)} of the {len(named)} parameter(s) it was given "
            f"(first {name!r}, shape {tuple(p.shape)}): they would never be updated. Build it over the `params` the "
            "factory receives (a stage's parameters, not the original model's named_parameters()), e.g. no weight decay "
            "on biases and norm weights: lambda params: AdamW([{'params': [p for p in params if p.ndim >= 2], "
            "'weight_decay': 0.1}, {'params': [p for p in params if p.ndim < 2], 'weight_decay': 0.0}]); to freeze a "
            "parameter, set requires_grad=False on it")
    return optimizer
