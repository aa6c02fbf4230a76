"""The machine hierarchy a plan targets: levels of machines joined by links, and each worker's memory."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from model_parallel.errors import PlanError

__all__ = ["Level", "Hierarchy", "MAX_RANKS"]

# The most ranks one plan may place (replicas of all stages together, and the largest rank + 1). Far above
# any world we run, far below what would exhaust memory: `with_default_ranks` and every per-rank table are
# sized by it, so a plan asking for 10**15 replicas is refused here, before anything is allocated. The
# world size (what the workers were started with) bounds a plan further where it is known.
MAX_RANKS = 1 << 16


@dataclass(frozen=True)
class Level:
    """One level of the machine hierarchy: `num_machines` units joined by links of `bandwidth` bytes/s."""

    num_machines: int
    bandwidth: float = 1e9

    def __post_init__(self) -> None:
        if self.num_machines < 1:
            raise PlanError(f"a level needs at least 1 machine, got {self.num_machines}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise PlanError(f"bandwidth must be a positive number of bytes/s, got {self.bandwidth}")


@dataclass(frozen=True)
class Hierarchy:
    """Levels innermost first (`-n 8 2` = 8 GPUs in each of 2 servers); `memory_bytes` per worker."""

    levels: tuple[Level, ...]
    memory_bytes: float = 16e9

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        if not self.levels:
            raise PlanError("a hierarchy needs at least one level")
        if not (self.memory_bytes > 0 and math.isfinite(self.memory_bytes)):
            raise PlanError(f"memory per worker must be positive, got {self.memory_bytes}")

    @classmethod
    def from_lists(
        cls, num_machines: Sequence[int], bandwidths: Optional[Sequence[float]] = None, memory_bytes: float = 16e9
    ) -> "Hierarchy":
        bandwidths = list(bandwidths) if bandwidths else [1e9] * len(num_machines)
        if len(bandwidths) != len(num_machines):
            raise PlanError(
                f"got {len(num_machines)} level(s) of machines but {len(bandwidths)} bandwidth(s); "
                "give one bandwidth per level (-b B1 B2 ... with -n N1 N2 ...)"
            )
        try:
            levels = tuple(Level(int(n), float(b)) for n, b in zip(num_machines, bandwidths))
            memory = float(memory_bytes)
        except (TypeError, ValueError, OverflowError) as error:
            if isinstance(error, PlanError):
                raise
            raise PlanError(
                f"machine counts, bandwidths and memory must be finite numbers, got -n {list(num_machines)} "
                f"-b {bandwidths} -s {memory_bytes!r} ({error})"
            ) from None
        # The optimizer's tables grow with the worker count (-n 100000000 was a numpy MemoryError).
        if math.prod(level.num_machines for level in levels) > MAX_RANKS:
            raise PlanError(f"-n {' '.join(str(n) for n in num_machines)} is more than {MAX_RANKS} workers in all, the "
                            "most ranks a plan may place; give the machines you have")
        return cls(levels, memory)

    @property
    def num_workers(self) -> int:
        return math.prod(level.num_machines for level in self.levels)
