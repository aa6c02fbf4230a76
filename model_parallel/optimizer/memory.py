"""What one worker of a stage holds, written once: the memory models every solver and the plan use.

Two legacy stash estimates (PipeDream's, kept bit for bit) and the real footprint:

    "pipedream"  f (A + W), f = ceil((M - ranks up to and including the stage) / r)   (last stage 0)
    "1f1b"       f (A + W), f = ceil((M - ranks before the stage) / r)
    "footprint"  W (2 + k + v) + A s n

with A the stage's activation bytes and W its parameter bytes at the profiled batch size, r its
replicas and M the ranks of the whole pipeline. In the footprint, W counts the parameters once, their
gradients once (same bytes) and the optimizer's state k times (`OPTIMIZER_STATE`: SGD 0, SGD with
momentum 1 buffer, Adam/AdamW 2 moments); `v` is PipeDream's stashed weight versions (the `pipedream`
schedule clones the stage's weights at every forward and keeps each until its backward: one per
microbatch in flight; 0 for flush schedules). `s` scales the profiled activations to one microbatch
(microbatch size / profiled batch size) and `n` is the microbatches whose saved activations a stage
holds at its peak (graph/in_flight.py, the rule the runtime's schedules share): GPipe all m; 1F1B
min(m, p - k) for stage k of p and PipeDream p - k, i.e. `ceil((M - ranks before) / r)` with replicas
dealt microbatches round-robin.

In the footprint, A is what one microbatch of the stage keeps for backward (`stash_bytes`), counted as
the runtime's StashMeter measures it: each node's `saved_bytes` (what autograd saves from its values,
profiled; its output bytes where not profiled, except a get_attr's: a weight the export route reads as a
bare tensor is W, counted once, never a stash), a value sent on kept whole until its backward, every
value received (and passed through) kept too, and on the last stage what the loss saves. The legacy
models take A = the sum of the nodes' output bytes, as PipeDream does.

Solvers call `multipliers` once per (stage position, replicas) and `stage_bytes` on arrays or floats.
The solvers' per-node sums (`Workload.activation`, `workload.preprocess`) weigh a node by its
`Node.stash_bytes` under the footprint and by its output bytes under the legacy models; the bytes that
cross a cut are `Workload.wire`. The search does not add the values a stage sends or receives (the
boundary terms of `stash_bytes` below): the plan's numbers and tables do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.in_flight import (SCHEDULE_NAMES, ZERO_BUBBLE_SCHEDULES, activations_held, interleaved_peak,
                                            zero_bubble_pairs_held)
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.workload import weight_gradient_node_bytes

LEGACY_MODELS = ("pipedream", "1f1b")
MEMORY_MODELS = (*LEGACY_MODELS, "footprint")
# Tensors of optimizer state per parameter tensor, each the parameter's size (torch.optim's own state).
OPTIMIZER_STATE = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
# Bytes of optimizer state in memory at once when it lives on disk, unless the run says otherwise (RunOptions and the
# worker's --offload_chunk_mb default to it; a refusal's offload advice prices it).
OFFLOAD_CHUNK_BYTES = 64e6


@dataclass(frozen=True)
class Footprint:
    """The real per-stage footprint model: which optimizer and schedule the run will use.

    - `optimizer`: a key of `OPTIMIZER_STATE` ("sgd" is plain SGD; the worker's `--optimizer sgd` has
      momentum 0.9 by default: "sgd_momentum").
    - `schedule`: 1f1b | gpipe | pipedream (the runtime's `TrainConfig.schedule`).
    - `microbatches`: m per minibatch; None = as many as the pipeline has ranks (1F1B then never caps).
    - `activation_scale`: one microbatch's activations / the profiled ones (microbatch size / profiled
      batch size; 1.0 when the graph was profiled at the microbatch size).
    - `offload_chunk`: the optimizer state is offloaded (runtime/step/offload.py, `RunOptions.offload_optimizer`): a
      stage holds at most this many bytes of it (during its update), not k W. None: in memory.
    """

    optimizer: str = "sgd_momentum"
    schedule: str = "1f1b"
    microbatches: Optional[int] = None
    activation_scale: float = 1.0
    offload_chunk: Optional[float] = None  # bytes of optimizer state in memory at once when it lives on disk

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATE:
            raise PlanError(f"optimizer must be one of {tuple(OPTIMIZER_STATE)}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULE_NAMES:
            raise PlanError(f"schedule must be one of {SCHEDULE_NAMES}, got {self.schedule!r}")
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or self.microbatches < 1):
            raise PlanError(f"microbatches must be an integer >= 1 or None, got {self.microbatches!r}")
        scale = self.activation_scale
        if not (math.isfinite(scale) and scale > 0):
            raise PlanError(f"activation_scale (microbatch size / profiled batch size) must be > 0, got {scale}")
        chunk = self.offload_chunk
        if chunk is not None and (isinstance(chunk, bool) or not (math.isfinite(chunk) and chunk > 0)):
            raise PlanError(f"offload_chunk must be bytes > 0 (or None: the optimizer state in memory), got {chunk!r}")

    @property
    def state_multiplier(self) -> int:
        """k: the optimizer state's bytes per parameter byte priced with the parameters (0 when offloaded:
        the chunk is a constant, `resident_state`)."""
        return 0 if self.offload_chunk is not None else OPTIMIZER_STATE[self.optimizer]

    def resident_state(self, parameters: float) -> float:
        """Bytes of optimizer state a stage of `parameters` bytes holds at its peak: k W, or offloaded at most a chunk."""
        whole = float(OPTIMIZER_STATE[self.optimizer] * parameters)
        return whole if self.offload_chunk is None else min(whole, float(self.offload_chunk))


    def to_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "schedule": self.schedule, "microbatches": self.microbatches,
                "activation_scale": self.activation_scale,
                **({"offload_chunk": self.offload_chunk} if self.offload_chunk is not None else {})}


MemoryModel = Union[str, Footprint]  # a legacy model's name, or the footprint


def in_flight(model: Footprint, num_ranks: int, ranks_before: int, replicas: int) -> int:
    """Microbatches whose saved activations one replica holds at its peak (zero bubble: until their W)."""
    microbatches = model.microbatches if model.microbatches is not None else num_ranks
    return activations_held(model.schedule, microbatches, num_ranks, ranks_before, replicas)


def multipliers(model: MemoryModel, num_ranks: int, ranks_before: int, replicas: int) -> tuple[float, float]:
    """(activation multiplier, parameter multiplier) of a stage after `ranks_before` ranks on `replicas`."""
    if isinstance(model, str):
        if model == "1f1b":
            factor = math.ceil((num_ranks - ranks_before) / replicas)
        elif model == "pipedream":
            factor = math.ceil((num_ranks - ranks_before - replicas) / replicas)
        else:
            raise PlanError(f"memory_model must be one of {MEMORY_MODELS}, got {model!r}")
        return factor, factor
    flight = in_flight(model, num_ranks, ranks_before, replicas)
    versions = flight if model.schedule == "pipedream" else 0
    return model.activation_scale * flight, float(2 + model.state_multiplier + versions)


def offload_bytes(model: MemoryModel) -> float:
    """The constant a stage holds on top of `stage_bytes`: its offloaded optimizer state's chunk (an upper bound of
    `Footprint.resident_state`), 0 when the state is in memory. The solvers compare `stage_bytes` with the cap less
    this (contiguous.straight_plan), the plans report `stage_bytes` plus this (assemble.py)."""
    return float(model.offload_chunk) if isinstance(model, Footprint) and model.offload_chunk is not None else 0.0


def stage_bytes(factors: tuple[float, float], activation: Any, parameters: Any) -> Any:
    """Bytes one worker holds; legacy models keep PipeDream's `f * (A + W)` to the bit."""
    act, params = factors
    if act == params:
        return act * (activation + parameters)
    return act * activation + params * parameters


