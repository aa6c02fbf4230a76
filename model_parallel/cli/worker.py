"""The worker command line (`model-parallel worker --rank N --dist_addr HOST ...`): one rank of a pipeline.

The seed's `python test_parallel_0.py ...` runs the same; launchers start `python -m model_parallel.cli.worker`.
Also works under `torchrun --nproc_per_node=K test_parallel_0.py ...` (env:// rendezvous) and, with
`--single_process`, runs every stage in one process for debugging. See docs/runtime.md.

This layer turns the flags into typed inputs (`cli/worker_job.py`: a `JobSpec` for `api.job.build_job`, a
`TrainConfig`; here: a `Rendezvous`, a control channel: the coordinator's, a scripted one or none), runs the jobs
with `runtime.run`, and maps how the run ended to the process's exit code.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

# Before torch loads (c10 reads it once): when a peer or the store host dies, c10d logs a warning
# with 13-26 lines of C++ stack frames per failed store call, ahead of our one-line error that
# already names the rank. An explicit setting (debugging) is kept.
if not os.environ.get("TORCH_CPP_LOG_LEVEL"):
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"

import torch  # noqa: E402

from model_parallel.allocator import keep_freed_memory  # noqa: E402
from model_parallel.cli import data_flags  # noqa: E402
from model_parallel.cli.common import EXIT_USAGE, ArgumentParser, configure_logging  # noqa: E402
from model_parallel.cli.recover_hooks import worker_hook  # noqa: E402
from model_parallel.cli.served_job import ServedJob, fetch_served_job, wants_served_job  # noqa: E402
from model_parallel.cli.worker_exit import EXIT_FAILED, EXIT_PEER, EXIT_REPLACED, EXIT_STOPPED, leave, resume_hint, runtime_failure  # noqa: E402
from model_parallel.cli.worker_inputs import (check_inputs, check_numbers, check_single_process, read_control_script,  # noqa: E402
                                             read_jobs)
from model_parallel.cli.worker_job import load_job, make_config, make_optimizer_factory  # noqa: E402
from model_parallel.optimizer.memory import OFFLOAD_CHUNK_BYTES  # noqa: E402
from model_parallel.errors import ModelParallelError, OutOfMemoryError, PeerError, ReplacedError, TrainingStopped  # noqa: E402
from model_parallel.runtime.step import stop_signals  # noqa: E402
from model_parallel.runtime.run import Rendezvous, join_world, run_job, start_health  # noqa: E402
from model_parallel.runtime.step.auto import AUTO  # noqa: E402
from model_parallel.runtime.step.schedule import SCHEDULE_NAMES  # noqa: E402

logger = logging.getLogger(__name__)


class RankPrefix(logging.Filter):
    """Prefix every log line with `[rank r stage s]`, following plan switches (`engine` set later)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.engine = rank, None

    def filter(self, record: logging.LogRecord) -> bool:
        prefix = self.engine.prefix if self.engine is not None else f"[rank {self.rank}]"
        message = record.getMessage()
        if not message.startswith("[rank "):  # engine messages carry it already
            record.msg, record.args = f"{prefix} {message}", None
        return True


