"""One rank of a pipeline: join the world, then train a built job on it (what every worker process runs).

    world = join_world(Rendezvous(rank=0, world_size=2, addr="127.0.0.1", port=29500, timeout=60))
    health = start_health(world, timeout=60)
    engine = run_job(job, config, steps=10, optimizer_factory=factory, channel=NullChannel(), world=world,
                     health=health)

Inputs are typed: a `Job` (graph, plan, model, criterion, dataset; `model_parallel.api.job.build_job`
makes one), a `TrainConfig` and a `ControlChannel`. Command-line parsing, the coordinator connection and
the process's exit codes live above, in `model_parallel.cli.worker`.
"""
from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch

from model_parallel.errors import PeerError, PlanError, TrainingStopped
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.graph.precision import precision_mismatch

if TYPE_CHECKING:
    from model_parallel.messages import ControlChannel
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.engine import PipelineEngine
    from model_parallel.runtime.wire.health import Health

logger = logging.getLogger(__name__)

_JOINED = "mp/joined/{}"
_SEEN = "mp/join-failed/{}"  # this rank read which ranks never joined (the store host waits for it)


@dataclass(frozen=True)
class Job:
    """What one training run needs besides its config: built the same way for the CLI and the Python API."""

    graph: Graph
    plan: Plan
    model: torch.nn.Module  # the whole model, on meta when built here: each rank materializes its stage's layers
    criterion: Callable[[Any, torch.Tensor], torch.Tensor]
    dataset: Any  # anything with `batch(step) -> (inputs_tuple, target)`
    static_plan: bool = False  # a PipeDream-generated package: no graph.json, so no plan switches
    initializer: Any = None  # runtime.build.materialize.Initializer: seed, init hook, stored weights (None: the config's seed)
    eval_dataset: Any = None  # validation data (`batch(step)`), for RunOptions.eval_every


@dataclass(frozen=True)
class Rendezvous:
    """How this process joins the world: explicit rank/world/address, else torchrun's environment."""

    rank: Optional[int] = None  # None: $RANK (torchrun)
    world_size: Optional[int] = None  # None: $WORLD_SIZE
    addr: Optional[str] = None  # rank 0's address, hosting the store; None: $MASTER_ADDR
    port: Optional[int] = None  # None: $MASTER_PORT, else 29500
    backend: str = "auto"  # auto | gloo | nccl
    timeout: float = 60.0  # seconds any blocking communication may take

    def address(self) -> str:
        """'host:port' of the rendezvous store, for error messages."""
        addr = self.addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        return f"{addr}:{self.port or os.environ.get('MASTER_PORT', 29500)}"


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    store: Any
    device: torch.device
    store_host: Optional[int]  # the rank hosting the store (None under torchrun: its agent hosts it)
    store_address: str


def resolve_backend(name: str, ranks_per_gpu_host: Optional[list[tuple[int, int]]] = None) -> str:
    """"auto" -> nccl where every host has a GPU for each of its ranks, else gloo (CPU tensors).

    `ranks_per_gpu_host`: (ranks on the host, GPUs on the host) for every host of the world; None = this host only.
    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so a world with more ranks than GPUs on a host
    (4 stages on a 1-GPU machine) trains on the CPUs with gloo rather than failing at its first message.
    """
    if name == "auto":
        hosts = ranks_per_gpu_host or [(1, torch.cuda.device_count() if torch.cuda.is_available() else 0)]
        return "nccl" if all(0 < ranks <= gpus for ranks, gpus in hosts) else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise PlanError("--backend nccl needs CUDA, which this machine lacks; use --backend gloo")
    return name


