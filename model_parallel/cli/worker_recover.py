"""`--recover`: a worker that loses a peer re-forms the world with the other survivors and trains on, in the same
process, from a live replica of the lost stage, a `--redundancy` copy of it, or the latest committed checkpoint
(docs/reliability.md, "Recovery inside the job").

Per failure (a PeerError naming the lost rank): take this rank's stage state before the failed engine goes, stop
this world's heartbeats, abandon the broken process group, meet the survivors in a new generation
(`runtime/wire/recovery.py`), agree on the source and commit a live one as a checkpoint (`cli/recover_sources.py`),
build the job for the new world size with the even split (the rule a `--resume` on another worker count applies:
`--plan`, `--num_stages` and `--stage_to_num_ranks` describe the first world only) under the asked schedule, or its
one-stage-per-rank stand-in where it cannot run (cli/recover_schedule.py), restore the latest committed
checkpoint exactly as `--resume` does (its configuration checks included) and train to `--steps`. One line per recovery names
who was lost, the new world, what was restored from where, the steps recomputed and the seconds from the
detection to the first completed step; the last line lists them all, and `--metrics` gets one
`{"event": "recovery", ...}` record per recovery.

What cannot be survived ends the process: no committed checkpoint (exit 3, naming the lost rank and the
command that starts over), a survivor the others declared lost (it stood still, or registered after the
new world closed: exit 6, "replaced"), survivors that cannot meet (exit 3).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from model_parallel.cli.recover_coordinator import known_version
from model_parallel.cli.recover_hooks import arm_signal_hook, signal_at_recovery, signal_at_reform
from model_parallel.cli.worker_exit import EXIT_PEER, EXIT_REPLACED, leave, resume_hint
from model_parallel.errors import ConfigError, PeerError, ReplacedError, TrainingStopped

logger = logging.getLogger(__name__)


def check_recover_flags(args: Any) -> None:
    """What `--recover` (and `--redundancy`) cannot work with, refused before joining (one line, exit 2)."""
    if getattr(args, "redundancy", 0):
        if not args.recover:
            raise ConfigError("--redundancy 1 needs --recover: the copies it keeps only serve a recovery inside the job; "
                              "add --recover (with --checkpoint_dir)")
        if args.schedule == "pipedream":
            raise ConfigError("--redundancy 1 with --schedule pipedream: that schedule updates after every microbatch, "
                              "so no snapshot belongs to one step; use a flush schedule (1f1b, gpipe, interleaved)")
        if args.redundancy_every < 1:
            raise ConfigError(f"--redundancy_every {args.redundancy_every}: give a number of steps >= 1")
    if not args.recover:
        return
    from model_parallel.cli.served_job import wants_served_job

    if wants_served_job(args):
        raise ConfigError("--recover with a job the coordinator serves (no --model/--package/--graph): a re-formed world "
                          "rebuilds its job from the command line; give the model on it (e.g. --package DIR)")
    if args.jobs:
        raise ConfigError("--recover with --jobs: recovery continues one run; give the job's flags directly")
    if args.single_process:
        raise ConfigError("--recover with --single_process: one process has no peer to lose")
    if args.rank is None or os.environ.get("TORCHELASTIC_RUN_ID"):
        raise ConfigError("--recover needs a world joined with --rank/--world_size/--dist_addr: under torchrun its agent "
                          "restarts every worker after a failure, and the restart resumes from the checkpoint by itself; "
                          "drop --recover there")
    if not args.checkpoint_dir:
        raise ConfigError("--recover needs --checkpoint_dir (and --checkpoint_every K): survivors continue from the "
                          "latest committed checkpoint")


@dataclass(frozen=True)
class RecoveryRecord:
    """One survived failure: who was lost, the world after it, what was restored from where, how long it took."""

    me: int  # the original rank of the process that recorded it
    generation: int
    lost: tuple[int, ...]  # original ranks that left the world
    world: tuple[int, ...]  # original ranks of the new world (new rank = index)
    store: str  # host:port of the store the new world met at
    checkpoint_dir: str
    checkpoint_step: int  # the committed checkpoint restored
    done_before: int  # steps this rank had completed before the failure
    continued_at: int  # the first step run after it
    seconds: float  # detection -> first completed step (inf: the run had no step left)
    source_kind: str = "checkpoint"  # "replica" or "redundancy": live states, committed as checkpoint_step (cli/recover_sources.py)
    source: str = ""  # what they were: "the replica of stage 0 on original rank 0"
    why: str = ""  # why no live copy was used (a checkpoint restored although the step was not committed)

    @property
    def recomputed(self) -> int:
        return max(0, self.done_before - self.continued_at)

    def line(self) -> str:
        restored = (f"restored step {self.checkpoint_step} from {self.source} (committed as checkpoint step "
                    f"{self.checkpoint_step} in {self.checkpoint_dir})" if self.source_kind != "checkpoint" else
                    f"restored checkpoint step {self.checkpoint_step} from {self.checkpoint_dir}")
        return (f"[original rank {self.me}] recovery {self.generation}: lost original rank(s) {list(self.lost)}; new world of {len(self.world)} "
                f"(original ranks {list(self.world)}, met at {self.store}); {restored}; recomputed {self.recomputed} step(s) "
                f"(continued at step {self.continued_at}); {self.seconds:.2f} s from detection to the first completed step"
                + (f"; no live copy: {self.why}" if self.why else ""))

    def to_json(self) -> dict[str, Any]:
        return {"event": "recovery", **dataclasses.asdict(self), "recomputed": self.recomputed}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RecoveryRecord":
        """A record `to_json` wrote (a metrics file line); extra keys are ignored, missing ones a ValueError
        (except those with a default: a record written before recovery sources existed)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name in data or f.default is dataclasses.MISSING]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"a recovery record lacks {missing}: {str(data)[:120]}")
        return cls(**{n: tuple(data[n]) if isinstance(data[n], list) else data[n] for n in names})


