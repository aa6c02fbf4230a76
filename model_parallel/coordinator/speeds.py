"""The policy's speed model: measured stage times -> worker speeds, and a plan's predicted bottleneck.

Speeds. For each active rank, `ratio = (median measured compute ms over the window - overhead) /
predicted compute ms of its stages` (predicted = sum of the profiled forward+backward ms of the
stages' nodes). The fastest worker is taken as nominal: `calibration = min(ratio)` rescales the whole
profile to what this machine really does (a profile taken elsewhere, or simply wrong by a constant
factor, is fixed this way), and `speed[r] = calibration / ratio[r]` (1.0 = the fastest worker, 0.5 =
twice slower). Per-layer profile errors cannot be told apart from a slow worker with per-stage
measurements; they show up as a lower speed for the rank holding those layers, and re-solving moves
work off it, which is what balancing needs anyway.

Overhead. Every rank also spends a fixed time per step whatever its stages hold (the optimizer's and
autograd's calls, Python, a stage's hand-offs): `measured = overhead + calibration * profiled / speed`.
Read without it, a rank that holds little work looks slow (a 1-layer stage measured 1.5 ms for 1 ms of
work reads 1.5x slow when 0.5 ms of it is fixed), so a straggler that recovers while it holds the small
share it was given is never given its work back. One plan cannot tell the overhead from the speeds; two can:
a rank whose work changed at a switch while its speed did not gives two points on its line
(`fit_overhead`: the median over the ranks, each counting only what it shows beyond its noise; the policy
averages the switches' fits). Until a switch has taught it, the overhead is 0, which is what the policy assumed before.
Where the overhead is most of a rank's time its speed cannot be read (noise and the overhead's error
decide it): such a rank keeps the speed it was last read at.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan, StagePlan

logger = logging.getLogger(__name__)

# A rank's work (measured - overhead) below this share of its measured time is not read as a speed.
READABLE_WORK_SHARE = 0.2
# A rank whose profiled work moved by less than this at a switch gives two points too close to fit a line through.
MIN_WORK_CHANGE = 0.25
# A fit counts only what it shows beyond this many standard errors (an overhead read too high makes a small share's
# noise look like speed changes; one read too low only leaves the policy as it was without it).
FIT_CONFIDENCE = 1.0

# (profiled ms of a rank's stages, its median measured ms, the median's standard error)
Point = tuple[float, float, float]


@dataclass(frozen=True)
class Estimate:
    """What the measurements say: per-rank speed, the profile calibration, per-stage times (ms)."""

    speeds: Mapping[int, float]
    calibration: float
    measured_ms: Mapping[int, float]  # rank -> median measured compute ms
    predicted_ms: Mapping[int, float]  # rank -> profiled compute ms of its stage
    overhead_ms: float = 0.0  # the fixed ms per step subtracted from every rank's measured ms
    error_ms: Mapping[int, float] = field(default_factory=dict)  # rank -> standard error of its median (noise)

    def points(self) -> dict[int, Point]:
        """rank -> (profiled ms of its stages, measured ms, its standard error): what `fit_overhead` fits across a
        switch."""
        return {r: (self.predicted_ms[r], self.measured_ms[r], self.error_ms.get(r, math.inf))
                for r in self.measured_ms if r in self.predicted_ms}


def with_cost_proxy(graph: Graph) -> Graph:
    """A graph the policy can weigh: itself when it has timings, else one whose node times are a proxy.

    A traced-but-unprofiled graph (all times 0) gets `forward_ms = (parameter + activation bytes) / 1e6`
    (the runtime's even split uses the same proxy); calibration then maps it onto measured ms.
    """
    if graph.total_compute_ms > 0:
        return graph
    logger.warning("the graph has no profiled times; weighing layers by parameter+activation bytes "
                   "(profile the model for better plans)")
    return graph.replace_nodes(
        replace(n, forward_ms=0.0 if n.is_input else (n.parameter_size + n.activation_bytes) / 1e6, backward_ms=0.0)
        for n in graph.nodes
    )


def stage_profiled_ms(graph: Graph, stage: StagePlan) -> float:
    """Profiled forward+backward ms of a stage's nodes; model inputs count nothing (data loading)."""
    return sum(graph[n].compute_ms for n in stage.node_ids if n in graph and not graph[n].is_input)


def stage_nodes(plan: Plan) -> list[tuple[str, ...]]:
    """Each stage's node ids, in stage order: what two plans must share to place the same work."""
    return [s.node_ids for s in plan.stages]


def active_ranks(plan: Plan) -> tuple[int, ...]:
    """Ranks holding a stage, in stage order (straight pipelines: one rank per stage; a loop or V placement repeats
    them, which is how the solver knows to balance each rank's summed stages)."""
    return tuple(r for s in plan.with_default_ranks().stages for r in s.ranks)


def estimate_speeds(graph: Graph, plan: Plan, samples: Mapping[int, Sequence[float]], overhead_ms: float = 0.0,
                    known: Optional[Mapping[int, float]] = None) -> Estimate:
    """Speeds of the active ranks from their recent compute ms (see the module docstring). `known`: each rank's last
    read speed, kept by a rank whose time is almost all overhead (nominal, 1.0, when it has none)."""
    plan = plan.with_default_ranks()
    measured: dict[int, float] = {}
    predicted: dict[int, float] = {}
    error: dict[int, float] = {}
    for stage in plan.stages:
        for rank in stage.ranks:
            values = [float(v) for v in samples.get(rank, ()) if v >= 0]
            if not values:
                raise PlanError(f"rank {rank} (stage {stage.stage_id}) has no compute samples yet")
            measured[rank] = statistics.median(values)
            # The median's standard error (~1.25 sigma / sqrt(n) for near-normal noise); none from one sample.
            error[rank] = 1.2533 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.inf
            # A rank's compute covers all its stages (several in a loop or a V): predict their sum.
            predicted[rank] = predicted.get(rank, 0.0) + stage_profiled_ms(graph, stage) / stage.num_replicas
    points = {r: (predicted[r], measured[r], error[r]) for r in measured}
    speeds, calibration = read_speeds(points, overhead_ms, known)
    return Estimate(speeds=speeds, calibration=calibration, measured_ms=measured, predicted_ms=predicted,
                    overhead_ms=overhead_ms, error_ms=error)


def read_speeds(points: Mapping[int, Point], overhead_ms: float = 0.0,
                known: Optional[Mapping[int, float]] = None) -> tuple[dict[int, float], float]:
    """(speeds, calibration) from each rank's `Point`; see `estimate_speeds`."""
    ratios = {r: (m - overhead_ms) / w for r, (w, m, _) in points.items()
              if w > 0 and m - overhead_ms > READABLE_WORK_SHARE * m}
    calibration = min(ratios.values()) if ratios else 1.0
    # A stage with no profiled cost (or no measured time beyond the overhead) says nothing about its worker.
    known = known or {}
    return {r: (calibration / ratios[r] if r in ratios else known.get(r, 1.0)) for r in points}, calibration


def fit_overhead(before: Mapping[int, Point], after: Mapping[int, Point]) -> Optional[float]:
    """The fixed ms per step (see the module docstring) from each rank's `Point` under the plan before a switch and
    under the plan after it; None when no rank's work changed enough to fit a line through. Each rank's fit counts
    only what it shows beyond `FIT_CONFIDENCE` standard errors (a small move of the work multiplies the noise); their
    median, so one rank whose speed changed at the switch does not decide it."""
    fits = []
    for rank in sorted(before.keys() & after.keys()):
        (w1, m1, e1), (w2, m2, e2) = before[rank], after[rank]
        if w1 > 0 and w2 > 0 and abs(w2 - w1) >= MIN_WORK_CHANGE * max(w1, w2):
            fit = (m1 * w2 - m2 * w1) / (w2 - w1)  # where the line through both points meets no work
            error = math.hypot(w2 * e1, w1 * e2) / abs(w2 - w1)
            fits.append(fit - FIT_CONFIDENCE * error if math.isfinite(error) else 0.0)
    if not fits:
        return None
    # Never more than most of the quickest rank's time: the rest of it must still be work that says a speed.
    ceiling = (1 - READABLE_WORK_SHARE) * min(m for _, m, _ in (*before.values(), *after.values()))
    return min(max(statistics.median(fits), 0.0), max(ceiling, 0.0))


def calibrated_graph(graph: Graph, calibration: float) -> Graph:
    """The graph with every node's time scaled by `calibration` (measured/profiled on a nominal worker)."""
    return graph.replace_nodes(
        replace(n, forward_ms=n.forward_ms * calibration, backward_ms=n.backward_ms * calibration) for n in graph.nodes
    )


def predicted_bottleneck_ms(graph: Graph, plan: Plan, speeds: Mapping[int, float], calibration: float = 1.0,
                            overhead_ms: float = 0.0) -> float:
    """Slowest rank of `plan` on workers with `speeds` (ms): the calibrated profiled compute of its stages (several
    in a loop or a V: moving a cut between two stages of one rank changes nothing) / its speed, plus the fixed
    overhead every rank spends."""
    plan = plan.with_default_ranks()
    work: dict[int, float] = {}
    for stage in plan.stages:
        per_replica = stage_profiled_ms(graph, stage) * calibration / stage.num_replicas
        for rank in stage.ranks:
            work[rank] = work.get(rank, 0.0) + per_replica
    return max((overhead_ms + ms / max(speeds.get(rank, 1.0), 1e-9) for rank, ms in work.items()), default=0.0)