def _hosts(store: Any, rank: int, world_size: int, timeout: timedelta) -> tuple[list[tuple[int, int]], int]:
    """Every rank publishes (host, GPU count); returns (ranks, GPUs) per host and this rank's index on its host."""
    import socket

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    store.set(f"mp/host/{rank}", f"{gpus} {socket.gethostname()}")
    keys = [f"mp/host/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    seen = [store.get(k).decode().split(" ", 1) for k in keys]
    by_host: dict[str, list[int]] = {}
    for r, (_, host) in enumerate(seen):
        by_host.setdefault(host, []).append(r)
    mine = seen[rank][1]
    counts = [(len(ranks), int(seen[ranks[0]][0])) for ranks in by_host.values()]
    return counts, by_host[mine].index(rank)


def _wait_for_listener(addr: str, port: int, timeout: float) -> None:
    """Return once something accepts connections at addr:port; OSError (the last attempt's) after `timeout` s."""
    import socket
    import time

    deadline, delay = time.monotonic() + timeout, 0.05
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            if time.monotonic() + delay >= deadline:
                raise OSError(f"nothing accepted a connection there within {timeout:g} s ({error.strerror or error})") from None
        time.sleep(delay)
        delay = min(2 * delay, 1.0)


def missing_ranks(store: Any, world_size: int, deadline_s: float = 5.0, rank: Optional[int] = None) -> Optional[list[int]]:
    """Ranks that never registered in the store (None if the store cannot say within `deadline_s`: its host
    left or does not answer). With `rank`, this rank also notes that it has read the answer (`_SEEN`), so
    the store host, which lingers for that (`linger_for_readers`), can leave."""
    import threading

    box: dict[str, list[int]] = {}

    def look() -> None:
        try:
            box["missing"] = [r for r in range(world_size) if not store.check([_JOINED.format(r)])]
            if rank is not None:
                store.set(_SEEN.format(rank), "1")
        except Exception as error:  # noqa: BLE001 - the store host left (DistNetworkError): the caller says so
            logger.debug("cannot read which ranks joined: %s", error)

    # A daemon thread with a deadline: a store call on an unreachable host would otherwise never return.
    thread = threading.Thread(target=look, name="join-check", daemon=True)
    thread.start()
    thread.join(deadline_s)
    return box.get("missing")


def linger_for_readers(store: Any, rank: int, world_size: int, missing: list[int], max_seconds: float) -> None:
    """The store host, after a failed join: keep the store up until every other rank that joined has read which
    ranks are missing (`missing_ranks`), at most `max_seconds` (a rank that joined times out at most one
    --timeout after this one, since it joined after the store started)."""
    import time

    waiting = [_SEEN.format(r) for r in range(world_size) if r != rank and r not in missing]
    deadline = time.monotonic() + max_seconds
    while waiting and time.monotonic() < deadline:
        try:
            waiting = [key for key in waiting if not store.check([key])]
        except Exception:  # noqa: BLE001 - this rank hosts the store: only a teardown fails here
            return
        time.sleep(0.1)


def _use_gpu(backend: str, local_rank: int) -> torch.device:
    """This rank's device: its own GPU under NCCL (the local rank's), else the CPU."""
    if backend != "nccl":
        if torch.cuda.is_available():
            logger.warning("CUDA is present but this world trains with gloo on the CPUs: a host has more ranks than "
                           "GPUs, and NCCL needs a GPU of its own for each rank (start one rank per GPU)")
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _attempt_store(world_size: int, timeout: timedelta) -> Any:
    """Under torchrun's shared agent store, a key space of this restart's own (None: not shared, use env://).

    The agent keeps one TCPStore for every restart, and torch's env:// adds no per-attempt prefix: a restarted
    world then read the dead attempt's gloo addresses and failed to connect ("Gloo connectFullMesh failed")."""
    from torch.distributed import PrefixStore, TCPStore

    from model_parallel.runtime.checkpoint.resume import elastic_restart

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    addr, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", 29500))
    try:
        client = TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as error:
        raise PeerError(f"cannot reach torchrun's store at {addr}:{port} within {timeout.total_seconds():.0f} s "
                        f"(is torchrun's agent running?): {str(error).splitlines()[0]}") from None
    return PrefixStore(f"model_parallel/attempt_{elastic_restart()}", client)


def join_world(rdv: Rendezvous) -> World:
    """Join the process group (TCPStore on rank 0, or torchrun's env://)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=rdv.timeout)
    rank = rdv.rank if rdv.rank is not None else int(os.environ.get("RANK", -1))
    world_size = rdv.world_size or int(os.environ.get("WORLD_SIZE", 0))
    if rank < 0 or world_size < 1:
        raise PlanError("the rank and world size are unknown: pass --rank and --world_size, or launch with torchrun")
    if not 0 <= rank < world_size:
        raise PlanError(f"--rank {rank} is outside the world of {world_size} ranks (0..{world_size - 1})")
    if rdv.addr is None and "MASTER_ADDR" in os.environ and rdv.rank is None:
        # torchrun: LOCAL_WORLD_SIZE ranks on this node (torchrun starts the same number on every node).
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = resolve_backend(rdv.backend, [(local_ranks, gpus)])
        device = _use_gpu(backend, int(os.environ.get("LOCAL_RANK", 0)))
        store = _attempt_store(world_size, timeout)
        if store is None:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        return World(rank, world_size, dist.distributed_c10d._get_default_store(), device, None, rdv.address())
    from torch.distributed import TCPStore

    addr = rdv.addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = rdv.port or int(os.environ.get("MASTER_PORT", 29500))
    try:
        if rank != 0:  # c10d's own client retries after its timeout (2-4 x --timeout in all): wait here instead
            _wait_for_listener(addr, port, rdv.timeout)
        store = TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as error:
        raise PeerError(f"rank {rank}: cannot reach the rendezvous store at {addr}:{port} within {rdv.timeout:.0f} s "
                        f"(is rank 0 running, and is the port free/reachable?): {str(error).splitlines()[0]}") from None
    store.set(_JOINED.format(rank), "1")  # so a rank whose join fails can name who never came
    try:
        backend, device = "gloo", torch.device("cpu")
        if rdv.backend != "gloo":  # only NCCL needs to know where the other ranks run
            hosts, local = _hosts(store, rank, world_size, timeout)
            backend = resolve_backend(rdv.backend, hosts)
            device = _use_gpu(backend, local)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except (RuntimeError, dist.DistStoreError if hasattr(dist, "DistStoreError") else RuntimeError) as error:
        missing = missing_ranks(store, world_size, min(5.0, max(1.0, 0.4 * rdv.timeout)), rank)
        if missing is None:  # this rank joined, so the store was up: its host (rank 0) left before it could be read
            raise PeerError(f"rank {rank}: not every one of the {world_size} ranks joined within {rdv.timeout:.0f} s, "
                            f"and rank 0 (the rendezvous store host at {addr}:{port}) left or stopped answering before this rank could "
                            f"read which ranks are missing; see rank 0's error line (are all {world_size} ranks "
                            f"running and pointed at {addr}:{port}?)") from None
        if rank == 0:
            linger_for_readers(store, rank, world_size, missing, rdv.timeout)
        who = f"rank(s) {missing} never joined" if missing else f"{str(error).splitlines()[0]}"
        raise PeerError(f"rank {rank}: not every one of the {world_size} ranks joined within {rdv.timeout:.0f} s: "
                        f"{who} (are they running and pointed at {addr}:{port}?)") from None
    return World(rank, world_size, store, device, 0, rdv.address())


def start_health(world: World, timeout: float) -> "Health":
    """Heartbeats in the world's store, so a dead or stalled peer is named (see health.py)."""
    from model_parallel.runtime.wire.health import Health

    return Health(world.store, world.rank, world.world_size, interval=min(1.0, timeout / 10), store_host=world.store_host,
                  store_timeout=timeout, store_address=world.store_address).start()


def warn_precision_mismatch(job: Job, bf16: bool, prefix: str = "") -> Optional[str]:
    """Log (a warning, not an error: the run is still correct, only maybe unbalanced) when the plan was
    priced at another precision than this run trains at; returns the message, None when they agree."""
    message = precision_mismatch(job.plan, job.graph, bf16)
    if message is not None:
        logger.warning("%s%s", f"{prefix} " if prefix else "", message)
    return message


def run_job(job: Job, config: "TrainConfig", options: "RunOptions", steps: int, optimizer_factory: Callable,
            channel: "ControlChannel", world: World, health: "Health", on_engine: Optional[Callable[["PipelineEngine"], None]] = None) -> "PipelineEngine":
    """Build this rank's engine for one job on the already-joined world and train `steps` steps.

    The channel is closed at the end with the outcome (the coordinator's status shows it). Raises
    TrainingStopped when the run stopped before its requested steps. `on_engine` sees the engine
    before training starts (the command line's log prefix follows its stage from then on)."""
    from model_parallel.runtime.build.materialize import move_real
    from model_parallel.runtime.engine import PipelineEngine

    if job.static_plan:
        from model_parallel.runtime.build.pipedream import StaticPlanChannel

        channel = StaticPlanChannel(channel, "a PipeDream-generated package has no graph.json, and switching plans "
                                             "needs graph.json (regenerate the package with our converter)")
    if config.schedule == "auto":  # the job builder resolves it, before any engine (runtime/step/auto.py)
        from model_parallel.errors import ConfigError

        raise ConfigError("schedule 'auto' reached run_job unresolved: build the job with schedule='auto' and run "
                          "config.resolved(job.plan), the schedule the builder chose")
    outcome = "training finished"  # what the coordinator is told at the end (its status shows it)
    try:
        engine = PipelineEngine(graph=job.graph, plan=job.plan, model=move_real(job.model, world.device),
                                criterion=job.criterion, optimizer_factory=optimizer_factory, dataset=job.dataset, config=config,
                                options=options, channel=channel, health=health, device=world.device,
                                initializer=job.initializer, eval_dataset=job.eval_dataset)
        if on_engine is not None:
            on_engine(engine)
        if world.rank == 0:
            logger.info("%s plan v%d:\n%s", engine.prefix, engine.plan.version, engine.plan.table())
            warn_precision_mismatch(job, config.bf16, engine.prefix)
        history = engine.train(steps)
        if engine.stop_reason is not None:
            outcome = (f"stopped after {engine.next_step} of the {steps} requested step(s): "
                       f"{engine.stop_reason}")
            raise TrainingStopped(f"{engine.prefix} {outcome}")
    except BaseException as error:
        if not isinstance(error, TrainingStopped):
            outcome = f"failed: {error}".splitlines()[0][:500]
        raise
    finally:
        channel.close(outcome)
    ran = engine.next_step - engine.start_step  # a resume starts at the checkpoint's next step
    if history and ran:
        print(f"{engine.prefix} done: {ran} step(s), last loss {history[-1].loss:.6f}, "
              f"{_pauses(engine.switch_pauses_ms)}; this run executed steps "
              f"{engine.start_step}..{engine.next_step - 1} and reached step {engine.next_step} of {steps}", flush=True)
    else:
        print(f"{engine.prefix} done: 0 step(s); nothing to run, the checkpoint had reached step {engine.next_step} "
              f"of {steps}", flush=True)
    return engine


def _pauses(pauses_ms: "deque[float]", shown: int = 10) -> str:
    """The done line's switch pauses: the last `shown` (a run that switched all day printed every one, one line)."""
    last = [round(p, 1) for p in list(pauses_ms)[-shown:]]
    if len(pauses_ms) <= shown:
        return f"switch pauses ms {last}"
    more = "+" if len(pauses_ms) == pauses_ms.maxlen else ""  # the engine keeps the latest HISTORY_WINDOW
    return f"switch pauses ms (the last {shown} of {len(pauses_ms)}{more} switches) {last}"