def footprint_parts(model: MemoryModel, activation: float, parameters: float, num_ranks: int, ranks_before: int,
                    replicas: int) -> dict[str, float]:
    """One stage's predicted bytes by kind (the plan's `extra["memory"]`); legacy models give one total."""
    factors = multipliers(model, num_ranks, ranks_before, replicas)
    if isinstance(model, str):
        return {"total": float(stage_bytes(factors, activation, parameters))}
    flight = in_flight(model, num_ranks, ranks_before, replicas)
    parts = {
        "parameters": float(parameters),
        "gradients": float(parameters),
        "optimizer_state": model.resident_state(parameters),
        "weight_stash": float((flight if model.schedule == "pipedream" else 0) * parameters),
        "activations": float(model.activation_scale * flight * activation),
        "in_flight": float(flight),
    }
    # Offloaded, the state is not in the parameters' multiplier: its chunk is added here.
    offloaded = parts["optimizer_state"] if model.offload_chunk is not None else 0.0
    parts["total"] = float(stage_bytes(factors, activation, parameters)) + offloaded
    return parts


def stash_bytes(graph: Graph, stage_of: dict[str, int], num_stages: int) -> list[float]:
    """Per stage, the bytes one microbatch keeps for backward at the profiled batch size (the footprint's A).

    A node's value saved by autograd counts once, on the stage that produced it (`saved_bytes`); a value
    that crosses is also kept whole by its sender (the executor holds what it sent until the backward)
    and by every stage that receives it (received, passed on: one tensor). Model inputs are the step's
    data on stage 0 (not counted there, as the runtime does not); received later, they count."""
    stash = [0.0] * num_stages
    for node in graph.nodes:
        stage = stage_of[node.node_id]
        data = node.is_input and not graph.predecessors[node.node_id]
        last = max((stage_of[s] for s in graph.successors[node.node_id]), default=stage)
        if not data:  # a value sent on is kept whole, unless it is a weight the stage holds anyway
            whole = last > stage and not node.reads_state
            stash[stage] += max(node.stash_bytes, node.activation_bytes) if whole else node.stash_bytes
        for receiver in range(stage + 1, last + 1):
            stash[receiver] += node.activation_bytes
    profile = graph.metadata.get("profile")
    loss = profile.get("loss_saved_bytes") if isinstance(profile, dict) else None
    if isinstance(loss, (int, float)) and not isinstance(loss, bool) and num_stages:
        stash[-1] += float(loss)
    return stash