def install_rank_prefix(rank: int) -> RankPrefix:
    prefix = RankPrefix(rank)
    for handler in logging.getLogger().handlers:
        handler.addFilter(prefix)
    return prefix


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="test_parallel_0.py", description="One worker (rank) of a model_parallel pipeline.")
    g = p.add_argument_group("world")
    g.add_argument("--rank", type=int, default=None, help="this worker's rank (default: $RANK, as set by torchrun)")
    g.add_argument("--world_size", type=int, default=None, help="number of workers (default: $WORLD_SIZE, else the plan's rank count)")
    g.add_argument("--dist_addr", default=None, help="address of rank 0 (hosts the rendezvous store); default $MASTER_ADDR")
    g.add_argument("--dist_port", type=int, default=None, help="rendezvous port (default $MASTER_PORT, else 29500)")
    g.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="auto: nccl when CUDA is present, else gloo")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds any blocking communication may take (default 60)")
    g.add_argument("--single_process", action="store_true", help="run all stages in this one process (debugging)")
    g.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (default 1)")
    g.add_argument("--gloo_loop_nice", type=int, default=19,
                   help="CPU priority (nice, 0..19) of gloo's message threads, so that they never preempt training on a "
                        "machine with fewer cores than busy threads (default 19; 0: gloo's default)")
    m = p.add_argument_group("model and plan")
    m.add_argument("--model", default=None, help="a built-in model: mlp, resnet18, gpt")
    m.add_argument("--package", default=None, help="a generated package directory (graph.json + plan.json inside)")
    m.add_argument("--graph", default=None, help="graph.json of the model (with --plan)")
    m.add_argument("--plan", default=None, help="plan.json: stages and their ranks (default: even split)")
    m.add_argument("--num_stages", type=int, default=None, help="stages for the even split (default: world size)")
    m.add_argument("--stage_to_num_ranks", default=None, help="replicas per stage for the even split, e.g. 0:2,1:1")
    m.add_argument("--memory_per_worker", type=float, default=None,
                   help="bytes one worker may hold: the split becomes the most even whose predicted peak fits (or refuses)")
    m.add_argument("--loss", choices=("cross_entropy", "lm"), default=None, help="loss for --graph/--package models")
    m.add_argument("--input_shape", default=None,
                   help="per-sample input shape for a PipeDream-generated --package, e.g. 3,224,224 (it records none)")
    m.add_argument("--num_classes", type=int, default=None,
                   help="classes of the synthetic data for --graph/--package models (default: the model's output width)")
    m.add_argument("--weights", default=None,
                   help="initial values on this machine: a .safetensors file, an HF sharded directory (with its "
                        "model.safetensors.index.json) or our checkpoint directory; each rank reads only its stage's tensors")
    t = p.add_argument_group("training")
    t.add_argument("--batch_size", type=int, default=8)
    t.add_argument("--num_microbatches", type=int, default=4)
    t.add_argument("--schedule", choices=SCHEDULE_NAMES + (AUTO,), default=SCHEDULE_NAMES[0],
                   help="auto: the flush schedule (1f1b, gpipe, interleaved, zbh1, zbinterleaved, zbv) the simulator predicts fastest for this "
                        "job's profiled stage times that fits --memory_per_worker (one log line says why)")
    t.add_argument("--schedule_order", choices=("list", "fixed"), default="list",
                   help="zbh1, zbinterleaved, zbv: list: each rank's order list-built from the stage times (the plan's "
                        "measured stage_times, else the profile's) where it simulates faster; fixed: torch's order")
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="sgd: torch.optim.SGD with --momentum (default 0.9: plain SGD is --momentum 0); adamw: "
                        "torch.optim.AdamW with --eps (betas torch's defaults). Default sgd")
    t.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    t.add_argument("--momentum", type=float, default=0.9, help="sgd's momentum (default 0.9)")
    t.add_argument("--weight_decay", type=float, default=0.0, help="default 0; on every parameter unless --no_decay_vectors")
    t.add_argument("--no_decay_vectors", action="store_true",
                   help="no weight decay on 1-D parameters (biases, norm weights), as Hugging Face's Trainer and nanoGPT "
                        "do; matrices and embeddings get --weight_decay")
    t.add_argument("--eps", type=float, default=1e-8,
                   help="adamw's eps (default 1e-8, torch's). Where a parameter's gradient is ~0, Adam divides by ~eps "
                        "and amplifies rounding: 1e-6 or more keeps a pipeline within 1e-5 of one process")
    t.add_argument("--seed", type=int, default=0,
                   help="initial weights, data order and dropout masks (keyed by seed, step, stage, microbatch); default 0")
    data_flags.add_arguments(t)  # --data, --seq_len, --token_dtype, --eval_data, --eval_every, --eval_steps
    t.add_argument("--recompute", default=None, help="activation recomputation: 'all' or stage ids, e.g. 0,1")
    t.add_argument("--bf16", action="store_true", help="bf16 autocast for forward passes")
    t.add_argument("--clip_grad", type=float, default=None, help="clip gradients to this global norm")
    t.add_argument("--lr_schedule", default="constant", help="constant | cosine:<steps> | warmup:<steps> | step:<every>:<gamma> | linear:<warmup>:<total> | "
                   "cosine:<warmup>:<total> (transformers' get_linear/cosine_schedule_with_warmup)")
    o = p.add_argument_group("checkpoints and observation")
    o.add_argument("--checkpoint_dir", default=None)
    o.add_argument("--checkpoint_every", type=int, default=0)
    o.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint_dir")
    o.add_argument("--allow_config_change", action="store_true",
                   help="with --resume: accept a batch size, schedule (pipedream <-> flush; flush schedules resume one another "
                        "unasked), seed, lr schedule, precision, data, optimizer or "
                        "its lr/momentum/weight decay/eps that differs from what the checkpoint recorded (each change is "
                        "logged; another optimizer starts its state afresh)")
    o.add_argument("--recover", action="store_true",
                   help="when a peer is lost, re-form the world with the survivors and continue in this process from a "
                        "live replica of its stage, a --redundancy copy, or the latest committed checkpoint (needs --checkpoint_dir)")
    o.add_argument("--redundancy", type=int, choices=(0, 1), default=0,
                   help="with --recover: 1 keeps each rank's stage state in memory on the next rank too (sent every "
                        "--redundancy_every steps off the critical path), so a lost rank's stage comes back without recomputing")
    o.add_argument("--redundancy_every", type=int, default=1, help="steps between --redundancy snapshots (default 1)")
    o.add_argument("--join", default=None, metavar="HOST:PORT",
                   help="join a running --recover job (its rank 0's --dist_addr:--dist_port) at a step boundary, with "
                        "the job's flags; the job re-plans for one more worker (needs --checkpoint_dir)")
    o.add_argument("--keep_checkpoints", type=int, default=3,
                   help="committed checkpoints kept in --checkpoint_dir; older ones are deleted (default 3)")
    o.add_argument("--trace_dir", default=None, help="write a Chrome/Perfetto trace per rank here")
    o.add_argument("--metrics", default=None, help="per-step metrics JSONL path ('{rank}' is replaced)")
    o.add_argument("--measure_memory", action="store_true",
                   help="count the bytes each microbatch keeps for backward (metrics stash_peak_bytes, the memory table)")
    o.add_argument("--offload_optimizer", default=None, metavar="DIR",
                   help="keep the optimizer state in files under DIR/rank<N>/ (local disk) and step it in chunks: the "
                        "plan's footprint prices the chunk, not the state (same parameters as without)")
    o.add_argument("--offload_chunk_mb", type=float, default=OFFLOAD_CHUNK_BYTES / 1e6,
                   help=f"with --offload_optimizer: MB of optimizer state in memory at once (default "
                        f"{OFFLOAD_CHUNK_BYTES / 1e6:g})")
    o.add_argument("-v", "--verbose", action="count", default=0)
    c = p.add_argument_group("control")
    c.add_argument("--coordinator", default=None, help="HOST:PORT of the coordinator (test_socket.py)")
    c.add_argument("--token", default=None, help="shared token for the coordinator (visible in `ps`: prefer --token-file "
                                                   "or $MODEL_PARALLEL_TOKEN)")
    c.add_argument("--token-file", "--token_file", dest="token_file", default=None,
                   help="file whose first line is the coordinator's shared token")
    c.add_argument("--control_script", default=None, help="JSON file {step: command} played by rank 0 (tests, demos)")
    c.add_argument("--jobs", default=None, help="JSON file: a list of argument lists, run one after another in this world")
    c.add_argument("--slowdown", type=float, default=1.0, help="straggler injection: make compute FACTOR times slower")
    c.add_argument("--slowdown_rank", type=int, default=None, help="the rank --slowdown applies to")
    c.add_argument("--slowdown_after_step", type=int, default=0, help="first step that is slowed down")
    return p


