"""Batches prepared ahead on a background thread, so reading data stays off stage 0's critical path.

    data = Prefetcher(ImageFolderData(root, batch_size=64), depth=2)
    inputs, target = data.batch(step)   # the batch of `step`; steps step+1 .. step+depth start now
    data.close()                        # or `with Prefetcher(...) as data:`

`batch(step)` returns exactly what the wrapped dataset's `batch(step)` returns (it is the wrapped
dataset's call, only made earlier), so runs stay deterministic per (seed, step), and a resume or
any jump to another step just asks for that step (a batch prepared for a step nobody asks for
is dropped). One thread prepares batches in step order; the queue is bounded by `depth`.

The last stage of a pipeline reads only targets: `data.targets(step)` is `batch(step)[1]` (through the
wrapped source's cheaper `targets(step)` where it has one, `sources.read_targets`), prefetched the same
way. A rank asks for one of the two; only what it asks for is read ahead.

With a tracer attached (`attach_tracer`, the engine does it), each preparation is a span "prepare"
on the lane "data" (args: step), and the time the training thread waited for a batch is a span
"data wait" on the lane "data wait": when the loader keeps up, "prepare" of step s+1 runs while
stage 0 computes step s and "data wait" stays near zero.
"""
from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Optional

import torch

from model_parallel.errors import DataError
from model_parallel.runtime.data.draws import GENERATOR_LOCK
from model_parallel.runtime.data.sources import read_targets

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # one batch's preparation; a stuck network filesystem should not hang a run


class Prefetcher:
    """Wraps anything with `batch(step)`; prepares the next `depth` steps' batches on one thread."""

    def __init__(self, dataset: Any, depth: int = 2, timeout: float = DEFAULT_TIMEOUT_S, tracer: Any = None) -> None:
        if depth < 1:
            raise DataError(f"prefetch depth must be >= 1 (batches prepared ahead), got {depth}")
        if not timeout > 0:
            raise DataError(f"prefetch timeout must be > 0 seconds, got {timeout}")
        self.dataset, self.depth, self.timeout = dataset, depth, timeout
        self.batch_size = dataset.batch_size
        self.tracer: Any = None
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: dict[tuple[str, int], concurrent.futures.Future] = {}  # (part, step)
        self._verified = False  # whether the wrapped source's targets(step) was checked against batch(step)
        if tracer is not None:
            self.attach_tracer(tracer)

    def __getattr__(self, name: str) -> Any:
        # num_classes, root, ...: the wrapped dataset's attributes (not called for our own).
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def attach_tracer(self, tracer: Any) -> None:
        """Record "prepare" / "data wait" spans into `tracer` (a `runtime.observe.tracing.Tracer`)."""
        self.tracer = tracer
        # Register the lanes here, on the caller's thread, before the background thread records.
        for lane in ("data", "data wait"):
            tracer.add_lane(lane)

    def _read(self, part: str, step: int) -> Any:
        # Never while the training thread's forward runs on its seeded CPU generator (data/draws.py).
        with GENERATOR_LOCK:
            if part == "batch":
                return self.dataset.batch(step)
            verify, self._verified = not self._verified, True  # the source's own targets(), once (sources.read_targets)
            return read_targets(self.dataset, step, verify=verify)

    def _prepare(self, part: str, step: int) -> Any:
        tracer = self.tracer
        if tracer is None:
            return self._read(part, step)
        start = tracer.now_ns()
        try:
            return self._read(part, step)
        finally:
            tracer.add("prepare", "data", start, tracer.now_ns(), step=step, **({} if part == "batch" else {"part": part}))

    def _submit(self, part: str, step: int) -> None:
        if (part, step) not in self._pending:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
            self._pending[(part, step)] = self._pool.submit(self._prepare, part, step)

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The batch of `step` (prepared ahead when it was the next one); starts steps step+1 .. step+depth."""
        return self._get("batch", step)

    def targets(self, step: int) -> Any:
        """`batch(step)[1]`, read and prepared ahead as `batch` is (the last stage's read)."""
        return self._get("targets", step)

    def _get(self, part: str, step: int) -> Any:
        self._submit(part, step)
        future = self._pending.pop((part, step))
        # Anything queued for other steps is stale after a jump; a running preparation just finishes.
        for key in [key for key in self._pending if key[0] != part or not step < key[1] <= step + self.depth]:
            self._pending.pop(key).cancel()
        for ahead in range(step + 1, step + self.depth + 1):
            self._submit(part, ahead)
        start = self.tracer.now_ns() if self.tracer is not None else 0
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise DataError(f"preparing the {part} of step {step} took more than {self.timeout:.0f} s "
                            f"({type(self.dataset).__name__}); check the data source or raise the timeout") from None
        except DataError as error:
            raise DataError(f"step {step}: {error}") from None
        except Exception as error:  # noqa: BLE001 - re-raised, typed, naming the step
            raise DataError(f"step {step}: preparing its {part} failed in {type(self.dataset).__name__}: "
                            f"{type(error).__name__}: {error}") from error
        finally:
            if self.tracer is not None:
                self.tracer.add("data wait", "data wait", start, self.tracer.now_ns(), step=step)

    def replace_source(self, dataset: Any) -> None:
        """Read from `dataset` instead (`sources.as_source` puts a user's source in its checked form; before any
        batch was prepared, so nothing read from the old one is served)."""
        if self._pending:
            raise DataError(f"this Prefetcher already prepared batches of {type(self.dataset).__name__}, so its source cannot "
                            "be put in its checked form now: pass a new Prefetcher over the source (or the source itself)")
        self.dataset = dataset

    def close(self) -> None:
        """Drop queued batches and stop the thread (waits for a preparation already running)."""
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        pool = self.__dict__.get("_pool")
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
