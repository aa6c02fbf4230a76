"""`PartitionOptions`: every knob of the partition optimizer, validated once."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from model_parallel.errors import PlanError
from model_parallel.optimizer.memory import MEMORY_MODELS, Footprint, MemoryModel
from model_parallel.optimizer.tuning import Tuning

CUTS = ("auto", "antichain", "topological", "all")


@dataclass(frozen=True)
class PartitionOptions:
    """How to partition. The defaults reproduce PipeDream's optimizer (FORMATS.md) exactly.

    - `straight_pipeline`: one worker per stage, no replication.
    - `use_fewer_machines`: a level may leave machines idle when that is faster.
    - `activation_compression_ratio`: count inter-stage transfers at size / R; None ignores transfers
      (PipeDream's behaviour without the flag).
    - `use_memory_constraint` + `memory_model`: drop candidates whose per-worker bytes exceed the
      hierarchy's `memory_bytes` ("pipedream" stash estimate, "1f1b", or "footprint": parameters,
      gradients, optimizer state and stashed activations by `footprint`'s optimizer and schedule;
      `memory.py`). `footprint` is only for "footprint" (default `Footprint()` there).
    - `worker_speeds`: relative speed of each worker in rank order (1.0 = as profiled); stages take
      workers in rank order and a stage's work divides by its replica count times their slowest speed
      (the runtime deals microbatches round-robin; compute / speed_w for one worker). On a hierarchy,
      one speed per worker, ranks innermost first; a stage's replicas run at their slowest profile.
      Not with `use_fewer_machines`, except for a one-level straight pipeline.
    - `cuts`: "antichain" = PipeDream's states (reproduces its numbers), "topological" = prefixes of
      one topological order (fast, any graph size), "auto" = antichain unless worker speeds are given
      (then topological), the graph has more than `max_antichain_states` antichain states, or the DP
      over them would take more than the work budget; then as many topological cut points as the work
      budget (array elements, never seconds) allows (plan.extra["exact"] false); "all" = every valid
      cut (downward-closed node set) with the bytes that really cross it: never worse than
      PipeDream on one level, exponential in graph width (small graphs only).
    - `max_cut_points`: keep at most this many topological cut points (the cheapest cut of each of
      that many equal-compute pieces: a heuristic for huge graphs). None = every prefix (or, under
      "auto", what the work budget allows).
    - `memory_cap`: with "footprint", the bytes each stage's reported peak (sent and received values included) must
      fit; None = the hierarchy's `memory_bytes` (the search's bound on what stages hold). A caller that tightens
      the bound to make the search pick another split checks that split against the real cap
      (`contiguous._fitting_split`).
    - `tuning`: the budgets of "auto" and of the search (`tuning.Tuning`); the search layers themselves
      are opt-in (`optimizer/search.searched_partition`), not an option of the core.
    """

    straight_pipeline: bool = False
    use_fewer_machines: bool = False
    activation_compression_ratio: Optional[float] = None
    use_memory_constraint: bool = False
    memory_model: str = "pipedream"
    footprint: Optional[Footprint] = None
    worker_speeds: Optional[tuple[float, ...]] = None
    cuts: str = "auto"
    max_antichain_states: int = 5000
    max_cut_points: Optional[int] = None
    memory_cap: Optional[float] = None
    tuning: Tuning = field(default=Tuning(), repr=False)

    def __post_init__(self) -> None:
        ratio = self.activation_compression_ratio
        if ratio is not None and not (math.isfinite(ratio) and ratio > 0):
            raise PlanError(f"activation_compression_ratio must be a positive number, got {ratio}")
        if self.memory_model not in MEMORY_MODELS:
            raise PlanError(f"memory_model must be one of {MEMORY_MODELS}, got {self.memory_model!r}")
        if self.memory_model == "footprint" and self.footprint is None:
            object.__setattr__(self, "footprint", Footprint())
        if self.memory_model != "footprint" and self.footprint is not None:
            raise PlanError(f"footprint {self.footprint} needs memory_model='footprint' (got {self.memory_model!r}); "
                            "the legacy stash estimates ignore the optimizer and schedule")
        if self.cuts not in CUTS:
            raise PlanError(f"cuts must be one of {CUTS}, got {self.cuts!r}")
        if self.max_antichain_states < 1:
            raise PlanError(f"max_antichain_states must be >= 1, got {self.max_antichain_states}")
        if self.max_cut_points is not None and self.max_cut_points < 1:
            raise PlanError(f"max_cut_points must be >= 1 or None, got {self.max_cut_points}")
        if self.worker_speeds is not None:
            speeds = tuple(float(s) for s in self.worker_speeds)
            object.__setattr__(self, "worker_speeds", speeds)
            bad = [s for s in speeds if not (math.isfinite(s) and s > 0)]
            if not speeds or bad:
                raise PlanError(f"worker_speeds must be positive numbers (1.0 = as profiled), got {list(speeds)}")
            if self.use_fewer_machines and not self.straight_pipeline:
                raise PlanError(
                    "worker_speeds with replicated stages cannot leave workers idle (use_fewer_machines): stages take "
                    "workers in rank order; use straight_pipeline=True or drop use_fewer_machines"
                )

    @property
    def memory(self) -> MemoryModel:
        """What the solvers' memory checks take (`memory.multipliers`): the legacy name or the footprint."""
        return self.footprint if self.footprint is not None else self.memory_model