class Survivor:
    """One worker process under `--recover`: its current world, heartbeats and the failures it survived."""

    def __init__(self, args: Any, argv: list[str], config: Any, options: Any, world: Any, health: Any, prefix: Any,
                 run_one: Callable[..., Any], lineage: Any = None) -> None:
        from model_parallel.cli.worker_join import publish
        from model_parallel.runtime.wire.recovery import first_lineage

        self.args, self.argv, self.config, self.options = args, argv, config, options
        self.world, self.health, self.prefix, self.run_one = world, health, prefix, run_one
        self.backend = "nccl" if world.device.type == "cuda" else "gloo"  # the first world's choice, kept
        # A joiner (cli/worker_join.py) arrives with the lineage of the world that admitted it.
        self.lineage = lineage or first_lineage(world.rank, world.world_size, world.store, world.store_address, options.timeout)
        self.records: list[Any] = []  # RecoveryRecord, and worker_join.JoinRecord per admission
        self._pending: Optional[tuple[float, Any]] = None  # (detected at, record without its seconds)
        self._known = 0  # the newest plan version this process knew of (cli/recover_coordinator.py)
        self._live_plan: Any = None  # the plan of the world that failed or admitted (an admission keeps it)
        self.admitting: Any = None  # the Admission an admission stop carries (worker_join.watch_joins)
        self._tracker: Any = None  # the running engine's live.StepTracker: which step its state belongs to
        self.redundancy: Any = None  # --redundancy 1: cli/redundancy.Redundancy
        if getattr(args, "redundancy", 0):
            from model_parallel.cli.redundancy import Redundancy

            self.redundancy = Redundancy(args.redundancy_every, self.lineage.me)
        publish(self)

    @property
    def rank(self) -> int:
        return int(self.world.rank)

    def train(self) -> Any:
        """Train to --steps, recovering from each lost peer; returns the heartbeats of the world that finished."""
        from model_parallel.cli.recover_schedule import fit_schedule

        args, options, config = self.args, self.options, self.config
        if self.lineage.generation > 0:  # a joiner: its first world is a re-formed one
            args, config = fit_schedule(args, config, self.world.world_size, self.rank)
        while True:
            try:
                self.run_one(args, config, options, self.world, self.health, self.prefix, None, self._watch)
                break
            except (PeerError, TrainingStopped) as error:
                if isinstance(error, TrainingStopped) and self.admitting is None:
                    raise  # a stop command, not an admission: the run ends here
                detected = time.monotonic()
                engine = self.prefix.engine
                done_before = steps_done(engine, self._tracker)
                # The stage state as the failure left it, before the engine goes (a live replica: cli/recover_sources.py).
                live = self._holdings(engine) if isinstance(error, PeerError) else ([], "", None)
                engine, self._tracker = None, None
                # The plan versions spent so far (--coordinator), kept across failures: one before the engine exists
                # (a second failure during a recovery) must not number the next plan lower.
                self._known = known = max(self._known, known_version(self.prefix.engine))
                # An admission under a coordinator keeps the plan this world ran (the joiner a spare in it).
                self._live_plan = self.prefix.engine.plan if self.prefix.engine is not None else None
                # The failed engine (its stage, optimizer state, group handles) goes before the next one is built:
                # the exception's frames would keep it alive.
                error.__traceback__, error.__context__, error.__cause__, self.prefix.engine = None, None, None, None
                if isinstance(error, TrainingStopped):  # a worker joins at this step boundary (cli/worker_join.py)
                    from model_parallel.cli.worker_join import admit

                    admit(self, detected, done_before)
                else:
                    self._recover(error, done_before, detected, *live)
                live = ([], "", None)
                # Every later world: the even split for its size, the latest committed checkpoint, each process's own files
                # (and, under a coordinator, the generation it registers in: cli/recover_coordinator.py).
                args = argparse.Namespace(**{**vars(self.args), "plan": None, "num_stages": None, "stage_to_num_ranks": None,
                                             "recovered": self._recovered(known) if self.args.coordinator else None})
                # The asked schedule when it fits the new world, else its one-stage-per-rank stand-in (one line).
                args, config = fit_schedule(args, self.config, self.world.world_size, self.rank)
                metrics = options.metrics.replace("{rank}", str(self.lineage.me)) if options.metrics else None
                options = dataclasses.replace(self.options, resume=True, metrics=metrics)
        if self._pending is not None:  # the checkpoint held every requested step: nothing left to run
            self._finish_pending(float("inf"))
        admissions, failures = self._split_records()
        if admissions:
            print(f"[rank {self.rank}] admitted {len(admissions)} joining worker(s)", flush=True)
        if failures:
            print(f"[rank {self.rank}] survived {len(failures)} failure(s): "
                  + "; ".join(r.line() for r in failures), flush=True)
        return self.health

    # ---- one failure ------------------------------------------------------------------------------
    def _holdings(self, engine: Any) -> tuple[list[tuple[int, Any]], str, Any]:
        """The stage states this process holds for the recovery ((original rank whose, live.StageState)), why it has
        no live one (""), and the failed engine's (graph, model) for a checkpoint's model files (None: no engine)."""
        state, why = _capture(engine, self._tracker)
        held = [(self.lineage.me, state)] if state is not None else []
        if self.redundancy is not None:
            self.redundancy.stop()
            held += [h for h in self.redundancy.holdings() if state is None or h[1].step != state.step or h[0] != self.lineage.me]
        return held, why, (engine.graph, engine.model) if engine is not None else None

    def _recover(self, error: PeerError, done_before: int, detected: float, holdings: list[tuple[int, Any]], why: str,
                 model_files: Any) -> None:
        from model_parallel.runtime.checkpoint.layout import latest_step
        from model_parallel.runtime.wire.recovery import abandon, lost_ranks, reform, was_replaced
        from model_parallel.runtime.wire.stillness import Stillness

        lineage, timeout, rank = self.lineage, self.options.timeout, self.rank
        culprit = lost_ranks(str(error))
        hint = resume_hint(self.args.checkpoint_dir, self.argv, rank)
        self.health.stop("failed", culprit, str(error))
        watching = Stillness().start()  # a stand-still from here on may leave this process behind (reform decides)
        if culprit == rank:  # this process is the one its peers gave up on (it stood still)
            record = was_replaced(lineage, max(1.0, timeout / 4))
            where = f"in generation {record}" if record else "(its peers went on without it; no record of where is readable)"
            from model_parallel.cli.worker_join import join_hint

            store = f"{lineage.addresses[lineage.store_host]}:{lineage.store_port}"  # the record was there: its host lives
            self._leave(EXIT_REPLACED, f"[rank {rank}] error: {error}; original rank {lineage.me} was declared lost and "
                                       f"replaced {where}: it does not rejoin", join_hint(self.argv, store, rank) if record else None)
        signal_at_recovery(lineage.me, rank)  # the test hook: a second failure, during this recovery
        lost = {lineage.original(culprit)} if culprit is not None and 0 <= culprit < len(lineage.members) else set()
        step = latest_step(self.args.checkpoint_dir)
        if step is None and not holdings:  # nothing here to restore from: no survivor can have every stage's state
            self._leave(EXIT_PEER, f"[rank {rank}] error: {error}; cannot recover: no committed checkpoint in "
                                   f"{self.args.checkpoint_dir} to restore the stage of original rank(s) "
                                   f"{sorted(lost) or 'unknown'} from", hint)
        logger.warning("[rank %d] %s; recovering (--recover): lost original rank(s) %s, latest committed checkpoint "
                       "step %s, states held %s%s", rank, error, sorted(lost) or "unknown", step,
                       [(of, s.step) for of, s in holdings], f" (no live state: {why})" if why else "")
        import gc

        if not abandon(0.5 * timeout):
            self._leave(EXIT_PEER, f"[rank {rank}] error: {error}; cannot recover: the broken process group did not "
                                   f"shut down within {0.5 * timeout:g} s", hint)
        gc.collect()  # the failed engine (see train)
        try:
            reformed = reform(lineage, lost, timeout, self.backend, signal_at_reform(lineage.me, rank), watching)
        except ReplacedError as replaced:
            self._leave(EXIT_REPLACED, f"[rank {rank}] error: {replaced}: it does not rejoin", None)
        except PeerError as meet:
            self._leave(EXIT_PEER, f"[rank {rank}] error: {error}; cannot recover: {meet}", hint)
        finally:
            watching.stop()
        self._adopt(reformed)
        source = self._source(error, lineage.members, reformed.dropped, (holdings, why, model_files), hint)
        record = RecoveryRecord(lineage.me, reformed.lineage.generation, reformed.dropped, reformed.lineage.members, self.world.store_address,
                                str(self.args.checkpoint_dir), source.step, done_before, source.step + 1, 0.0,
                                source.kind, source.text, source.why)
        self._pending = (detected, record)

    def _source(self, error: PeerError, old_members: tuple[int, ...], dropped: tuple[int, ...], held: Any,
                hint: Optional[str]) -> Any:
        """Agree with the new world where the lost stage comes from (cli/recover_sources.py); leave when nowhere."""
        from model_parallel.cli.recover_sources import agree_source

        try:
            source = agree_source(self.world.store, self.lineage.me, self.lineage.members, old_members, dropped, *held,
                                  str(self.args.checkpoint_dir), self.options.timeout)
        except PeerError as failed:
            self._leave(EXIT_PEER, f"[rank {self.rank}] error: {error}; cannot recover: {failed}", hint)
        if source.step is None:
            self._leave(EXIT_PEER, f"[rank {self.rank}] error: {error}; cannot recover: no committed checkpoint in "
                                   f"{self.args.checkpoint_dir} to restore the stage of original rank(s) {list(dropped)} "
                                   f"from, and no live copy ({source.why})", hint)
        return source

    def _adopt(self, reformed: Any) -> None:
        """Make the re-formed world this process's: its world, lineage, heartbeats; rank 0 publishes the flags."""
        from model_parallel.cli.worker_join import publish
        from model_parallel.runtime.run import World, start_health

        self.world = World(reformed.rank, reformed.world_size, reformed.store, self.world.device, reformed.store_host,
                           reformed.store_address)
        self.lineage = reformed.lineage
        self.prefix.rank, self.prefix.engine = self.world.rank, None
        self.health = start_health(self.world, self.options.timeout)
        publish(self)

    def _recovered(self, known: int) -> Any:
        """The new world as the coordinator hears of it, its plan version agreed by every member; after an admission
        also the plan it keeps (the joiner a spare in it until the coordinator gives it a share)."""
        from model_parallel.cli.recover_coordinator import Recovered, agree_live_plan, agree_plan_version
        from model_parallel.cli.worker_join import JoinRecord

        record = self._pending[1] if self._pending is not None else None
        joined = (record.joined,) if isinstance(record, JoinRecord) else ()
        try:
            version = agree_plan_version(self.world.store, self.lineage.me, self.lineage.members, known, self.options.timeout)
            plan = agree_live_plan(self.world.store, self.rank, self._live_plan, self.options.timeout) if joined else None
        except PeerError as error:
            self._leave(EXIT_PEER, f"[rank {self.rank}] error: cannot recover: {error}",
                        resume_hint(self.args.checkpoint_dir, self.argv, self.rank))
        self._known = version
        if record is None:  # an admitted joiner that never came: the same members in the next generation
            from model_parallel.runtime.checkpoint.layout import latest_step

            step = latest_step(self.args.checkpoint_dir)
            return Recovered(self.lineage.generation, self.lineage.members, (), 0 if step is None else step + 1, version)
        from_step = record.checkpoint_step + 1 if joined else record.continued_at
        return Recovered(record.generation, record.world, getattr(record, "lost", ()), from_step, version, joined, plan)

    def _watch(self, engine: Any) -> None:
        """Time the first completed step of a recovered run (the engine's step, wrapped once)."""
        from model_parallel.cli.worker_join import watch_joins

        from model_parallel.runtime.checkpoint.live import StepTracker

        self._tracker = StepTracker()
        self._tracker.watch(engine)  # first: the wrappers below run around it
        flush = None
        if self.redundancy is not None:  # snapshots after the tracker marked the step done
            self.redundancy.attach(engine, self.world.store, self.lineage.generation, self.lineage.members)
            flush = self.redundancy.flush
        arm_signal_hook(engine, self.lineage.me, self.rank, flush)
        watch_joins(self, engine)
        if self._pending is None:
            return
        original = engine.train_step

        def timed(step: int) -> Any:
            result = original(step)
            if self._pending is not None:
                self._pending = (self._pending[0], dataclasses.replace(self._pending[1], continued_at=engine.start_step))
                self._finish_pending(time.monotonic() - self._pending[0])
            return result

        engine.train_step = timed

    def _finish_pending(self, seconds: float) -> None:
        assert self._pending is not None
        record = dataclasses.replace(self._pending[1], seconds=seconds)
        self._pending = None
        self.records.append(record)
        print(f"[rank {self.rank}] {record.line()}", flush=True)
        if self.options.metrics:
            append_metrics(self.options.metrics.replace("{rank}", str(self.lineage.me)), record)

    def _split_records(self) -> tuple[list[Any], list[Any]]:
        """(admissions, survived failures) of this run; an admission that lost a member on the way is both (its line
        names the lost)."""
        admissions = [r for r in self.records if not isinstance(r, RecoveryRecord)]
        return admissions, [r for r in self.records if isinstance(r, RecoveryRecord) or bool(getattr(r, "lost", ()))]

    def _leave(self, code: int, line: str, hint: Optional[str]) -> Any:
        admissions, failures = self._split_records()
        done = [f"surviving {len(failures)} failure(s): " + "; ".join(r.line() for r in failures)] if failures else []
        done += [f"admitting {len(admissions)} joining worker(s)"] if admissions else []
        if done:
            line += f" (after {'; '.join(done)})"
        leave(code, line, self.rank, self.health, hint=hint, linger=code != EXIT_REPLACED)


