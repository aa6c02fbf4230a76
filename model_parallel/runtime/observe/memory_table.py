"""The end-of-run memory table (the worker command line's and `PipelineTrainer.train`'s): each stage's predicted
footprint (`optimizer/memory.py`) next to what its ranks measured (`memory_probe.py`), gathered as float tensors.

A rank holding several stages (interleaved, loop placement; zbv, a V) is one row: its stages' weights and optimizer state
summed, and the activations it holds at its peak walking its schedule order (optimizer.memory.loop_rank_parts),
next to what the rank measured for all of them (one StashMeter over its stages, multi_stage.LaneMeter)."""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.memory import Footprint, activation_scale, loop_rank_parts, optimizer_kind, plan_footprint
from model_parallel.runtime.observe.memory_probe import PeakProbe, StashMeter, state_bytes

logger = logging.getLogger(__name__)


def predicted(graph: Graph, plan: Plan, optimizer: str, momentum: float, schedule: str, microbatches: int,
              microbatch_size: int, offload_chunk: Optional[float] = None) -> list[dict[str, float]]:
    """Per stage, the footprint's bytes by kind for this run's optimizer, schedule and microbatches (and its
    offloaded optimizer state's chunk, `RunOptions.offload_chunk_bytes`). Activations scale by microbatch size /
    the graph's profiled `batch_size` (1.0 when it records none)."""
    model = Footprint(optimizer_kind(optimizer, momentum), schedule, microbatches, activation_scale(graph, microbatch_size),
                      offload_chunk)
    return plan_footprint(graph, plan, model)


Merged = Mapping[int, tuple[tuple[int, ...], dict[str, float]]]  # a row's stage -> the rank's stages and bytes


def row_parts(parts: Sequence[dict[str, float]], merged: Optional[Merged], stage: int) -> tuple[tuple[int, ...],
                                                                                             dict[str, float]]:
    """The stages a row's rank holds and their predicted bytes (`merged`: `loop_rank_parts`, else the stage's)."""
    if merged and stage in merged:
        return merged[stage]
    return (stage,), parts[stage]


@dataclass(frozen=True)
class Measured:
    """One rank's (or stage's) measured bytes; None where the run did not measure it (no `--measure_memory`).

    - `weights_opt`: parameters + optimizer state counted from the stage's tensor storages.
    - `held`: parameters + gradients + optimizer state at the end of a step's backwards (the largest).
    - `stash_peak`: the peak bytes kept for backward over the microbatches in flight (StashMeter).
    - `process_peak`: `torch.cuda.max_memory_allocated` on a GPU, else the growth of peak RSS.
    """

    stage: Optional[int]
    weights_opt: Optional[float] = None
    held: Optional[float] = None
    stash_peak: Optional[float] = None
    process_peak: Optional[float] = None

    @property
    def peak(self) -> Optional[float]:
        """The measured counterpart of the predicted footprint: held + peak stashed activations."""
        return None if self.held is None or self.stash_peak is None else self.held + self.stash_peak


def measured(engine: Any, probe: PeakProbe) -> Measured:
    """This rank's measurement at the end of a run."""
    meter = getattr(engine, "meter", None)
    if engine.stage is None:  # a spare rank holds no stage
        return Measured(None, process_peak=float(probe.peak()))
    held = state_bytes(engine.stage, engine.optimizer)
    stash = meter if isinstance(meter, StashMeter) else None  # held and stashed bytes: with --measure_memory only
    return Measured(engine.stage_id, float(held["parameters"] + held["optimizer_state"]),
                    float(stash.held_peak) if stash else None, float(stash.peak) if stash else None,
                    float(probe.peak()))