def ask_coordinator(argv: Sequence[str], args: Any) -> tuple[Any, ServedJob]:
    """Fetch the job from the coordinator (`cli.served_job`), its flags parsed by this command line's parser."""
    return fetch_served_job(argv, args, build_parser())


def make_channel(args: Any, rank: int, world_size: int, token: Optional[bytes] = None, schedule: Optional[str] = None,
                 plan: Any = None, config: Any = None) -> Any:
    from model_parallel.messages import NullChannel

    if args.coordinator:
        from model_parallel.coordinator.client import CoordinatorChannel
        from model_parallel.coordinator.protocol import read_token

        recovered = getattr(args, "recovered", None)  # --recover, a re-formed world: its generation (worker_recover.py)
        return CoordinatorChannel(args.coordinator, token or read_token(args.token, args.token_file), rank, world_size,
                                  schedule=schedule,
                                  checkpoint_dir=os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else None,
                                  live_plan=plan, recover=bool(args.recover),
                                  generation=recovered.generation if recovered else 0,
                                  membership=recovered.membership() if recovered else None,
                                  schedule_auto=bool(getattr(config, "schedule_auto", False)),
                                  num_microbatches=getattr(config, "num_microbatches", None),
                                  schedule_order=getattr(config, "schedule_order", None),
                                  peer_timeout=float(args.timeout),
                                  # it listened before this rank joined (reach_coordinator): a refusal now is
                                  # retried briefly, well inside the peers' deadline, so that they can name this rank
                                  wait_for=args.timeout / 4)
    if args.control_script and rank == 0:
        return read_control_script(args.control_script)
    return NullChannel()


