"""The control path between a running pipeline and whoever steers it: `ControlChannel` and `Command`.

Contract (stable; the coordinator client in `model_parallel.coordinator` implements it):

- Every rank owns one channel. After every training step each rank calls
  `channel.report(metrics)` with a JSON-able dict (at least `rank`, `step`, `plan_version`,
  `stage` (None on a spare), `step_s`, `compute_s`, `comm_s`, `idle_s`, `samples`; see
  `model_parallel.runtime.worker.step_metrics`). It must not block for long (it is on the step path).
- Then rank 0 alone calls `channel.poll()`; it returns `None` (carry on) or one `Command`.
  The runtime broadcasts that decision from rank 0 to all ranks over a gloo group (the command's
  JSON in a uint8 tensor), so every rank acts on it at the same step boundary:
    continue   -> nothing happens
    switch     -> every rank switches to `plan` (a `Plan.to_dict()`) before the next step,
                  moving layers, buffers and optimizer state (see `runtime.migration`)
    stop       -> every rank stops cleanly after this step (checkpoint written if configured)
    slowdown   -> rank `rank` multiplies its compute time by `factor` from now on (1.0 = off);
                  straggler injection for tests, benchmarks and the demo
- `close(reason)` is called once when training ends (also after an error); `reason` says how it
  ended ("training finished", "stopped after ...", "failed: ..."), for whoever steers the run.

`Command.to_json()` / `Command.from_json()` is the wire format (no pickle); unknown kinds are a
`ProtocolError`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

from model_parallel import jsonbound
from model_parallel.errors import ProtocolError

COMMAND_KINDS = ("continue", "switch", "stop", "slowdown")
MAX_SLOWDOWN = 100.0  # a larger factor would stall the slowed rank (and so the whole pipeline) for good


@dataclass(frozen=True)
class Command:
    """One decision taken by rank 0 at a step boundary and applied by every rank."""

    kind: str
    plan: Optional[Mapping[str, Any]] = None  # for "switch": the new plan as Plan.to_dict()
    rank: Optional[int] = None  # for "slowdown": which rank
    factor: float = 1.0  # for "slowdown": compute time multiplier (>= 1; 1 = no slowdown)
    reason: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in COMMAND_KINDS:
            raise ProtocolError(f"unknown command kind {self.kind!r}; expected one of {COMMAND_KINDS}")
        if self.kind == "switch" and not isinstance(self.plan, Mapping):
            raise ProtocolError("a 'switch' command needs the new plan (Plan.to_dict()) in `plan`")
        if self.plan is not None and not isinstance(self.plan, Mapping):
            raise ProtocolError(f"a command's `plan` must be an object (Plan.to_dict()) or null, got {str(self.plan)[:60]!r}")
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
    def switch(cls, plan: Any, reason: str = "") -> "Command":
        """Switch to `plan` (a `Plan` or its dict)."""
        data = plan.to_dict() if hasattr(plan, "to_dict") else plan
        return cls("switch", plan=data, reason=reason)

    @classmethod
    def stop(cls, reason: str = "") -> "Command":
        return cls("stop", reason=reason)

    @classmethod
    def slowdown(cls, rank: int, factor: float, reason: str = "") -> "Command":
        return cls("slowdown", rank=int(rank), factor=float(factor), reason=reason)

    # ---- wire format ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "plan": dict(self.plan) if self.plan is not None else None,
            "rank": self.rank,
            "factor": self.factor,
            "reason": self.reason,
            "extra": dict(self.extra),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> "Command":
        if not isinstance(data, Mapping) or "kind" not in data:
            raise ProtocolError(f"a command must be a JSON object with a 'kind', got {str(data)[:80]!r}")
        plan, extra = data.get("plan"), data.get("extra") or {}
        if not (plan is None or isinstance(plan, Mapping)) or not isinstance(extra, Mapping):
            raise ProtocolError(f"malformed command {str(data)[:80]!r}: `plan` and `extra` must be JSON objects")
        try:
            return cls(
                kind=str(data["kind"]),
                plan=dict(plan) if plan is not None else None,
                rank=None if data.get("rank") is None else int(data["rank"]),
                factor=float(data.get("factor", 1.0)),
                reason=str(data.get("reason", "")),
                extra=dict(extra),
            )
        except (TypeError, ValueError, OverflowError) as error:
            raise ProtocolError(f"malformed command {str(data)[:80]!r}: {error}") from None

    @classmethod
    def from_json(cls, text: str) -> "Command":
        data = jsonbound.loads(text, where="command", error=ProtocolError, fix=f"got {text[:80]!r}")
        return cls.from_dict(data)


@runtime_checkable
class ControlChannel(Protocol):
    """What the runtime needs from a controller; see the module docstring for the contract."""

    def report(self, metrics: dict[str, Any]) -> None: ...

    def poll(self) -> Optional[Command]: ...

    def close(self, reason: str = "") -> None: ...


class NullChannel:
    """No controller: metrics are dropped, the run always continues."""

    def report(self, metrics: dict[str, Any]) -> None:
        pass

    def poll(self) -> Optional[Command]:
        return None

    def close(self, reason: str = "") -> None:
        pass


class ScriptedChannel:
    """A controller that plays a fixed script: `{step: Command}` is applied before step `step` runs.

    Steps count from 0; the command for step k is returned by the `poll()` that follows the report
    of step k-1 (so step 0 cannot be scripted: the initial plan is the one the run starts with).
    Reports are kept in `self.reports` for tests.
    """

    def __init__(self, script: Mapping[int, Command]) -> None:
        bad = [k for k in script if int(k) < 1]
        if bad:
            raise ProtocolError(f"scripted commands apply before step >= 1, got step(s) {bad}")
        self.script = {int(k): v for k, v in script.items()}
        self.reports: list[dict[str, Any]] = []
        self._last_step = -1

    def report(self, metrics: dict[str, Any]) -> None:
        self.reports.append(dict(metrics))
        self._last_step = max(self._last_step, int(metrics.get("step", self._last_step + 1)))

    def poll(self) -> Optional[Command]:
        return self.script.get(self._last_step + 1)

    def close(self, reason: str = "") -> None:
        pass

    @classmethod
    def from_json(cls, text: str) -> "ScriptedChannel":
        """Parse `{"5": {"kind": "switch", "plan": {...}}, "9": {"kind": "stop"}}`."""
        data = jsonbound.loads(text, where="control script", error=ProtocolError,
                               fix='expected {"<step>": {"kind": "switch"|"stop"|"slowdown", ...}}')
        if not isinstance(data, Mapping):
            raise ProtocolError("a control script must be a JSON object {step: command}")
        try:
            return cls({int(k): Command.from_dict(v) for k, v in data.items()})
        except ValueError as error:
            raise ProtocolError(f"control script: step keys must be integers ({error})") from None