@dataclass(frozen=True)
class MemoryReport:
    """Predicted vs measured bytes at the end of a run: `parts` per stage (`predicted`), `rows` per rank
    (label, `Measured`; a spare's stage is None) and `text`, the table `format_memory` prints."""

    parts: list[dict[str, float]]
    rows: list[tuple[str, Measured]]
    text: str
    merged: Optional[Merged] = None  # several stages per rank: `loop_rank_parts`

    def stage_rows(self) -> list[dict[str, Any]]:
        """One dict per rank holding a stage: its label, stage (the first it holds), every stage it holds,
        predicted total bytes (over them), measured peak bytes (None where not measured: the run had no
        `measure_memory`) and the process's peak bytes."""
        return [{"rank": label, "stage": m.stage, "stages": row_parts(self.parts, self.merged, m.stage)[0],
                 "predicted_bytes": row_parts(self.parts, self.merged, m.stage)[1]["total"],
                 "measured_bytes": m.peak, "process_peak_bytes": m.process_peak}
                for label, m in self.rows if m.stage is not None]


def gather_report(engine: Any, probe: PeakProbe, parts: list[dict[str, float]], device: torch.device,
                  group: Any = None) -> MemoryReport:
    """Every rank's measurement to every rank (one all_gather of 5 floats on `group`, default the world's;
    NaN = not measured): the same report on every rank, rank 0 prints it."""
    import torch.distributed as dist

    mine = measured(engine, probe)
    values = [-1.0 if mine.stage is None else float(mine.stage), mine.weights_opt, mine.held, mine.stash_peak,
              mine.process_peak]
    row = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64, device=device)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    table = []
    for rank, gathered in enumerate(rows):
        stage, *rest = [float(v) for v in gathered.cpu()]
        table.append((str(rank), Measured(None if stage < 0 else int(stage),
                                          *[None if math.isnan(v) else v for v in rest])))
    plan = engine.plan
    merged = (loop_rank_parts(parts, plan, engine.config.num_microbatches, engine.config.schedule)
              if plan.several_stages_per_rank else None)
    return MemoryReport(parts, table, format_memory(parts, table, "rank", probe.source, merged), merged)


def _mb(value: Optional[float], width: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value / 1e6:>{width}.3f}"


def format_memory(parts: Sequence[dict[str, float]], rows: Sequence[tuple[str, Measured]], label: str,
                  source: str, merged: Optional[Merged] = None) -> str:
    """Predicted (`parts`, per stage) vs measured bytes, one line per row (a rank, or a stage): the footprint
    against held + peak stashed activations, with the error in % (the worker's table and the demo's report).
    `merged` (`loop_rank_parts`): a row of a rank holding several stages predicts all of them."""
    lines = [f"{label:>5} {'stages':>6} {'predicted MB':>12} {'measured MB':>11} {'error':>6}  {'weights+opt MB':>14} "
             f"{'held':>8}  {'activations MB':>14} {'measured':>8}  peak MB ({source})",
             "-" * 110]
    for name, m in rows:
        if m.stage is None:
            lines.append(f"{name:>5} spare")
            continue
        held, p = row_parts(parts, merged, m.stage)
        peak = m.peak
        error = f"{100.0 * (p['total'] - peak) / peak:>+5.0f}%" if peak else f"{'n/a':>6}"
        activations = p["activations"] + p["weight_stash"]
        lines.append(f"{name:>5} {','.join(map(str, held)):>6} {_mb(p['total'], 12)} {_mb(peak, 11)} {error}  "
                     f"{_mb(p['parameters'] + p['optimizer_state'], 14)} {_mb(m.weights_opt, 8)}  "
                     f"{_mb(activations, 14)} {_mb(m.stash_peak, 8)}  {_mb(m.process_peak, 8)}")
    lines.append("predicted = parameters + gradients + optimizer state + stashed weights + activations in flight "
                 "(optimizer/memory.py); measured = parameters + gradients + optimizer state held after the "
                 "backwards + the peak of what microbatches in flight keep for backward (runtime/observe/memory_probe."
                 "StashMeter; n/a without --measure_memory); weights+opt: predicted and counted from tensor storages")
    return "\n".join(lines)