def reach_coordinator(args: Any, rank: int) -> None:
    """Before joining the world: have the coordinator answer once, waiting up to --timeout while nothing listens
    there yet (it may have been started a moment before). A worker that cannot reach it, or whose token is not
    the coordinator's, then fails here, exit 2, and its peers name it as a rank that never joined, instead of it
    leaving the world right after joining."""
    from model_parallel.coordinator.connect import CONNECT_TIMEOUT_S, check_token
    from model_parallel.coordinator.protocol import read_token

    token = read_token(args.token, args.token_file)
    check_token(args.coordinator, token, min(CONNECT_TIMEOUT_S, args.timeout), args.timeout, rank)


def rendezvous(args: Any) -> Rendezvous:
    return Rendezvous(rank=args.rank, world_size=args.world_size, addr=args.dist_addr, port=args.dist_port,
                      backend=args.backend, timeout=args.timeout)


def run_one(args: Any, config: Any, options: Any, world: Any, health: Any, prefix: Optional[RankPrefix] = None,
            served: Optional[ServedJob] = None, watch: Optional[Any] = None) -> Any:
    """Build one job from its flags (or the coordinator's) and train it on the already-joined world
    (`watch` sees the engine before it trains: --recover times the first step after a recovery)."""
    job = load_job(args, world.world_size, served, world.device)
    config = config.resolved(job.plan)  # --schedule auto: the schedule the job builder chose
    recovered = getattr(args, "recovered", None)
    if recovered is not None:  # a re-formed world runs its even split (after an admission: the plan it ran, the
        # joiner a spare) under the version the members agreed on
        plan = recovered.plan if recovered.plan is not None else job.plan
        job = dataclasses.replace(job, plan=dataclasses.replace(plan, version=recovered.plan_version))
    channel = make_channel(args, world.rank, world.world_size, served.token if served else None, config.schedule,
                           job.plan, config)

    def on_engine(engine: Any) -> None:
        if prefix is not None:
            prefix.engine = engine
        if watch is not None:
            watch(engine)
    from model_parallel.runtime.observe import memory_table
    from model_parallel.runtime.observe.memory_probe import PeakProbe

    probe = PeakProbe(world.device)
    probe.start()  # before the stage is materialized: the peak counts everything the run adds
    engine = run_job(job, config, options, args.steps, make_optimizer_factory(args), channel, world, health, on_engine)
    parts = memory_table.predicted(engine.graph, engine.plan, args.optimizer, args.momentum, engine.config.schedule,
                                     config.num_microbatches, config.batch_size // config.num_microbatches,
                                     options.offload_chunk_bytes)
    report = memory_table.gather_report(engine, probe, parts, world.device)
    if world.rank == 0:
        print(f"memory per stage, predicted vs measured:\n{report.text}", flush=True)
    return engine