def weight_gradient_bytes(graph: Graph, stage_of: dict[str, int], num_stages: int) -> list[float]:
    """Per stage, the bytes one microbatch keeps between its I and its W under zero bubble (the gradients at the
    nodes that use weights: `workload.weight_gradient_node_bytes`, which the search prices alike)."""
    kept = [0.0] * num_stages
    for node_id, size in weight_gradient_node_bytes(graph).items():
        kept[stage_of[node_id]] += size
    return kept


def optimizer_kind(name: str, momentum: float = 0.0) -> str:
    """The `OPTIMIZER_STATE` key of a torch optimizer named as the worker's `--optimizer` flag."""
    if name == "sgd":
        return "sgd_momentum" if momentum else "sgd"
    if name in OPTIMIZER_STATE:
        return name
    raise PlanError(f"no memory model for optimizer {name!r}; known: sgd, adam, adamw")


def activation_scale(graph: Graph, microbatch_size: int) -> float:
    """One microbatch's activations / the profiled ones: microbatch size / the graph's metadata
    `batch_size` (1.0 when it records none: a graph traced or profiled at the microbatch size)."""
    profiled = graph.metadata.get("batch_size")
    if isinstance(profiled, int) and not isinstance(profiled, bool) and profiled > 0:
        return microbatch_size / profiled
    return 1.0


