"""The plan: which nodes form each stage, on which ranks (the machines it targets: graph/hierarchy.py).

A `Plan` is what the optimizer returns, what the code generator and the runtime consume, and what
the coordinator versions while training (plan v, v+1, ...). It prints as a table and reads/writes
`plan.json`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from model_parallel.errors import PlanError
from model_parallel.graph.hierarchy import MAX_RANKS
from model_parallel.fileio import atomic_write_json, read_json_file
from model_parallel.jsonbound import json_number as _number
from model_parallel.jsonbound import json_typed

if TYPE_CHECKING:  # only the annotation: graph/core.py is not needed to read or write a plan
    from model_parallel.graph.core import Graph

PLAN_SCHEMA = "model_parallel.plan"
PLAN_VERSION = 1

@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its nodes (topological order), replicas and the ranks that run them.

    Predicted costs are per minibatch: `compute_s` for the whole stage before dividing among
    replicas, `communication_s` the largest of its input/output/all-reduce transfer times,
    `memory_bytes` what one replica holds (parameters + stashed activations).
    """

    stage_id: int
    node_ids: tuple[str, ...]
    num_replicas: int = 1
    ranks: tuple[int, ...] = ()
    compute_s: float = 0.0
    communication_s: float = 0.0
    memory_bytes: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_ids", tuple(self.node_ids))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if self.num_replicas < 1:
            raise PlanError(f"stage {self.stage_id}: needs at least one replica, got {self.num_replicas}")
        if self.num_replicas > MAX_RANKS:
            raise PlanError(f"stage {self.stage_id}: {_shorten(self.num_replicas)} replicas exceed {MAX_RANKS}, the most ranks a "
                            "plan may place; a stage's replicas are bounded by the world size (the workers started)")
        if any(r < 0 for r in self.ranks):
            raise PlanError(f"stage {self.stage_id}: ranks must be >= 0, got {list(self.ranks)}")
        if any(r >= MAX_RANKS for r in self.ranks):
            raise PlanError(f"stage {self.stage_id}: rank {_shorten(max(self.ranks))} is beyond {MAX_RANKS - 1}, the largest "
                            "rank a plan may place; ranks are bounded by the world size (the workers started)")
        if self.ranks and len(self.ranks) != self.num_replicas:
            raise PlanError(
                f"stage {self.stage_id}: {self.num_replicas} replica(s) but {len(self.ranks)} rank(s) {list(self.ranks)}"
            )



def measured_calibration(extra: Any) -> Optional[float]:
    """The factor from the profile's ms to this machine's when a plan's times are measured ones (the coordinator's
    policy solves on the calibrated profile and records `time_scale` and `calibration` in `extra`), else None: its
    times are the profile's."""
    if isinstance(extra, Mapping) and extra.get("time_scale") == "measured" and isinstance(extra.get("calibration"), (int, float)):
        return float(extra["calibration"])
    return None