def leave_peer(error: BaseException, rank: int, health: Any, args: Any, argv: Sequence[str]) -> NoReturn:
    """Exit 3 after a peer died, stalled, left or never joined (`error` names it)."""
    # A dead peer can leave gloo threads blocked; exit without waiting for them.
    match = re.search(r"rank (\d+) stopped responding", str(error))
    # A joiner not yet admitted has no rank ("[rank 0] error: --join ..." read as the job's rank 0 failing)
    who = "[joiner]" if args.join and health is None else f"[rank {rank}]"
    if isinstance(error, ReplacedError):  # a joiner the members met without (it came, or stood still, too late)
        leave(EXIT_REPLACED, f"{who} error: {error}: it does not rejoin", rank, health, linger=False)
    leave(EXIT_PEER, f"{who} error: {error}", rank, health, cause=str(error),
          blamed=int(match.group(1)) if match else None, hint=resume_hint(args.checkpoint_dir, argv, rank, who=who))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    check_inputs(args)
    from model_parallel.cli.worker_join import check_join_flags
    from model_parallel.cli.worker_recover import check_recover_flags

    (check_join_flags if args.join else check_recover_flags)(args)
    check_single_process(args)  # after those: "--recover with --single_process" says more than the flags it ignores
    served = None
    if wants_served_job(args):
        configure_logging(args.verbose)
        args, served = ask_coordinator(argv, args)
        check_numbers(args, "the job from the coordinator: ")
    jobs = read_jobs(args.jobs, build_parser) if args.jobs else [None]
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # steady allocation cost, the same the profile was taken with
    config, options = make_config(args)
    if args.single_process:
        configure_logging(args.verbose, prefix="[single process] ")
        from model_parallel.runtime.trainer import SingleProcessRunner

        job = load_job(args, world_size=args.world_size or 1)
        config = config.resolved(job.plan)
        runner = SingleProcessRunner(job.graph, job.plan, job.model, job.criterion,  # --weights too, as the workers
                                     make_optimizer_factory(args), job.dataset, config, initializer=job.initializer,
                                     offload=(args.offload_optimizer, int(args.offload_chunk_mb * 1e6))
                                     if args.offload_optimizer else None)
        for result in runner.train(args.steps):
            print(f"step {result.step} loss {result.loss:.6f}", flush=True)
        if job.eval_dataset is not None:
            print(f"validation loss {runner.evaluate(job.eval_dataset, args.eval_steps).loss:.6f}", flush=True)
        return 0

    import torch.distributed as dist

    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", 0))
    configure_logging(max(args.verbose, 1) if rank == 0 else args.verbose)
    prefix = install_rank_prefix(rank)
    # SIGTERM (preemption, torchrun stopping the job) or Ctrl-C while training: stop at the next step boundary
    # every rank agrees on, with a checkpoint, and exit EXIT_STOPPED (runtime/step/stop_signals.py).
    stop_signals.install()
    health, survivor = None, None
    try:
        from model_parallel.cli.worker_join import join_running_job, publish_no_recover
        from model_parallel.cli.worker_recover import Survivor

        if args.join:  # admitted into a running job at a step boundary (cli/worker_join.py), in a new world
            survivor = join_running_job(args, argv, config, options, prefix, run_one, Survivor)
        else:
            if args.coordinator and served is None:  # a job served by the coordinator reached it already
                reach_coordinator(args, rank)
            world = join_world(rendezvous(args))
            rank = world.rank
            health = start_health(world, options.timeout)
            if args.recover:  # a lost peer: re-form the world and go on (cli/worker_recover.py); returns when done
                survivor = Survivor(args, argv, config, options, world, health, prefix, run_one)
            else:
                publish_no_recover(world, args)  # rank 0: a joiner learns it cannot join here
        if survivor is not None:
            jobs, health = [], survivor.train()
            world = survivor.world
        for job_argv in jobs:
            # --jobs: several runs in one world (tests: one process launch, many checks).
            job_args = args if job_argv is None else build_parser().parse_args(job_argv)
            job_config, job_options = (config, options) if job_argv is None else make_config(job_args)
            run_one(job_args, job_config, job_options, world, health, prefix, served, watch=worker_hook(rank))
        health.stop("done")
        dist.destroy_process_group()
        # Leave without interpreter teardown: the store host may already be gone, and a store call
        # still blocked in a daemon thread then aborts the teardown ("terminate called without an
        # active exception", exit -6) after a run that succeeded.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except TrainingStopped as error:
        rank, health = (survivor.rank, survivor.health) if survivor else (rank, health)  # --recover: its world now
        # Every rank got the same stop at the same step boundary: nobody waits for anybody.
        leave(EXIT_STOPPED, f"[rank {rank}] error: {error}", rank, health, state="done", cause=str(error),
              linger=False, hint=resume_hint(args.checkpoint_dir, argv, rank))
    except PeerError as error:
        rank, health = (survivor.rank, survivor.health) if survivor else (rank, health)  # --recover: its world now
        leave_peer(error, rank, health, args, argv)
    except ModelParallelError as error:
        rank, health = (survivor.rank, survivor.health) if survivor else (rank, health)  # --recover: its world now
        if health is None:
            raise  # before joining a world: no threads yet, cli.common prints it and exits 2
        # Out of memory is this rank's own failure while training (exit 5, docs/reliability.md), not a usage error.
        code = EXIT_FAILED if isinstance(error, OutOfMemoryError) else EXIT_USAGE
        leave(code, f"{os.path.basename(sys.argv[0])}: error: {error}", rank, health,
              cause=f"{type(error).__name__}: {error}", hint=resume_hint(args.checkpoint_dir, argv, rank, fix_first=True))
    except Exception as error:  # noqa: BLE001 - a layer failing at run time: one line here, and for every peer
        rank, health = (survivor.rank, survivor.health) if survivor else (rank, health)  # --recover: its world now
        if health is None:
            raise
        if isinstance(error, dist.DistError):  # c10d's own error escaped undiagnosed (the store host left, a
            # peer's connection broke): a peer failed, not this rank's code (exit 5); name it
            leave_peer(health.diagnose(error), rank, health, args, argv)
        line = runtime_failure(error, prefix.engine.prefix if prefix.engine is not None else f"[rank {rank}]")
        logger.debug("%s", line, exc_info=True)  # the traceback, for -vv
        leave(EXIT_FAILED, f"{os.path.basename(sys.argv[0])}: error: {line}", rank, health, cause=line,
              hint=resume_hint(args.checkpoint_dir, argv, rank))


if __name__ == "__main__":  # `python -m model_parallel.cli.worker`: what the launchers start
    from model_parallel.cli.common import run_cli

    run_cli(main)