def plan_footprint(graph: Graph, plan: Plan, model: Footprint) -> list[dict[str, float]]:
    """Per stage of `plan`, its predicted bytes by kind (`footprint_parts`): what one worker holds."""
    parameters = [0.0] * plan.num_stages
    stage_of = plan.stage_of
    for node in graph.nodes:
        parameters[stage_of[node.node_id]] += node.parameter_size
    stash = stash_bytes(graph, stage_of, plan.num_stages)
    if model.schedule in ZERO_BUBBLE_SCHEDULES:  # until its W a microbatch also keeps its weights' output gradients
        stash = [a + b for a, b in zip(stash, weight_gradient_bytes(graph, stage_of, plan.num_stages))]
    # Loop placement (interleaved) or a V (zbv): the in-flight rule counts stage positions, not ranks (in_flight.py:
    # M = all stages); with plan.num_ranks = p, a stage past p would hold a negative count.
    loop = plan.several_stages_per_rank
    positions = plan.num_stages if loop else plan.num_ranks
    out, before = [], 0
    for stage, kept, held in zip(plan.stages, stash, parameters):
        out.append(footprint_parts(model, kept, held, positions, before, stage.num_replicas))
        before += 1 if loop else stage.num_replicas
    return out


def loop_rank_parts(parts: list[dict[str, float]], plan: Plan, microbatches: Optional[int],
                    schedule: str = "interleaved") -> dict[int, tuple[tuple[int, ...], dict[str, float]]]:
    """Under loop placement (interleaved), each rank's predicted bytes by kind, keyed by its first stage (a
    replica's ranks predict alike): its stages' parameters, gradients and optimizer state summed, and the
    activations of the (stage, microbatch) pairs it holds at once walking its order (in_flight.interleaved_peak),
    not the sum of the stages' own peaks. `parts` from `plan_footprint`; microbatches None: p. Under a V (zbv) a
    rank's two stages are summed, activations too (each stage's own bound: an upper bound of the rank's peak).
    Under zbinterleaved a rank holds pairs until their W (in_flight.zero_bubble_pairs_held), each priced at its
    largest stage's bytes per microbatch: an upper bound, tight for balanced stages."""
    out: dict[int, tuple[tuple[int, ...], dict[str, float]]] = {}
    if plan.is_v_placement:
        for rank in range(plan.v_width):
            held = plan.stages_of_rank(rank)
            out[held[0]] = (held, {key: sum(parts[k][key] for k in held) for key in parts[held[0]]})
        return out
    p = plan.loop_width
    m = microbatches or p
    for rank in range(p):
        held = plan.stages_of_rank(rank)
        per_microbatch = [parts[k]["activations"] / max(parts[k]["in_flight"], 1.0) for k in held]
        replicas = plan.stages[held[0]].num_replicas
        if schedule == "zbinterleaved":
            peak = zero_bubble_pairs_held(m, p, len(held), replicas) * max(per_microbatch)
        else:
            peak = interleaved_peak(m, p, rank, per_microbatch, 0, replicas)
        summed = {key: sum(parts[k][key] for k in held) for key in parts[held[0]]}
        summed["total"] += peak - summed["activations"]
        summed["activations"] = peak
        out[held[0]] = (held, summed)
    return out