@dataclass(frozen=True)
class Plan:
    """A partition of a graph into pipeline stages, placed on worker ranks.

    `time_per_minibatch_s` is the predicted time of the slowest stage (PipeDream's "Time per stage
    in pipeline"); `single_machine_time_s` the whole model on one worker. `version` counts plans
    during a run (the coordinator increments it on every rebalance).
    """

    stages: tuple[StagePlan, ...]
    time_per_minibatch_s: float = 0.0
    single_machine_time_s: float = 0.0
    optimizer_seconds: float = field(default=0.0, compare=False)  # how long the solve took: not part of the plan
    num_machines: tuple[int, ...] = ()
    version: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        for index, stage in enumerate(self.stages):
            if stage.stage_id != index:
                raise PlanError(f"stage ids must be 0..{len(self.stages) - 1} in order; position {index} has {stage.stage_id}")
        seen: dict[str, int] = {}
        for stage in self.stages:
            for node_id in stage.node_ids:
                if node_id in seen:
                    raise PlanError(f"node {node_id!r} is in stages {seen[node_id]} and {stage.stage_id}")
                seen[node_id] = stage.stage_id
        total = sum(s.num_replicas for s in self.stages)
        if total > MAX_RANKS:
            raise PlanError(f"the plan's stages have {total} replicas in all, more than {MAX_RANKS}, the most ranks a plan "
                            "may place; replicas are bounded by the world size (the workers started)")
        ranks = [r for s in self.stages for r in s.ranks]
        if len(ranks) != len(set(ranks)) and not self.several_stages_per_rank:
            raise PlanError(f"a rank runs two stages: {sorted(ranks)}; only stages in loop placement (replica i of "
                            "stage k on rank k % p + i*p, for the interleaved schedules) or stages in a V (replica i of "
                            "stage k on rank min(k, 2p-1-k) + i*p, for zbv) may share a rank")

    # ---- views ---------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        """Ranks the plan occupies: its replicas, or fewer where ranks hold several stages (loop placement)."""
        if all(s.ranks for s in self.stages):
            return len({r for s in self.stages for r in s.ranks})
        return sum(s.num_replicas for s in self.stages)

    @property
    def is_loop_placement(self) -> bool:
        """Several stages per rank, stage k on rank k % p (p*v stages): interleaved 1F1B. `loop_width` is p."""
        return self.loop_width > 0

    @property
    def loop_width(self) -> int:
        """p of a loop placement, else 0: p*v stages (v >= 2), each on r ranks, replica i of stage k on rank
        k % p + i*p (r = 1: stage k on rank k % p), so ranks i*p .. i*p + p - 1 form replica i of the pipeline."""
        ranks = [s.ranks for s in self.stages]
        p = len({r for rs in ranks for r in rs}) // max(len(ranks[0]), 1)
        return p if (p >= 1 and len(self.stages) % p == 0 and len(self.stages) > p
                     and all(rs == tuple(k % p + i * p for i in range(len(ranks[0]))) for k, rs in enumerate(ranks))) else 0

    @property
    def several_stages_per_rank(self) -> bool:
        """Loop placement (interleaved schedules) or a V (zbv): the placements where ranks hold several stages."""
        return self.is_loop_placement or self.is_v_placement

    @property
    def is_v_placement(self) -> bool:
        """2p stages on p >= 2 ranks per replica, stage k on rank k for k < p and 2p-1-k after (ZBV's V)."""
        return self.v_width > 0

    @property
    def v_width(self) -> int:
        """p of a V placement, else 0: 2p stages (p >= 2), each on r >= 1 ranks, replica i of stage k on rank
        min(k, 2p-1-k) + i*p, so ranks i*p .. i*p + p - 1 form replica i of the V."""
        ranks = [s.ranks for s in self.stages]
        p, r = len(ranks) // 2, len(ranks[0])
        return p if (p >= 2 and r >= 1 and len(ranks) == 2 * p and all(
            rs == tuple(min(k, 2 * p - 1 - k) + i * p for i in range(r)) for k, rs in enumerate(ranks))) else 0

    @property
    def stage_of(self) -> dict[str, int]:
        return {n: s.stage_id for s in self.stages for n in s.node_ids}

    @property
    def stage_to_ranks(self) -> dict[int, tuple[int, ...]]:
        return {s.stage_id: s.ranks for s in self.stages}

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages a rank runs (several under loop placement; none for a spare), in stage order."""
        return tuple(stage.stage_id for stage in self.stages if rank in stage.ranks)

    def stage_of_rank(self, rank: int) -> Optional[int]:
        """The stage a rank runs, or None for a spare rank that holds no stage. A rank holding several
        stages (loop placement) raises: code that knows of them calls `stages_of_rank`."""
        held = self.stages_of_rank(rank)
        if len(held) > 1:
            raise PlanError(f"rank {rank} runs stages {list(held)} (loop placement, interleaved schedule): it has no one "
                            "stage; use Plan.stages_of_rank")
        return held[0] if held else None

    def with_default_ranks(self) -> "Plan":
        """Assign ranks 0.. in stage order to stages that have none (replicas of a stage are adjacent)."""
        if all(s.ranks for s in self.stages):
            return self
        next_rank = 0
        stages = []
        for stage in self.stages:
            ranks = tuple(range(next_rank, next_rank + stage.num_replicas))
            next_rank += stage.num_replicas
            stages.append(replace(stage, ranks=ranks))
        return replace(self, stages=tuple(stages))

    # ---- text ------------------------------------------------------------------------------------
    def table(self) -> str:
        """A plain-text table: one row per stage."""
        header = f"{'stage':>5} {'nodes':>6} {'replicas':>8} {'ranks':<12} {'compute ms':>11} {'comm ms':>9} {'memory MB':>10}  first..last node"
        rows = [header, "-" * len(header)]
        for s in self.stages:
            span = f"{s.node_ids[0]}..{s.node_ids[-1]}" if s.node_ids else "-"
            rows.append(
                f"{s.stage_id:>5} {len(s.node_ids):>6} {s.num_replicas:>8} {','.join(map(str, s.ranks)) or '-':<12} "
                f"{s.compute_s * 1e3:>11.3f} {s.communication_s * 1e3:>9.3f} {s.memory_bytes / 1e6:>10.1f}  {span}"
            )
        # PipeDream's estimates price stashed copies, not what a worker holds: its last stage read "0.0" MB.
        legacy = {"pipedream": "PipeDream's estimate (copies stashed for the stages downstream: the last stage 0)",
                  "1f1b": "the 1f1b estimate (a weight and activation copy per microbatch in flight)"}.get(
                      str(self.extra.get("memory_model")))
        if legacy is not None:
            rows.append(f"memory MB: {legacy}, not the bytes a worker holds (partition --memory_model footprint prices those)")
        # A loop or V plan cut by optimizer/loop.py states its time as its slowest RANK's stages summed: say which it is.
        of = self.extra.get("time_per_minibatch_of")
        slowest = of[:60] if isinstance(of, str) and of.isprintable() else "slowest stage"
        # Every time in the table is on one scale, which the table says (coordinator/status.plan_times_label says more).
        calibration = measured_calibration(self.extra)
        scale = "the profile's ms" if calibration is None else f"this machine's ms (the profile's x {calibration:.3g})"
        rows.append(
            f"time per minibatch ({slowest}): {self.time_per_minibatch_s * 1e3:.3f} ms; "
            f"single machine: {self.single_machine_time_s * 1e3:.3f} ms; times in {scale}"
        )
        schedule = self.extra.get("schedule")  # the schedule `--schedule auto` chose for this plan (runtime/step/auto.py)
        if isinstance(schedule, Mapping):
            step, bubble = schedule.get("predicted_step"), schedule.get("predicted_bubble")
            if isinstance(step, (int, float)) and isinstance(bubble, (int, float)):  # not from a hand-edited file's text
                order = f", {schedule['order']} order" if schedule.get("order") in ("list", "fixed") else ""
                rows.append(f"schedule {str(schedule.get('name'))[:40]} (chosen by {str(schedule.get('chosen_by'))[:40]}): "
                            f"predicted {float(step):.1f} {str(schedule.get('unit', 'ms'))[:10]} per step, bubble "
                            f"{100 * float(bubble):.0f} %{order}")
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": PLAN_SCHEMA,
            "schema_version": PLAN_VERSION,
            "version": self.version,
            "time_per_minibatch_s": self.time_per_minibatch_s,
            "single_machine_time_s": self.single_machine_time_s,
            # (Not `optimizer_seconds`: the same solve writes the same bytes on any machine at any load.)
            "num_machines": list(self.num_machines),
            "stages": [
                {**asdict(s), "node_ids": list(s.node_ids), "ranks": list(s.ranks)} for s in self.stages
            ],
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "Plan":
        if not isinstance(data, dict) or data.get("schema") != PLAN_SCHEMA:
            raise PlanError(f"{source}: not a model_parallel plan (expected \"schema\": \"{PLAN_SCHEMA}\")")
        if data.get("schema_version") != PLAN_VERSION:
            raise PlanError(f"{source}: plan schema version {data.get('schema_version')!r} is not supported (reads {PLAN_VERSION})")
        try:
            stages = tuple(
                StagePlan(
                    stage_id=_number(s["stage_id"], "stage_id", integer=True),
                    node_ids=tuple(json_typed(n, str, "a node id") for n in json_typed(s["node_ids"], list, "node_ids")),
                    num_replicas=_number(s.get("num_replicas", 1), "num_replicas", integer=True),
                    ranks=tuple(_number(r, "a rank", integer=True) for r in json_typed(s.get("ranks", []), list, "ranks")),
                    compute_s=_number(s.get("compute_s", 0.0), "compute_s"),
                    communication_s=_number(s.get("communication_s", 0.0), "communication_s"),
                    memory_bytes=_number(s.get("memory_bytes", 0.0), "memory_bytes"),
                )
                for s in json_typed(data["stages"], list, "stages")
            )
            plan = cls(
                stages=stages,
                time_per_minibatch_s=_number(data.get("time_per_minibatch_s", 0.0), "time_per_minibatch_s"),
                single_machine_time_s=_number(data.get("single_machine_time_s", 0.0), "single_machine_time_s"),
                optimizer_seconds=_number(data.get("optimizer_seconds", 0.0), "optimizer_seconds"),
                num_machines=tuple(_number(n, "num_machines", integer=True)
                                   for n in json_typed(data.get("num_machines", []), list, "num_machines")),
                version=_number(data.get("version", 0), "version", integer=True),
                extra=dict(json_typed(data.get("extra", {}), dict, "extra")),
            )
            plan_stage_times(plan)  # refused when read, before anything runs
            return plan
        except PlanError as error:
            raise PlanError(f"{source}: {error}") from None
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            raise PlanError(f"{source}: malformed plan ({type(error).__name__}: {error})") from None


STAGE_TIMES_KEY = "stage_times"  # plan.extra: per stage [F, I, W] ms of one microbatch (the coordinator's measured ones)


def with_stage_times(plan: Plan, times: Sequence[Any]) -> Plan:
    """`plan` carrying `times` (one StageTimes-like per stage: forward_ms, input_ms, weight_ms) as its
    `stage_times`, the [F, I, W] ms every rank list-builds its zero-bubble order from."""
    entries = [[float(t.forward_ms), float(t.input_ms), float(t.weight_ms)] for t in times]
    return replace(plan, extra={**dict(plan.extra), STAGE_TIMES_KEY: entries})


def plan_stage_times(plan: Plan) -> Optional[tuple[tuple[float, float, float], ...]]:
    """`plan.extra["stage_times"]`, checked: one [F, I, W] of finite ms >= 0 per stage, or None where the plan has none
    (PlanError otherwise). The runtime list-builds its zero-bubble orders from them (runtime/step/list_order.py)."""
    given = plan.extra.get(STAGE_TIMES_KEY)
    if given is None:
        return None
    fix = "give one [forward, input-gradient, weight-gradient] ms triple per stage, or drop the entry"
    if not isinstance(given, (list, tuple)) or len(given) != plan.num_stages:
        count = len(given) if isinstance(given, (list, tuple)) else type(given).__name__
        raise PlanError(f"plan extra {STAGE_TIMES_KEY!r} has {count} entries for {plan.num_stages} stage(s); {fix}")
    times = []
    for stage, entry in enumerate(given):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise PlanError(f"plan extra {STAGE_TIMES_KEY!r}: stage {stage} has {str(entry)[:40]!r}; {fix}")
        try:
            forward, input_grad, weight_grad = (_number(v, f"stage {stage}'s time") for v in entry)
        except ValueError as error:
            raise PlanError(f"plan extra {STAGE_TIMES_KEY!r}: {error}; {fix}") from None
        if min(forward, input_grad, weight_grad) < 0:
            raise PlanError(f"plan extra {STAGE_TIMES_KEY!r}: stage {stage} has a negative time {list(entry)}; {fix}")
        times.append((forward, input_grad, weight_grad))
    return tuple(times)


def read_plan(path: Union[str, "os.PathLike[str]"]) -> Plan:
    return Plan.from_dict(read_json_file(path, PlanError, "plan"), str(path))


def write_plan(plan: Plan, path: Union[str, "os.PathLike[str]"]) -> Path:
    return atomic_write_json(path, plan.to_dict())


def plan_from_graph(graph: Graph, stage_to_num_ranks: Optional[Mapping[int, int]] = None) -> Plan:
    """A plan read off a partitioned graph's stage ids (e.g. PipeDream's gpus=N.txt), ranks in stage order."""
    if not graph.is_partitioned:
        unassigned = [n.node_id for n in graph.nodes if n.stage_id is None]
        raise PlanError(f"graph is not partitioned: {len(unassigned)} node(s) have no stage_id, e.g. {unassigned[:3]}")
    stage_ids = sorted({n.stage_id for n in graph.nodes if n.stage_id is not None})  # all of them (checked above)
    if stage_ids != list(range(len(stage_ids))):
        raise PlanError(f"stage ids must be 0..{len(stage_ids) - 1} without gaps, found {stage_ids}")
    replicas = dict(stage_to_num_ranks or {})
    unknown = sorted(set(replicas) - set(stage_ids))
    if unknown:
        raise PlanError(f"--stage_to_num_ranks names stage(s) {unknown} but the graph has stages 0..{len(stage_ids) - 1}")
    stages = tuple(
        StagePlan(stage_id=s, node_ids=graph.stage_node_ids(s), num_replicas=int(replicas.get(s, 1))) for s in stage_ids
    )
    return Plan(stages=stages).with_default_ranks()


def _shorten(number: int) -> str:
    """A huge number in an error message as its first digits and length (a 3000-digit one stays one line)."""
    text = str(number)
    return text if len(text) <= 20 else f"{text[:12]}... ({len(text)} digits)"


def _is_ascii_int(text: str) -> bool:
    text = text.strip()
    return bool(text) and text.isascii() and text.isdigit()


def parse_stage_to_num_ranks(text: str) -> dict[int, int]:
    """Parse `0:3,1:1` into {0: 3, 1: 1}."""
    result: dict[int, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        stage, sep, count = item.partition(":")
        # isdigit() also accepts '²' and other digits int() refuses: accept ASCII 0-9 only.
        if not sep or not _is_ascii_int(stage) or not _is_ascii_int(count):
            raise PlanError(f"--stage_to_num_ranks: {item[:40]!r} is not '<stage>:<replicas>' (e.g. 0:3,1:1)")
        longest = max(len(stage.strip()), len(count.strip()))
        if longest > len(str(MAX_RANKS)):  # before int(): Python refuses > 4300 digits with a bare ValueError
            raise PlanError(f"--stage_to_num_ranks: {item[:40]!r}{'...' if len(item) > 40 else ''} holds a number of "
                            f"{longest} digits; a stage id and a replica count are at most {MAX_RANKS} (e.g. 0:3,1:1)")
        if int(count) < 1:
            raise PlanError(f"--stage_to_num_ranks: {item!r} is not '<stage>:<replicas>' (e.g. 0:3,1:1)")
        if int(stage) in result:
            raise PlanError(f"--stage_to_num_ranks: stage {int(stage)} is given twice")
        result[int(stage)] = int(count)
    if not result:
        raise PlanError("--stage_to_num_ranks is empty; write e.g. 0:1,1:1,2:1")
    return result