def steps_done(engine: Any, tracker: Any) -> int:
    """The steps this rank completed before the failure (the `recomputed` count of its record): the loop counts a
    step in `next_step` only after its checkpoint and control poll, so a failure in that commit (a peer killed
    once the step's metrics line was written) left a completed step uncounted: "recomputed 1" for 2."""
    if engine is None:
        return 0
    done = getattr(tracker, "done", None) if tracker is not None else None
    return max(int(engine.next_step), done + 1 if done is not None else 0)


def _capture(engine: Any, tracker: Any) -> tuple[Any, str]:
    """(the engine's live.StageState, "") or (None, why it has none)."""
    if engine is None or tracker is None:
        return None, "it had no engine (a failure while building or restoring)"
    from model_parallel.runtime.checkpoint.live import capture

    try:
        return capture(engine, tracker)
    except Exception as error:  # noqa: BLE001 - a state that cannot be taken only costs the live source
        logger.warning("taking the live stage state failed: %s: %s", type(error).__name__, error)
        return None, f"taking its stage state failed ({type(error).__name__})"


def append_metrics(path: str, record: RecoveryRecord) -> None:
    """One JSON line per recovery in the metrics file (a failure to write it is a warning, never fatal)."""
    try:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record.to_json()) + "\n")
    except OSError as error:
        logger.warning("metrics file %s: %s; the recovery record is only in the log", path, error)