@dataclass(frozen=True)
class MemoryLimit:
    """What one worker may hold: `memory_per_worker` bytes, priced by the run's footprint model."""

    memory_per_worker: float
    footprint: Footprint

    def check(self, graph: Graph, plan: Plan, what: str = "the plan") -> None:
        """InfeasibleError naming the first stage of `plan` whose predicted footprint is over the limit (under
        loop placement: the first rank whose stages' footprints add up to more)."""
        plan = plan.with_default_ranks()
        if plan.several_stages_per_rank:
            self._check_ranks(graph, plan, what)
            return
        for stage, parts in zip(plan.stages, plan_footprint(graph, plan, self.footprint)):
            if parts["total"] > self.memory_per_worker:
                raise InfeasibleError(
                    f"{what} puts a predicted {parts['total'] / 1e9:.3g} GB on stage {stage.stage_id} (parameters "
                    f"{parts['parameters'] / 1e9:.3g} GB, optimizer state {parts['optimizer_state'] / 1e9:.3g} GB, "
                    f"activations {parts['activations'] / 1e9:.3g} GB), over memory_per_worker "
                    f"{self.memory_per_worker / 1e9:.3g} GB ({self.footprint.optimizer}, {self.footprint.schedule}, "
                    f"{self.footprint.microbatches} microbatches); give a plan that fits (leave it out, or the "
                    "optimizer's --memory_per_worker finds one) or raise memory_per_worker")

    def _check_ranks(self, graph: Graph, plan: Plan, what: str) -> None:
        """A rank of a loop placement or a V holds all its stages at once (`loop_rank_parts`): their sum must fit."""
        parts = plan_footprint(graph, plan, self.footprint)
        ranks = loop_rank_parts(parts, plan, self.footprint.microbatches, self.footprint.schedule)
        for first, (held, summed) in sorted(ranks.items()):
            if summed["total"] > self.memory_per_worker:
                raise InfeasibleError(
                    f"{what} puts a predicted {summed['total'] / 1e9:.3g} GB on rank {plan.stages[first].ranks[0]} "
                    f"(stages {list(held)}: parameters {summed['parameters'] / 1e9:.3g} GB, optimizer state "
                    f"{summed['optimizer_state'] / 1e9:.3g} GB, activations at its peak {summed['activations'] / 1e9:.3g} "
                    f"GB), over memory_per_worker {self.memory_per_worker / 1e9:.3g} GB ({self.footprint.optimizer}, "
                    f"{self.footprint.schedule}, {self.footprint.microbatches} microbatches); use more ranks or "
                    "fewer microbatches, or raise memory_per_worker")

    def check_switch(self, graph: Graph, old: Plan, new: Plan, what: str = "the switch") -> None:
        """InfeasibleError naming the first rank that cannot hold a live switch from `old` to `new`.

        Until a switch commits, a rank keeps its old stage (so a failed switch can be rolled back,
        runtime/wire/migration.py) while it holds the arriving layers and builds the new one: the
        parameters and optimizer state of both stages' layers at once, plus each arriving layer's values
        once more in the message buffer they arrive in. Gradients and activations are not held (the switch
        runs at a step boundary, after the update freed them) - which is why both plans' own footprints,
        checked by `check`, can fit while the switch between them does not."""
        old, new = old.with_default_ranks(), new.with_default_ranks()
        state = 1 + OPTIMIZER_STATE[self.footprint.optimizer]  # a parameter and its optimizer state
        size = {node.node_id: float(node.parameter_size) for node in graph.nodes}

        def held(plan: Plan) -> dict[int, set[str]]:
            out: dict[int, set[str]] = {}
            for stage in plan.stages:
                for rank in stage.ranks:
                    out.setdefault(rank, set()).update(stage.node_ids)
            return out

        before, after = held(old), held(new)
        for rank in sorted(after):
            kept_or_left, arriving = before.get(rank, set()), after[rank] - before.get(rank, set())
            both = sum(size[n] for n in kept_or_left | arriving) * state
            buffers = sum(size[n] for n in arriving) * state
            if both + buffers > self.memory_per_worker:
                raise InfeasibleError(
                    f"{what} from plan v{old.version} to v{new.version} puts a predicted {(both + buffers) / 1e9:.3g} GB on "
                    f"rank {rank} while it runs (parameters and {self.footprint.optimizer} state of its old and new "
                    f"layers {both / 1e9:.3g} GB, arriving values in flight {buffers / 1e9:.3g} GB), over "
                    f"memory_per_worker {self.memory_per_worker / 1e9:.3g} GB; switch in smaller moves (an "
                    "intermediate plan first) or raise memory_per_worker")
