"""Control messages between a running pipeline and whoever steers it: `Command`, `StepReport`, `ControlChannel`.

Contract (stable; the runtime calls it, the coordinator client in `model_parallel.coordinator` implements it):

- Every rank owns one channel. After every training step each rank calls `channel.report(report)`
  with one `StepReport` (milliseconds, the same shape from the metrics recorder to the
  coordinator's policy). It must not block for long (it is on the step path).
- In every step k, just before its part of the step's one reduction, rank 0 alone calls
  `channel.poll(before_step=k + 1)`; it returns `None` (carry on) or one `Command`. The decision
  travels in that reduction (the byte length of the command's JSON, 0 for none; the JSON itself
  follows in one broadcast only when there is one: `runtime.wire.step_totals`), so every rank acts
  on it at the same step boundary, after step k (before step k + 1). A command that answers the
  report of step k - 1 so lands one step after it (before, it landed right after it, at the price
  of a second collective every step). A channel may ignore `before_step` (a scripted one plays it
  exactly: `ScriptedChannel`). The commands:
    continue   -> nothing happens
    switch     -> every rank switches to `plan` (a `Plan`) before the next step,
                  moving layers, buffers and optimizer state (see `runtime.wire.migration`);
                  `schedule` (under --schedule auto only): the schedule the new plan runs
    stop       -> every rank stops cleanly after this step (checkpoint written if configured)
    slowdown   -> rank `rank` multiplies its compute time by `factor` from now on (1.0 = off);
                  straggler injection for tests, benchmarks and the demo
- `close(reason)` is called once when training ends (also after an error); `reason` says how it
  ended ("training finished", "stopped after ...", "failed: ..."), for whoever steers the run.

Wire formats (JSON, no pickle): `Command.to_json()` / `from_json()` (the plan as `Plan.to_dict()`;
unknown kinds are a `ProtocolError`) and `StepReport.to_dict()` / `from_dict()` (the coordinator's
`report` message; `from_dict` refuses non-finite, negative or absurd values, naming the field).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Protocol, runtime_checkable

from model_parallel import jsonbound
from model_parallel.errors import ModelParallelError, ProtocolError
from model_parallel.graph.in_flight import FLUSH_SCHEDULES
from model_parallel.graph.plan import Plan

COMMAND_KINDS = ("continue", "switch", "stop", "slowdown")
MAX_SLOWDOWN = 100.0  # a larger factor would stall the slowed rank (and so the whole pipeline) for good


@dataclass(frozen=True)
class Command:
    """One decision taken by rank 0 at a step boundary and applied by every rank."""

    kind: str
    plan: Optional[Plan] = None  # for "switch": the new plan
    rank: Optional[int] = None  # for "slowdown": which rank
    factor: float = 1.0  # for "slowdown": compute time multiplier (>= 1; 1 = no slowdown)
    reason: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    # For "switch" under `--schedule auto`: the schedule the new plan runs (the coordinator chose it again for the
    # new plan's measured times, coordinator/rechoose.py); None keeps the running one.
    schedule: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in COMMAND_KINDS:
            raise ProtocolError(f"unknown command kind {self.kind!r}; expected one of {COMMAND_KINDS}")
        if self.schedule is not None and (self.kind != "switch" or self.schedule not in FLUSH_SCHEDULES):
            raise ProtocolError(f"a command's `schedule` names the schedule a 'switch' runs, one of "
                                f"{', '.join(FLUSH_SCHEDULES)}; got {str(self.schedule)[:40]!r} in a {self.kind!r} command")
        carried = dict(self.plan.extra).get("schedule") if isinstance(self.plan, Plan) else None  # its table's row
        if self.schedule is not None and isinstance(carried, Mapping) and carried.get("name") != self.schedule:
            raise ProtocolError(f"a 'switch' command runs schedule {self.schedule!r} but its plan's table says "
                                f"{str(carried.get('name'))[:40]!r}; they must agree")
        if self.kind == "switch" and not isinstance(self.plan, Plan):
            raise ProtocolError("a 'switch' command needs the new plan (a Plan) in `plan`")
        if self.plan is not None and not isinstance(self.plan, Plan):
            raise ProtocolError(f"a command's `plan` must be a Plan or None, got {str(self.plan)[:60]!r}")
        if not isinstance(self.extra, Mapping):
            raise ProtocolError(f"a command's `extra` must be an object, got {str(self.extra)[:60]!r}")
        if not math.isfinite(float(self.factor)):
            raise ProtocolError(f"a command's `factor` must be a finite number, got {self.factor!r}")
        if self.kind == "slowdown":
            if self.rank is None or int(self.rank) < 0:
                raise ProtocolError(f"a 'slowdown' command needs a rank >= 0, got {self.rank!r}")
            if not 1.0 <= float(self.factor) <= MAX_SLOWDOWN:
                raise ProtocolError(f"slowdown factor must be >= 1.0 and <= {MAX_SLOWDOWN:g} (1.0 = off), got {self.factor!r}")

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def proceed(cls) -> "Command":
        return cls("continue")

    @classmethod
    def switch(cls, plan: Plan, reason: str = "", schedule: Optional[str] = None) -> "Command":
        return cls("switch", plan=plan, reason=reason, schedule=schedule)

    @classmethod
    def stop(cls, reason: str = "") -> "Command":
        return cls("stop", reason=reason)

    @classmethod
    def slowdown(cls, rank: int, factor: float, reason: str = "") -> "Command":
        return cls("slowdown", rank=int(rank), factor=float(factor), reason=reason)

    # ---- wire format ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "rank": self.rank,
            "factor": self.factor,
            "reason": self.reason,
            "extra": dict(self.extra),
        }
        if self.schedule is not None:  # absent otherwise: the message is the one it was before the field
            out["schedule"] = self.schedule
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> "Command":
        if not isinstance(data, Mapping) or "kind" not in data:
            raise ProtocolError(f"a command must be a JSON object with a 'kind', got {str(data)[:80]!r}")
        plan, extra, schedule = data.get("plan"), data.get("extra") or {}, data.get("schedule")
        if not (plan is None or isinstance(plan, Mapping)) or not isinstance(extra, Mapping):
            raise ProtocolError(f"malformed command {str(data)[:80]!r}: `plan` and `extra` must be JSON objects")
        if not (schedule is None or isinstance(schedule, str)):
            raise ProtocolError(f"malformed command {str(data)[:80]!r}: `schedule` must be a schedule's name or absent")
        try:
            return cls(
                kind=str(data["kind"]),
                plan=None if plan is None else Plan.from_dict(dict(plan), source=f"{data['kind']!s:.20} command's plan"),
                # Numbers as JSON numbers: int() would take True, "٣" or 1e300 (a slowdown of a rank none has).
                rank=None if data.get("rank") is None else jsonbound.json_number(data["rank"], "rank", integer=True),
                factor=jsonbound.json_number(data.get("factor", 1.0), "factor"),
                reason=jsonbound.json_typed(data.get("reason", ""), str, "reason"),
                extra=dict(extra),
                schedule=schedule,
            )
        except ProtocolError:
            raise
        # A hostile plan can fail inside Plan.from_dict in more ways than PlanError (a stage that is not an object).
        except (ModelParallelError, AttributeError, TypeError, ValueError, OverflowError) as error:
            raise ProtocolError(f"malformed command {str(data)[:80]!r}: {error}") from None

    @classmethod
    def from_json(cls, text: str) -> "Command":
        data = jsonbound.loads(text, where="command", error=ProtocolError, fix=f"got {text[:80]!r}")
        return cls.from_dict(data)


# The largest plausible value of each timing field: a step of a day, a billion samples per second.
DAY_MS = 86_400_000.0
REPORT_LIMITS = {"step_ms": DAY_MS, "compute_ms": DAY_MS, "comm_ms": DAY_MS, "idle_ms": DAY_MS, "samples_per_s": 1e9}
IDLE_SLACK_MS = 1.0  # idle = step - compute - comm can come out a hair below zero from rounding


@dataclass(frozen=True)
class StepReport:
    """One rank's account of one training step, in milliseconds: what the metrics recorder measured,
    what the channel sends and what the coordinator's policy reads (`compute_ms` per plan version)."""

    rank: int
    step: int
    plan_version: int
    stage: Optional[int]  # None on a spare rank (no stage under this plan)
    step_ms: float
    compute_ms: float
    comm_ms: float
    idle_ms: float  # step - compute - comm: bubbles, data loading, Python overhead
    samples_per_s: float  # the pipeline's samples (global minibatch) / this rank's step time
    loss: Optional[float] = None  # None when not finite (the metrics file keeps the NaN) or unknown

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def problems(self) -> list[str]:
        """What makes this report unusable (non-finite, negative or absurd values), each naming its field."""
        found = []
        for name in ("rank", "step", "plan_version", "stage"):
            value = getattr(self, name)
            if name == "stage" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                found.append(f"{name}={value!r} is not an integer")
            elif value < 0:
                found.append(f"{name}={value} is negative")
        for name, limit in REPORT_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                found.append(f"{name}={value!r} is not a number")
            elif not math.isfinite(value):
                found.append(f"{name}={value} is not finite")
            elif value < (-IDLE_SLACK_MS if name == "idle_ms" else 0.0):
                found.append(f"{name}={value:g} is negative")
            elif value > limit:
                found.append(f"{name}={value:g} exceeds {limit:g}")
        if self.loss is not None and (not isinstance(self.loss, (int, float)) or isinstance(self.loss, bool)
                                      or not math.isfinite(self.loss)):
            found.append(f"loss={self.loss!r} is not a finite number (send null for an unknown loss)")
        return found

    @classmethod
    def from_dict(cls, data: Any) -> "StepReport":
        """Parse and check a report read from the wire; any defect is a ProtocolError naming the field(s).

        The frame decoder only checks types; a report that passes it but says `compute_ms=1e308`
        would turn speeds into 0 or inf and the solver's input into nonsense, so it is refused here."""
        if not isinstance(data, Mapping):
            raise ProtocolError(f"a step report must be a JSON object, got {str(data)[:80]!r}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data and n != "loss"]
        where = f"step report of rank {data.get('rank')!r} for step {data.get('step')!r}"
        if missing:
            raise ProtocolError(f"{where}: missing field(s) {missing}; run the same model_parallel version everywhere")
        report = cls(**{n: data[n] for n in names if n in data})
        found = report.problems()
        if found:
            raise ProtocolError(f"{where}: " + "; ".join(found) + " (a clock or metrics bug on that worker)")
        return report


@runtime_checkable
class ControlChannel(Protocol):
    """What the runtime needs from a controller; see the module docstring for the contract."""

    def report(self, report: StepReport) -> None: ...

    def poll(self, before_step: Optional[int] = None) -> Optional[Command]: ...

    def close(self, reason: str = "") -> None: ...


class NullChannel:
    """No controller: reports are dropped, the run always continues."""

    def report(self, report: StepReport) -> None:
        pass

    def poll(self, before_step: Optional[int] = None) -> Optional[Command]:
        return None

    def close(self, reason: str = "") -> None:
        pass


class ScriptedChannel:
    """A controller that plays a fixed script: `{step: Command}` is applied before step `step` runs.

    Steps count from 0; the command for step k is returned by `poll(before_step=k)` (what the runtime
    asks in step k - 1) or, without `before_step`, by the `poll()` that follows the report of step
    k - 1. So step 0 cannot be scripted: the initial plan is the one the run starts with. Reports are
    kept in `self.reports` for tests.
    """

    def __init__(self, script: Mapping[int, Command]) -> None:
        bad = [k for k in script if int(k) < 1]
        if bad:
            raise ProtocolError(f"scripted commands apply before step >= 1, got step(s) {bad}")
        self.script = {int(k): v for k, v in script.items()}
        self.reports: list[StepReport] = []
        self._last_step = -1

    def report(self, report: StepReport) -> None:
        self.reports.append(report)
        self._last_step = max(self._last_step, int(report.step))

    def poll(self, before_step: Optional[int] = None) -> Optional[Command]:
        return self.script.get(self._last_step + 1 if before_step is None else before_step)

    def close(self, reason: str = "") -> None:
        pass

    @classmethod
    def from_json(cls, text: str) -> "ScriptedChannel":
        """Parse `{"5": {"kind": "switch", "plan": {...}}, "9": {"kind": "stop"}}`."""
        data = jsonbound.loads(text, where="control script", error=ProtocolError,
                               fix='expected {"<step>": {"kind": "switch"|"stop"|"slowdown", ...}}')
        if not isinstance(data, Mapping):
            raise ProtocolError("a control script must be a JSON object {step: command}")
        script = {}
        for key, value in data.items():
            try:
                step = int(key)
            except ValueError:
                raise ProtocolError(f"control script: step keys must be integers, got {key[:40]!r}") from None
            try:
                script[step] = Command.from_dict(value)
            except ProtocolError as error:
                raise ProtocolError(f"control script, step {step}: {error}") from None
        return cls(script)
