"""What a stage of a plan really costs per training step, priced in one place (bench, demo report).

The optimizer's objective (costs.py) compares plans; this prices what a stage rank *does* in one
flush step of `m` microbatches, so a prediction can be checked against the runtime's metrics:

    compute    m x sum of its nodes' forward + backward      (profile, scaled to the microbatch size)
    loss       m x the loss's forward + backward             (last stage; graph.metadata["profile"])
    optimizer  parameter bytes x ms-per-byte of the kind     (Calibration.optimizer_ms_per_mb)
    allreduce  costs.allreduce_seconds over the link         (replicated stages only)
    sends      m x per message sent: latency + bytes / bandwidth   (activations down, gradients up)
    overhead   m x the runtime's fixed cost per microbatch   (Calibration.microbatch_overhead_ms)

The measured counterpart (`runtime.metrics.busy_ms`) is the rank's step time minus the time it was
blocked waiting on a peer (receives, the step-end loss all-reduce): compute + optimizer + sends +
Python overhead. Receives are posted ahead and land during compute, so they are not priced; waiting
for them is the pipeline's bubble, which `(m + p - 1) x max stage` accounts for, not a stage.

Sizes in the profile are per profiled batch; they scale linearly to the microbatch (`scale`), which
is exact only for layers whose cost is proportional to the batch: profile at the microbatch size.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.costs import allreduce_seconds, stage_costs

MB = 1e6


@dataclass(frozen=True)
class Calibration:
    """Per-machine constants of the stage-time model, measured once (`cli.calibrate`) and stored
    beside the profile as JSON (`to_json` / `from_json`)."""

    microbatch_overhead_ms: float = 0.0  # the runtime's fixed cost per microbatch and stage (F + B actions)
    link_latency_ms: float = 0.0  # one point-to-point message
    link_bandwidth: float = 4e9  # bytes/s of a point-to-point message
    optimizer_ms_per_mb: Mapping[str, float] = field(default_factory=dict)  # "sgd" / "adamw" -> ms per MB of weights
    machine: Mapping[str, Any] = field(default_factory=dict)  # where it was measured (platform, cpus, threads)

    def __post_init__(self) -> None:
        values = {"microbatch_overhead_ms": self.microbatch_overhead_ms, "link_latency_ms": self.link_latency_ms,
                  "link_bandwidth": self.link_bandwidth, **{f"optimizer_ms_per_mb[{k}]": v for k, v in self.optimizer_ms_per_mb.items()}}
        for name, value in values.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise PlanError(f"calibration {name} must be a finite number >= 0, got {value!r}; re-run the calibration")
        if self.link_bandwidth <= 0:
            raise PlanError(f"calibration link_bandwidth must be > 0 bytes/s, got {self.link_bandwidth}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"optimizer_ms_per_mb": dict(self.optimizer_ms_per_mb), "machine": dict(self.machine)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "calibration") -> "Calibration":
        known = {"microbatch_overhead_ms", "link_latency_ms", "link_bandwidth", "optimizer_ms_per_mb", "machine"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{where}: unknown key(s) {unknown}; expected {sorted(known)}")
        return cls(**{key: data[key] for key in known if key in data})


@dataclass(frozen=True)
class StagePrediction:
    """One stage's predicted milliseconds per step, by term (see the module docstring)."""

    stage: int
    compute_ms: float
    loss_ms: float
    optimizer_ms: float
    allreduce_ms: float
    send_ms: float
    overhead_ms: float

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.loss_ms + self.optimizer_ms + self.allreduce_ms + self.send_ms + self.overhead_ms


def predict_stage_ms(
    graph: Graph,
    plan: Plan,
    *,
    num_microbatches: int,
    calibration: Calibration,
    optimizer: str = "sgd",
    scale: float = 1.0,
    messages_out: Optional[Sequence[int]] = None,
) -> list[StagePrediction]:
    """Each stage's predicted time per flush step of `num_microbatches` microbatches on one of its ranks.

    `scale` = microbatch size / profiled batch size (1.0 when profiled at the microbatch size).
    `messages_out[k]`: tensors stage k sends per boundary message (default 1: latency per message).
    """
    if num_microbatches < 1 or not scale > 0:
        raise PlanError(f"need num_microbatches >= 1 and scale > 0, got {num_microbatches} and {scale}")
    if optimizer not in calibration.optimizer_ms_per_mb and any(n.parameter_size for n in graph.nodes):
        raise PlanError(f"the calibration has no optimizer coefficient for {optimizer!r} "
                        f"(it has {sorted(calibration.optimizer_ms_per_mb)}); calibrate with that optimizer")
    plan = plan.with_default_ranks()
    costs = stage_costs(graph, plan.stage_of, plan.num_stages)
    profile = graph.metadata.get("profile", {}) if isinstance(graph.metadata.get("profile"), Mapping) else {}
    loss_ms = float(profile.get("loss_forward_ms", 0.0)) + float(profile.get("loss_backward_ms", 0.0))
    m, last = num_microbatches, plan.num_stages - 1
    latency, bandwidth = calibration.link_latency_ms, calibration.link_bandwidth
    out = []
    for stage, cost in zip(plan.stages, costs):
        k, r = stage.stage_id, stage.num_replicas
        # Microbatch j runs on replica j % r: each replica does about m / r of the microbatches.
        share = math.ceil(m / r)
        messages = 1 if messages_out is None else messages_out[k]
        send = 0.0
        if k < last:  # activations down
            send += messages * latency + cost.output_bytes * scale / bandwidth * 1e3
        if k > 0:  # input gradients up
            send += messages * latency + cost.input_bytes * scale / bandwidth * 1e3
        out.append(StagePrediction(
            stage=k,
            compute_ms=share * cost.compute_s * 1e3 * scale,
            loss_ms=share * loss_ms * scale if k == last else 0.0,
            optimizer_ms=cost.parameter_bytes / MB * calibration.optimizer_ms_per_mb.get(optimizer, 0.0),
            allreduce_ms=allreduce_seconds(cost.parameter_bytes, r, bandwidth) * 1e3 if r > 1 else 0.0,
            send_ms=share * send,
            overhead_ms=share * calibration.microbatch_overhead_ms,
        ))
    return out


def format_fidelity(predicted: Sequence[float], measured: Sequence[Optional[float]]) -> str:
    """A per-stage table: predicted ms, measured ms, error in % (the ±10 % goal of issue 26)."""
    lines = [f"{'stage':>5} {'predicted ms':>13} {'measured ms':>12} {'error':>7}"]
    for stage, (want, got) in enumerate(zip(predicted, measured)):
        if got is None or not math.isfinite(got) or got <= 0:
            lines.append(f"{stage:>5} {want:>13.2f} {'n/a':>12} {'n/a':>7}")
        else:
            lines.append(f"{stage:>5} {want:>13.2f} {got:>12.2f} {100.0 * (want - got) / got:>+6.0f}%")
    return "\n".join(lines)
