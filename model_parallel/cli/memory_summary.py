"""The worker's end-of-run memory table: each stage's predicted footprint (`optimizer/memory.py`) next to
what its ranks measured (`runtime/memory_probe.py`), gathered to rank 0 as plain float tensors."""
from __future__ import annotations

import logging
from typing import Any

import torch

from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.costs import stage_costs
from model_parallel.optimizer.memory import Footprint, footprint_parts, optimizer_kind
from model_parallel.runtime.memory_probe import PeakProbe, state_bytes

logger = logging.getLogger(__name__)


def predicted(graph: Graph, plan: Plan, optimizer: str, momentum: float, schedule: str, microbatches: int,
              microbatch_size: int) -> list[dict[str, float]]:
    """Per stage, the footprint's bytes by kind for this run's optimizer, schedule and microbatches.
    Activations scale by microbatch size / the graph's profiled `batch_size` (1.0 when it records none)."""
    profiled = graph.metadata.get("batch_size")
    scale = microbatch_size / profiled if isinstance(profiled, int) and not isinstance(profiled, bool) and profiled > 0 else 1.0
    model = Footprint(optimizer_kind(optimizer, momentum), schedule, microbatches, scale)
    costs = stage_costs(graph, plan.stage_of, plan.num_stages)
    out, before = [], 0
    for stage, cost in zip(plan.stages, costs):
        out.append(footprint_parts(model, cost.activation_bytes, cost.parameter_bytes, plan.num_ranks, before,
                                   stage.num_replicas))
        before += stage.num_replicas
    return out


def measured(engine: Any, probe: PeakProbe) -> tuple[float, float]:
    """(bytes of the stage's parameters and optimizer state, counted from storages; the peak since `probe.start`)."""
    if engine.stage is None:  # a spare rank holds no stage
        return 0.0, float(probe.peak())
    held = state_bytes(engine.stage, engine.optimizer)
    return float(held["parameters"] + held["optimizer_state"]), float(probe.peak())


def gather_table(engine: Any, probe: PeakProbe, parts: list[dict[str, float]], device: torch.device) -> str:
    """Every rank's measurement to every rank (one all_gather of 3 floats); the table rank 0 prints."""
    import torch.distributed as dist

    held, peak = measured(engine, probe)
    stage = -1 if engine.stage_id is None else engine.stage_id
    mine = torch.tensor([float(stage), held, peak], dtype=torch.float64, device=device)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return table([[float(v) for v in row.cpu()] for row in rows], parts, probe.source)


def table(rows: list[list[float]], parts: list[dict[str, float]], source: str) -> str:
    """One line per rank: its stage's predicted bytes (total, and parameters + optimizer state, which the
    run keeps between steps) against the measured held bytes and peak."""
    lines = [f"rank stage  predicted MB  (weights+opt MB)  held MB  peak MB ({source})",
             "-" * 72]
    for rank, (stage, held, peak) in enumerate(rows):
        if stage < 0:
            lines.append(f"{rank:>4} spare")
            continue
        p = parts[int(stage)]
        static = p["parameters"] + p["optimizer_state"]
        lines.append(f"{rank:>4} {int(stage):>5} {p['total'] / 1e6:>13.3f} {static / 1e6:>17.3f} {held / 1e6:>8.3f} "
                     f"{peak / 1e6:>8.3f}")
    lines.append("predicted = parameters + gradients + optimizer state + stashed weights + activations in flight "
                 "(docs/optimizer.md); held = parameters + optimizer state counted from tensor storages (gradients "
                 "are freed after each update)")
    return "\n".join(lines)
