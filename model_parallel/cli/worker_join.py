"""`--join HOST:PORT`: a worker started later is admitted into a running `--recover` job at a step boundary and
trains a share of the re-planned pipeline (docs/reliability.md, "Join").

The joiner: compares its flags with the ones the job published (a mismatch: exit 2 before anything changes),
posts a join request in the job's store and waits (a bounded number of --timeouts) for rank 0 to take it.
The job: rank 0 looks at the request slot after every step (one store `check`); a request becomes a `stop`
command whose `extra` carries the admission, broadcast on the per-step control path, so every rank acts on it
at the same step. Every rank commits a checkpoint of that step (the loop's stop path), abandons the world and
meets the joiner in the next generation (runtime/wire/recovery.py's `reform`, the joiner the last member), then
builds the job for N+1 ranks with the even split and resumes from that checkpoint: no step is lost. One line
per admission on every rank, and a `{"event": "join", ...}` metrics record.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from model_parallel.cli.recover_hooks import signal_at_reform
from model_parallel.errors import ConfigError, PeerError

logger = logging.getLogger(__name__)

ADMIT_TIMEOUTS = 20.0  # of --timeout: how long a joiner waits for rank 0 to take its request (a step + a checkpoint)
JOIN_AT_STEP_ENV = "MP_TEST_JOIN_AT_STEP"  # tests: "S[,S2...]": rank 0 admits nobody before S, waits for a request at each
DIE_ENV = "MP_TEST_JOINER_DIES"  # tests: the joiner kills itself once rank 0 took its request
UNDER_COORDINATOR = "under_coordinator"  # in the published flags: the job's workers have --coordinator
# Flags that describe one process, or only the first world (the re-planned worlds use the even split): a joiner
# may give them differently. Every other flag must match the running job's.
PER_PROCESS = frozenset({"rank", "world_size", "dist_addr", "dist_port", "backend", "threads", "metrics", "trace_dir",
                         "verbose", "join", "resume", "recover", "token", "token_file", "coordinator", "control_script",
                         "jobs", "slowdown", "slowdown_rank", "slowdown_after_step", "single_process", "measure_memory",
                         "allow_config_change", "plan", "num_stages", "stage_to_num_ranks"})


def job_flags(args: Any) -> dict[str, Any]:
    """The flags a joiner must share with the running job (the checkpoint directory as an absolute path)."""
    flags = {k: v for k, v in sorted(vars(args).items()) if k not in PER_PROCESS}
    # Whether the job runs under a coordinator (its address may be spelled per host): the members and the joiner
    # agree on the new world's plan with each other only then (cli/recover_coordinator.py).
    flags[UNDER_COORDINATOR] = bool(args.coordinator)
    if flags.get("checkpoint_dir"):
        flags["checkpoint_dir"] = os.path.abspath(flags["checkpoint_dir"])
    return flags


def check_join_flags(args: Any) -> None:
    """What `--join` cannot work with, refused before contacting the job (one line, exit 2)."""
    if not args.join:
        return
    if args.rank is not None or args.world_size is not None or args.dist_addr is not None:
        raise ConfigError("--join: a joining worker gets its rank from the job; drop --rank, --world_size and --dist_addr")
    if args.jobs or args.single_process:
        raise ConfigError("--join with --jobs or --single_process: a joiner trains the one running job")
    if not args.checkpoint_dir:
        raise ConfigError("--join needs --checkpoint_dir (the running job's, reachable from this host): the job "
                          "commits a checkpoint at the admission and every rank, the joiner too, resumes from it")
    if ":" not in args.join or not args.join.rsplit(":", 1)[1].isdigit():
        raise ConfigError(f"--join {args.join!r}: expected HOST:PORT of the running job's store (rank 0's "
                          "--dist_addr:--dist_port)")


def compare_flags(published: dict[str, Any], mine: dict[str, Any], where: str) -> None:
    """Refuse (exit 2) a joiner whose flags differ from the running job's, naming each difference."""
    if not published.get("recover"):
        raise ConfigError(f"the job at {where} runs without --recover: it cannot admit a worker; start it with "
                          "--recover --checkpoint_dir DIR --checkpoint_every K")
    if published.get("backend", "gloo") != "gloo":
        raise ConfigError(f"the job at {where} runs on {published.get('backend')}: admitting a worker is implemented for "
                          "gloo (CPU) worlds only")
    theirs = published["flags"]
    if bool(theirs.get(UNDER_COORDINATOR)) != bool(mine.get(UNDER_COORDINATOR)):
        raise ConfigError(f"--join {where}: the job runs {'under' if theirs.get(UNDER_COORDINATOR) else 'without'} a "
                          f"coordinator and this worker {'with' if mine.get(UNDER_COORDINATOR) else 'without'} one: "
                          f"give --coordinator (and --token) exactly when the job's workers have them")
    theirs, mine = ({k: v for k, v in d.items() if k != UNDER_COORDINATOR} for d in (theirs, mine))
    diffs = [f"--{k} {theirs.get(k)!r} (job) vs {mine.get(k)!r} (this worker)"
             for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
    if diffs:
        raise ConfigError(f"--join {where}: this worker's flags differ from the running job's: {'; '.join(diffs)}; "
                          "give the job's flags")


def join_hint(argv: list[str], store: str, rank: int) -> str:
    """For a process that was replaced (exit 6): the command that would admit it back as a new worker."""
    import shlex

    from model_parallel.cli.worker_exit import launch_command

    drop_value, drop = {"--rank", "--world_size", "--dist_addr", "--dist_port", "--join"}, {"--recover", "--resume"}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in drop_value:
            skip = True
        elif arg not in drop and arg.split("=", 1)[0] not in drop_value:
            out.append(arg)
    # How this worker was really started (`model-parallel worker`, `python -m ...`): `python <basename of argv[0]>`
    # named a `python model-parallel` or `python worker.py` that does not run.
    command = shlex.join([*launch_command()[0], "--join", store, *out])
    return f"[rank {rank}] to come back as a new worker (admitted at a step boundary): {command}"


@dataclass(frozen=True)
class JoinRecord:
    """One admission: who joined, the world after it, the checkpoint every rank resumed from, the pause."""

    me: int  # the original rank of the process that recorded it
    generation: int
    joined: int  # the joiner's original rank
    address: str
    world: tuple[int, ...]  # original ranks of the new world
    store: str
    checkpoint_step: int
    continued_at: int
    seconds: float  # the stop at the boundary -> first completed step of the new world (inf: no step left)
    lost: tuple[int, ...] = ()  # members of the world before it lost while the world re-formed (recovery.reform's retry)

    def line(self) -> str:
        # A member lost during the admission is a failure survived: named here, or the new world's size reads as
        # the joiner's only change
        lost = f"; lost original rank(s) {list(self.lost)} while the world re-formed" if self.lost else ""
        return (f"[original rank {self.me}] admission {self.generation}: original rank {self.joined} joined from "
                f"{self.address}{lost}; new world of {len(self.world)} (original ranks {list(self.world)}, met at {self.store}); "
                f"checkpoint step {self.checkpoint_step} (continued at step {self.continued_at}, 0 steps lost); "
                f"{self.seconds:.2f} s paused")

    def to_json(self) -> dict[str, Any]:
        return {"event": "join", **dataclasses.asdict(self)}


class JoinWatch:
    """Rank 0's channel: the inner channel's decision first; else a pending join request becomes a stop command
    carrying the admission (`extra["join"]`), so every rank leaves this world at the same step boundary."""

    def __init__(self, inner: Any, survivor: Any) -> None:
        self.inner, self.survivor, self.step = inner, survivor, -1
        self.waits = {int(s) for s in os.environ.get(JOIN_AT_STEP_ENV, "").split(",") if s.strip()}
        self.not_before = min(self.waits, default=0)

    def report(self, report: Any) -> None:
        self.step = report.step
        self.inner.report(report)

    def close(self, reason: str) -> None:
        self.inner.close(reason)

    def poll(self, before_step: Optional[int] = None) -> Any:
        # The loop polls in step k, before its reduction (runtime/wire/step_totals.py): a command is applied after
        # step k, so the step an admission lands after is k = before_step - 1, not the last reported one (k - 1).
        step = self.step + 1 if before_step is None else before_step - 1
        command = self.inner.poll(before_step=before_step)
        if command is not None or step < self.not_before:
            return command
        from model_parallel.messages import Command
        from model_parallel.runtime.wire.join import ADMIT, Admission, take_request

        lineage, store = self.survivor.lineage, self.survivor.lineage.base_store
        deadline = time.monotonic() + (0.5 * self.survivor.options.timeout if step in self.waits else 0)
        try:  # a store that fails here fails the heartbeats too (health.py names it); training is not stopped here
            while (request := take_request(store)) is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the test hook only: a joiner started with the job is expected at this step
            if request is None:
                return None
            admission = Admission(request["nonce"], request["address"], len(lineage.addresses), lineage.generation + 1,
                                  lineage.members, lineage.addresses, lineage.base_port, lineage.store_host,
                                  lineage.store_port)
            store.set(ADMIT.format(admission.nonce), admission.to_json())
        except (RuntimeError, OSError, ValueError) as error:
            logger.warning("[rank 0] reading join requests at step %d: %s; no admission now", step,
                           str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
            return None
        return Command("stop", reason=f"admitting a joining worker from {admission.address} as original rank "
                                      f"{admission.original}", extra={"join": admission.to_json()})


def watch_joins(survivor: Any, engine: Any) -> None:
    """Before a world trains: rank 0 looks for join requests; every rank notes an admission command it applies."""
    if engine.rank == 0:
        engine.channel = JoinWatch(engine.channel, survivor)
        from model_parallel.runtime.wire.join import publish_training

        try:  # what a joiner compares its graph and data with (never a failure of the job: it falls back to the checkpoint)
            publish_training(survivor.lineage.base_store, engine.training_record(engine.start_step))
        except Exception as error:  # noqa: BLE001 - a store or record failure: logged, the job trains on
            logger.warning("[rank 0] the training record for joiners was not published: %s", str(error)[:200])
    apply = engine.apply

    def noting(command: Any) -> bool:
        if command.kind == "stop" and "join" in command.extra:
            from model_parallel.runtime.wire.join import Admission

            survivor.admitting = Admission.from_json(str(command.extra["join"]))
            reforming(engine.channel)
        return bool(apply(command))

    engine.apply = noting


def reforming(channel: Any) -> None:
    """Tell this rank's coordinator channel (under wrappers) that it leaves this world to re-form it with a joiner:
    its bye says "recovering", not "stopped" (the job is not over; it registers again in the next generation)."""
    while channel is not None:
        mark = getattr(channel, "reforming", None)
        if callable(mark):
            mark()
            return
        channel = getattr(channel, "inner", None)


def publish(survivor: Any) -> None:
    """The current rank 0: the job's flags in the current base store (a joiner compares its own with them)."""
    from model_parallel.runtime.wire.join import publish_flags

    if survivor.rank == 0:
        publish_flags(survivor.lineage.base_store, job_flags(survivor.args), recover=True, backend=survivor.backend)


def publish_no_recover(world: Any, args: Any) -> None:
    """Rank 0 of a job without --recover (its own store, not torchrun's): a joiner is told it cannot join here."""
    from model_parallel.runtime.wire.join import publish_flags

    if world.rank == 0 and world.store_host == 0:
        publish_flags(world.store, job_flags(args), recover=False, backend="")


def admit(survivor: Any, detected: float, done_before: int) -> None:
    """Every running rank, after the admission stop: meet the joiner in the next generation (see the module doc)."""
    from dataclasses import replace

    from model_parallel.cli.worker_exit import EXIT_PEER, EXIT_REPLACED, resume_hint
    from model_parallel.errors import ReplacedError
    from model_parallel.runtime.checkpoint.layout import latest_step
    from model_parallel.runtime.wire.join import free_slot
    from model_parallel.runtime.wire.recovery import JOIN_TIMEOUTS, abandon, reform

    admission, survivor.admitting = survivor.admitting, None
    lineage, timeout, rank = survivor.lineage, survivor.options.timeout, survivor.rank
    survivor.health.stop("done")
    logger.warning("[rank %d] admitting original rank %d (from %s) after step %d", rank, admission.original,
                   admission.address, done_before - 1)
    if not abandon(0.5 * timeout, close_first=False):  # every rank leaves at this boundary: nobody waits on another
        survivor._leave(EXIT_PEER, f"[rank {rank}] error: the process group did not shut down within "
                                   f"{0.5 * timeout:g} s while admitting original rank {admission.original}",
                        resume_hint(survivor.args.checkpoint_dir, survivor.argv, rank))
    grown = replace(lineage, members=lineage.members + (admission.original,),
                    addresses=lineage.addresses + (admission.address,))
    try:
        reformed = reform(grown, set(), timeout, survivor.backend, signal_at_reform(lineage.me, rank))
    except ReplacedError as replaced:
        survivor._leave(EXIT_REPLACED, f"[rank {rank}] error: {replaced}: it does not rejoin", None)
    except PeerError as meet:  # the admission's checkpoint is committed: the last line says how to resume from it
        survivor._leave(EXIT_PEER, f"[rank {rank}] error: cannot admit original rank {admission.original}: {meet}",
                        resume_hint(survivor.args.checkpoint_dir, survivor.argv, rank))
    if reformed.rank == 0:
        free_slot(reformed.lineage.base_store)
    survivor._adopt(reformed)
    lost = tuple(m for m in reformed.dropped if m != admission.original)  # members lost while the world re-formed
    if admission.original in reformed.dropped:  # it posted, then never came (it died, or gave up): no admission
        logger.warning("[rank %d] original rank %d did not come to generation %d within %g s: training on without it "
                       "from the checkpoint of step %d%s", rank, admission.original, reformed.lineage.generation,
                       JOIN_TIMEOUTS * timeout, done_before - 1,
                       f"; lost original rank(s) {list(lost)} while the world re-formed" if lost else "")
        return
    step = latest_step(survivor.args.checkpoint_dir)
    record = JoinRecord(lineage.me, reformed.lineage.generation, admission.original, admission.address,
                        reformed.lineage.members, survivor.world.store_address, -1 if step is None else step,
                        done_before, 0.0, lost)
    survivor._pending = (detected, record)


def joiner_options(options: Any, original: int) -> Any:
    """The joiner's RunOptions: it resumes from the admission's checkpoint, its metrics file named by its original rank,
    and never with --allow_config_change: the members wrote that checkpoint with the job's settings and keep them,
    so a change the joiner's restore accepted (another token file or graph under the same path) trained its stages
    on other data or another model than theirs, with a warning on the joiner only."""
    metrics = options.metrics.replace("{rank}", str(original)) if options.metrics else None
    return dataclasses.replace(options, resume=True, metrics=metrics, allow_config_change=False)


@contextmanager
def store_guard(where: str, doing: str) -> Iterator[None]:
    """The joiner's store calls: a store that closes the connection or stops answering (its host died, or the job
    ended) is a PeerError naming it (one line, exit 3), never a torch traceback."""
    try:
        yield
    except PeerError:
        raise
    except (RuntimeError, OSError) as error:
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise PeerError(f"--join {where}: the job's store failed while {doing} (its host died, or the job ended or "
                        f"re-formed at another store: after a lost store host it is the lowest survivor's at "
                        f"--dist_port + generation): {first}; start this worker again with the job's current store") from None


def join_running_job(args: Any, argv: list[str], config: Any, options: Any, prefix: Any, run_one: Callable[..., Any],
                     survivor_class: Any) -> Any:
    """The joiner: checks, request, admission, the new world; returns the `survivor_class` (worker_recover.Survivor,
    passed in: that module imports this one) that trains in it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from model_parallel.runtime.wire import join as wire
    from model_parallel.runtime.wire.recovery import JOIN_TIMEOUTS, Lineage, own_address, reform

    host, port = args.join.rsplit(":", 1)
    timeout = options.timeout
    # The store may not be up yet (the job starting, or survivors re-forming after losing its host): 3 T to connect.
    connect = JOIN_TIMEOUTS * timeout
    try:
        store = TCPStore(host, int(port), None, is_master=False, timeout=timedelta(seconds=connect), wait_for_workers=False)
    except (RuntimeError, OSError) as error:
        raise PeerError(f"--join {args.join}: no job's store answers there within {connect:g} s (is rank 0 running, "
                        f"and is this its --dist_addr:--dist_port, or after a recovery that lost the store's host the "
                        f"lowest survivor's at --dist_port + generation?): {str(error).splitlines()[0][:200]}") from None
    with store_guard(args.join, "reading the job's flags"):
        published = wire.read_flags(store, timeout)
    if published is None:
        raise ConfigError(f"--join {args.join}: the store there published no job's flags within {timeout:g} s: it is "
                          "not a model_parallel job's rendezvous store, or the job has not started training yet")
    compare_flags(published, job_flags(args), args.join)
    from model_parallel.cli.join_data import check_joiner_data

    deadline = time.monotonic() + ADMIT_TIMEOUTS * timeout
    # Rank 0 publishes it once its engine is built, before it can take any request: waited for as long as an admission
    # (a joiner started with the job waits out the job's start; one T was too short for that on a loaded host)
    with store_guard(args.join, "reading the job's training record"):
        training = wire.read_training(store, ADMIT_TIMEOUTS * timeout)
    check_joiner_data(args, args.join, training)  # another file or code under the same flags ended the whole job
    address = own_address(host)
    with store_guard(args.join, "posting the join request"):
        nonce = wire.post_request(store, address, deadline)
    print(f"[joiner] join request posted at {args.join} from {address}; waiting to be admitted at a step boundary",
          flush=True)
    with store_guard(args.join, "waiting to be admitted"):
        admission = wire.wait_admission(store, nonce, deadline)
    if admission is None:
        raise PeerError(f"--join {args.join}: the job did not admit this worker within {ADMIT_TIMEOUTS * timeout:g} s "
                        f"({ADMIT_TIMEOUTS:g} x --timeout); the request was withdrawn")
    if os.environ.get(DIE_ENV):  # the test hook: a joiner lost between its admission and the meeting
        logger.error("[joiner] test hook %s: SIGKILL after being taken", DIE_ENV)
        os.kill(os.getpid(), signal.SIGKILL)
    prefix.rank = admission.original
    lineage = Lineage(me=admission.original, generation=admission.generation - 1,
                      members=admission.members + (admission.original,), addresses=admission.addresses + (address,),
                      base_port=admission.base_port, store_host=admission.store_host, store_port=admission.store_port,
                      base_store=store, world_store=store)
    detected = time.monotonic()
    # compare_flags refused any other backend than gloo
    reformed = reform(lineage, set(), timeout, "gloo", signal_at_reform(admission.original, admission.original))
    from model_parallel.runtime.run import World, start_health
    import torch

    world = World(reformed.rank, reformed.world_size, reformed.store, torch.device("cpu"), reformed.store_host,
                  reformed.store_address)
    health = start_health(world, timeout)
    # From here on it is one of the job's --recover workers (its bye to a coordinator says "recovering" too).
    job_args = argparse.Namespace(**{**vars(args), "plan": None, "num_stages": None, "stage_to_num_ranks": None,
                                     "recover": True})
    survivor = survivor_class(job_args, argv, config, joiner_options(options, admission.original), world,
                        health, prefix, run_one, lineage=reformed.lineage)
    from model_parallel.runtime.checkpoint.layout import latest_step

    step = latest_step(args.checkpoint_dir)
    survivor._pending = (detected, JoinRecord(admission.original, reformed.lineage.generation, admission.original,
                                              address, reformed.lineage.members, reformed.store_address,
                                              -1 if step is None else step, 0, 0.0, reformed.dropped))
    if args.coordinator:  # the world it met registers as the next generation; it is a spare in the plan it ran
        survivor.args = argparse.Namespace(**{**vars(job_args), "recovered": survivor._recovered(0)})
    return survivor
