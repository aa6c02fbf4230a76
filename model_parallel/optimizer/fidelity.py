"""What a stage of a plan really costs per training step, priced in one place (bench, demo report).

The optimizer's objective (costs.py) compares plans; this prices what a stage rank *does* in one
flush step of `m` microbatches (`s` = its share, ceil(m / replicas)), so a prediction can be checked
against the runtime's metrics:

    compute     s x sum of its nodes' forward + backward     (profile, scaled to the microbatch size)
    loss        s x the loss's forward + backward            (last stage; graph.metadata["profile"])
    accumulate  (s - 1) x sum over its nodes of parameter MB x ms per MB at that node's size
                                                             (backward adds each microbatch's weight
                                                              gradient into .grad; the first one is
                                                              stored, the profile's replays only store.
                                                              Per MB it costs ~4x more for a 16 MB
                                                              tensor than for a 0.25 MB one that the
                                                              core's cache holds: priced on the
                                                              calibration's `accumulate_curve`)
    optimizer   parameter MB x ms per MB of the kind         (Calibration.optimizer_ms_per_mb)
    allreduce   costs.allreduce_seconds over the link        (replicated stages only)
    sends       s x per message sent: latency + bytes / bandwidth   (activations down, gradients up;
                                                              bytes at the wire precision: a bf16
                                                              profile's float32 boundary tensors
                                                              count half, graph/precision.py)
    receives    the same per message received                (clock "cpu" only, see below)
    overhead    s x the runtime's fixed cost per microbatch  (Calibration.microbatch_overhead_ms)
    corun       (corun_factor - 1) x (compute + loss), when other ranks share the host (`ranks_per_host`
                >= 2): the profile timed every node in one process alone, while a pipeline's ranks
                compute at the same time, and on some machines (the 2-core development VM: 1.0-1.46
                from one minute to the next, likely two hyperthreads of one host core) each then runs
                slower. Measured by `cli.calibrate` (two ranks at once vs one alone). The accumulate,
                optimizer, link and overhead terms were calibrated with both ranks running already.
    timeshare   (timeshare_factor - corun_factor) x the compute of the actions that start after a receive,
                only when more ranks run on the host than it has cores (`ranks_per_host`): a rank that
                blocks on a receive gives its core to another rank, whose work evicts the caches, so
                the action it then runs starts cold. The profile times them warm (one process alone).
                Which actions wait follows from the stage's place: the first stage's backwards (with
                their accumulation; its forwards read local data), a middle stage's forwards and
                backwards, the last stage's forwards (its loss and backward follow at once). Measured
                on this machine (`cli.calibrate`: a ring of 2 x cores processes, each action after a
                wait, vs. one process alone); the GPT stages' compute inside a 4-rank engine on 2 cores
                ran 1.07-1.15x their profile (alone: within 3 %). Pricing every action cold put the
                first and last stages of resnet50 and GPT-2 13-27 % high at load 1-3.

Two clocks; the profile, the calibration and the measurement must use the same one
(`Calibration.clock`, the profile's `metadata["profile"]["clock"]`; a mismatch is a PlanError):

- "cpu" (the default of `cli.calibrate`): the rank process's CPU time per step
  (`StepRecord.cpu_ms`, all its threads). Waiting on a peer costs no CPU and a rank that is
  runnable but descheduled (more ranks than cores, a loaded machine) is not charged, so this is the
  one comparison that holds on a shared machine. Receiving costs CPU (gloo's thread reads the
  socket), so receives are priced like sends.
- "wall": `runtime.observe.metrics.busy_ms` (step time minus time blocked in receives and the step-end
  all-reduce). Only meaningful with a free core per rank; receives are waits, not priced, and the
  executor's final wait for its sends (gloo completes a send when the peer has received it) counts
  as busy although it is a wait: expect wall predictions to read low on the first stages.

Waiting is the pipeline's bubble, which `(m + p - 1) x max stage` accounts for, not a stage.
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
CLOCKS = ("cpu", "wall")


@dataclass(frozen=True)
class Calibration:
    """Per-machine constants of the stage-time model, measured once (`cli.calibrate`) and stored
    beside the profile as JSON (`to_json` / `from_json`)."""

    microbatch_overhead_ms: float = 0.0  # the runtime's fixed cost per microbatch and stage (F + B actions)
    link_latency_ms: float = 0.0  # one point-to-point message
    link_bandwidth: float = 4e9  # bytes/s of a point-to-point message
    optimizer_ms_per_mb: Mapping[str, float] = field(default_factory=dict)  # "sgd" / "adamw" -> ms per MB of weights
    machine: Mapping[str, Any] = field(default_factory=dict)  # where it was measured (platform, cpus, threads)
    accumulate_ms_per_mb: float = 0.0  # adding one microbatch's weight gradient into .grad, per MB of weights
    clock: str = "wall"  # what every number is on: "cpu" (process CPU time) or "wall" (see the module docstring)
    # ((tensor bytes, accumulate ms per MB), ...) by increasing size: the accumulation's price per MB
    # depends on whether the core's cache holds the tensor. Empty (older calibrations): the flat
    # `accumulate_ms_per_mb` for every size.
    accumulate_curve: tuple[tuple[float, float], ...] = ()
    # CPU time of forward + backward when every action starts on caches another process evicted,
    # relative to warm (>= 1; see the module docstring). 1.0 (older calibrations): not measured, no term.
    timeshare_factor: float = 1.0
    # CPU time of forward + backward while the host's other ranks compute at the same time, relative to
    # alone (>= 1; see the module docstring). 1.0 (older calibrations): not measured, no term.
    corun_factor: float = 1.0

    def accumulate_ms_per_mb_at(self, tensor_bytes: float) -> float:
        """Accumulate ms per MB for a tensor of `tensor_bytes`: the curve interpolated on log(size),
        its end values beyond its ends; the flat coefficient without a curve."""
        curve = self.accumulate_curve
        if not curve:
            return self.accumulate_ms_per_mb
        if tensor_bytes <= curve[0][0]:
            return curve[0][1]
        for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
            if tensor_bytes <= x1:
                t = math.log(tensor_bytes / x0) / math.log(x1 / x0)
                return y0 + t * (y1 - y0)
        return curve[-1][1]

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise PlanError(f"calibration clock must be one of {CLOCKS}, got {self.clock!r}; re-run the calibration")
        values = {"microbatch_overhead_ms": self.microbatch_overhead_ms, "link_latency_ms": self.link_latency_ms,
                  "link_bandwidth": self.link_bandwidth, "accumulate_ms_per_mb": self.accumulate_ms_per_mb,
                  **{f"optimizer_ms_per_mb[{k}]": v for k, v in self.optimizer_ms_per_mb.items()}}
        for name, value in values.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise PlanError(f"calibration {name} must be a finite number >= 0, got {value!r}; re-run the calibration")
        if self.link_bandwidth <= 0:
            raise PlanError(f"calibration link_bandwidth must be > 0 bytes/s, got {self.link_bandwidth}")
        for name in ("timeshare_factor", "corun_factor"):
            factor = getattr(self, name)
            if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1.0):
                raise PlanError(f"calibration {name} must be a finite number >= 1, got {factor!r}; re-run the calibration")
        curve = tuple((float(x), float(y)) for x, y in self.accumulate_curve)  # JSON gives lists
        sizes = [x for x, _ in curve]
        if any(not (math.isfinite(x) and x > 0 and math.isfinite(y) and y >= 0) for x, y in curve) \
                or sizes != sorted(set(sizes)):
            raise PlanError(f"calibration accumulate_curve must be (bytes > 0, ms per MB >= 0) pairs by increasing "
                            f"size, got {self.accumulate_curve!r}; re-run the calibration")
        object.__setattr__(self, "accumulate_curve", curve)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"optimizer_ms_per_mb": dict(self.optimizer_ms_per_mb), "machine": dict(self.machine),
                               "accumulate_curve": [list(point) for point in self.accumulate_curve]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "calibration") -> "Calibration":
        known = {"microbatch_overhead_ms", "link_latency_ms", "link_bandwidth", "optimizer_ms_per_mb", "machine",
                 "accumulate_ms_per_mb", "clock", "accumulate_curve", "timeshare_factor", "corun_factor"}
        if not isinstance(data, Mapping):
            raise PlanError(f"{where}: a calibration is a JSON object, got {type(data).__name__}; re-run the calibration")
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{where}: unknown key(s) {unknown}; expected {sorted(known)}")
        if not all(isinstance(data.get(key, {}), Mapping) for key in ("optimizer_ms_per_mb", "machine")):
            raise PlanError(f"{where}: optimizer_ms_per_mb and machine are JSON objects; re-run the calibration")
        try:
            return cls(**{key: data[key] for key in known if key in data})
        except PlanError as error:
            raise PlanError(f"{where}: {error}") from None
        except (TypeError, ValueError) as error:  # a curve of non-pairs, a string where a number is meant
            raise PlanError(f"{where}: malformed calibration ({type(error).__name__}: {str(error)[:120]}); "
                            "re-run the calibration") from None

    @classmethod
    def read(cls, path: Any) -> "Calibration":
        """The calibration JSON file at `path` (bounded read: a FIFO, 1e999 or nesting 10^5 deep is a PlanError too)."""
        from model_parallel import jsonbound

        return cls.from_json(jsonbound.load_file(path, error=PlanError, what="calibration", fix="re-run the calibration"),
                             str(path))


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
    accumulate_ms: float = 0.0
    recv_ms: float = 0.0
    timeshare_ms: float = 0.0
    corun_ms: float = 0.0

    TERMS = ("compute_ms", "loss_ms", "accumulate_ms", "optimizer_ms", "allreduce_ms", "send_ms", "recv_ms", "overhead_ms",
             "corun_ms", "timeshare_ms")

    @property
    def total_ms(self) -> float:
        return sum(getattr(self, term) for term in self.TERMS)

    def terms(self) -> dict[str, float]:
        return {term: getattr(self, term) for term in self.TERMS}


def predict_stage_ms(
    graph: Graph,
    plan: Plan,
    *,
    num_microbatches: int,
    calibration: Calibration,
    optimizer: str = "sgd",
    scale: float = 1.0,
    messages_out: Optional[Sequence[int]] = None,
    precision: Optional[str] = None,
    ranks_per_host: Optional[int] = None,
) -> list[StagePrediction]:
    """Each stage's predicted time per flush step of `num_microbatches` microbatches on one of its ranks.

    `scale` = microbatch size / profiled batch size (1.0 when profiled at the microbatch size).
    `messages_out[k]`: tensors stage k sends per boundary message (default 1: latency per message).
    `precision`: what boundary tensors travel at ("fp32" / "bf16"; None: the profile's own).
    `ranks_per_host`: how many ranks share one host of the calibration's machine (None: unknown, no
    co-running or time-sharing terms); from 2 the co-running term applies, above its cores
    (`calibration.machine["cpus"]`) the timeshare term too.
    """
    if num_microbatches < 1 or not scale > 0:
        raise PlanError(f"need num_microbatches >= 1 and scale > 0, got {num_microbatches} and {scale}")
    if optimizer not in calibration.optimizer_ms_per_mb and any(n.parameter_size for n in graph.nodes):
        raise PlanError(f"the calibration has no optimizer coefficient for {optimizer!r} "
                        f"(it has {sorted(calibration.optimizer_ms_per_mb)}); calibrate with that optimizer")
    plan = plan.with_default_ranks()
    costs = stage_costs(graph, plan.stage_of, plan.num_stages, precision)
    profile = graph.metadata.get("profile", {}) if isinstance(graph.metadata.get("profile"), Mapping) else {}
    if profile.get("clock", calibration.clock) != calibration.clock:
        raise PlanError(f"the profile was timed on the {profile['clock']!r} clock and the calibration on "
                        f"{calibration.clock!r}: their sum means nothing; profile with clock={calibration.clock!r} "
                        f"(profiler --clock {calibration.clock}) or calibrate with --clock {profile['clock']}")
    loss_ms = float(profile.get("loss_forward_ms", 0.0)) + float(profile.get("loss_backward_ms", 0.0))
    m, last = num_microbatches, plan.num_stages - 1
    latency, bandwidth = calibration.link_latency_ms, calibration.link_bandwidth
    cores = calibration.machine.get("cpus")
    timeshared = ranks_per_host is not None and isinstance(cores, int) and ranks_per_host > cores
    corun = calibration.corun_factor if ranks_per_host is not None and ranks_per_host >= 2 else 1.0
    # The timeshare factor is measured against one process alone, so it holds the co-running slowdown
    # too: the cold actions pay only what it adds beyond that.
    cold_extra = max(calibration.timeshare_factor - corun, 0.0)
    # Accumulation per stage: each node's weights at the price per MB of their size (a node's
    # parameters stand for one tensor: a layer's weight, its bias is small).
    accumulate_per_mb, stage_of = [0.0] * plan.num_stages, plan.stage_of
    forward_ms, backward_ms = [0.0] * plan.num_stages, [0.0] * plan.num_stages  # per microbatch, for timeshare
    for node in graph.nodes:
        if node.node_id in stage_of:
            forward_ms[stage_of[node.node_id]] += node.forward_ms
            backward_ms[stage_of[node.node_id]] += node.backward_ms
        if node.parameter_size and node.node_id in stage_of:
            accumulate_per_mb[stage_of[node.node_id]] += (
                node.parameter_size / MB * calibration.accumulate_ms_per_mb_at(node.parameter_size))
    out = []
    for stage, cost in zip(plan.stages, costs):
        k, r = stage.stage_id, stage.num_replicas
        # Microbatch j runs on replica j % r: each replica does about m / r of the microbatches.
        share = math.ceil(m / r)
        messages = 1 if messages_out is None else messages_out[k]
        send = recv = 0.0
        if k < last:  # activations down, their gradients back
            send += messages * latency + cost.output_bytes * scale / bandwidth * 1e3
            recv += messages * latency + cost.output_bytes * scale / bandwidth * 1e3
        if k > 0:  # activations in, input gradients up
            send += messages * latency + cost.input_bytes * scale / bandwidth * 1e3
            recv += messages * latency + cost.input_bytes * scale / bandwidth * 1e3
        parameter_mb = cost.parameter_bytes / MB
        compute = share * cost.compute_s * 1e3 * scale
        loss = share * loss_ms * scale if k == last else 0.0
        accumulate = (share - 1) * accumulate_per_mb[k]
        # The compute of the actions that start right after a blocking receive (see the timeshare term).
        cold = 0.0
        if timeshared and plan.num_stages > 1:
            cold += share * scale * forward_ms[k] if k > 0 else 0.0
            cold += share * scale * backward_ms[k] + accumulate if k < last else 0.0
        out.append(StagePrediction(
            stage=k,
            compute_ms=compute,
            loss_ms=loss,
            optimizer_ms=parameter_mb * calibration.optimizer_ms_per_mb.get(optimizer, 0.0),
            allreduce_ms=allreduce_seconds(cost.parameter_bytes, r, bandwidth) * 1e3 if r > 1 else 0.0,
            send_ms=share * send,
            overhead_ms=share * calibration.microbatch_overhead_ms,
            accumulate_ms=accumulate,
            # A receive is a wait on the wall clock (the bubble); on the CPU clock its copy is work.
            recv_ms=share * recv if calibration.clock == "cpu" else 0.0,
            timeshare_ms=cold_extra * cold,
            corun_ms=(corun - 1.0) * (compute + loss),
        ))
    return out


def share_errors(predicted: Sequence[float], measured: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Per stage, in %: how far the predicted share of the step's work (this stage's ms over all stages')
    is from the measured share. A machine that runs everything 1.3x slower than when it was profiled
    moves every absolute error alike and no share: the shares are what a partition balances."""
    known = [(p, m) for p, m in zip(predicted, measured) if m is not None and math.isfinite(m) and m > 0]
    total_predicted, total_measured = sum(p for p, _ in known), sum(m for _, m in known)
    if len(known) != len(predicted) or not total_predicted > 0:
        return [None] * len(predicted)
    return [100.0 * ((p / total_predicted) / (m / total_measured) - 1.0) for p, m in known]


def format_fidelity(predicted: Sequence[float], measured: Sequence[Optional[float]]) -> str:
    """A per-stage table: predicted ms, measured ms, error in % (the ±10 % goal of issue 26), and the
    error of the stage's share of the work (`share_errors`)."""
    lines = [f"{'stage':>5} {'predicted ms':>13} {'measured ms':>12} {'error':>7} {'share error':>12}"]
    shares = share_errors(predicted, measured)
    for stage, (want, got, share) in enumerate(zip(predicted, measured, shares)):
        if got is None or not math.isfinite(got) or got <= 0:
            lines.append(f"{stage:>5} {want:>13.2f} {'n/a':>12} {'n/a':>7} {'n/a':>12}")
        else:
            share_text = f"{share:>+11.0f}%" if share is not None else f"{'n/a':>12}"
            lines.append(f"{stage:>5} {want:>13.2f} {got:>12.2f} {100.0 * (want - got) / got:>+6.0f}% {share_text}")
    return "\n".join(lines)
