"""Measured compute, and straggler injection as a wrapper around it (installed only while injecting).

Injection makes this rank `factor` times slower at compute: after each forward or backward it sleeps
`(factor - 1) x` the time the compute took, inside the measurement, so the metrics and the coordinator
see it as compute (as they would a slower machine).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional, Protocol, TypeVar

from model_parallel.runtime.config import StragglerInjection

T = TypeVar("T")


class Compute(Protocol):
    """Runs one forward or backward `fn` of `microbatch`, timed as `kind` ("forward" | "backward"); `span` names
    its trace span ("backward I" / "backward W" when the backward is split), `trace_args` go into it (the stage)."""

    def __call__(self, kind: str, microbatch: int, fn: Callable[[], T], span: Optional[str] = None,
                 **trace_args: Any) -> T: ...


def measured(metrics: Any) -> Compute:
    """Compute timed by a MetricsRecorder."""
    def compute(kind: str, microbatch: int, fn: Callable[[], T], span: Optional[str] = None, **trace_args: Any) -> T:
        with metrics.measure(kind, microbatch=microbatch, span=span, **trace_args):
            return fn()
    return compute


def slowed(compute: Compute, factor: float) -> Compute:
    """`compute`, `factor` (> 1) times slower: the sleep runs inside its measurement."""
    def slow(kind: str, microbatch: int, fn: Callable[[], T], span: Optional[str] = None, **trace_args: Any) -> T:
        def stretched() -> T:
            start = time.perf_counter()
            result = fn()
            time.sleep((time.perf_counter() - start) * (factor - 1.0))
            return result
        return compute(kind, microbatch, stretched, span, **trace_args)
    return slow


class Slowdown:
    """A rank's compute callable: measured, and wrapped while the rank is slowed down. A configured
    injection starts once, at its step; `slowdown` commands set the factor at any time after."""

    def __init__(self, metrics: Any, rank: int, injection: Optional[StragglerInjection] = None) -> None:
        self._measured = measured(metrics)
        self.compute = self._measured
        self.factor = 1.0
        self._pending = injection if injection is not None and injection.rank == rank and injection.factor > 1.0 else None

    def set(self, factor: float) -> None:
        self.factor = factor
        self.compute = slowed(self._measured, factor) if factor > 1.0 else self._measured

    def at_step(self, step: int) -> None:
        if self._pending is not None and step >= self._pending.after_step:
            self.set(self._pending.factor)
            self._pending = None
