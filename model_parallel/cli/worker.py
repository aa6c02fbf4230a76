"""The worker command line (`python test_parallel_0.py --rank N --dist_addr HOST ...`): one rank of a pipeline.

Also works under `torchrun --nproc_per_node=K test_parallel_0.py ...` (env:// rendezvous) and, with
`--single_process`, runs every stage in one process for debugging. See docs/runtime.md.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

# Before torch loads (c10 reads it once): when a peer or the store host dies, c10d logs a warning
# with 13-26 lines of C++ stack frames per failed store call, ahead of our one-line error that
# already names the rank. An explicit setting (debugging) is kept.
if not os.environ.get("TORCH_CPP_LOG_LEVEL"):
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"

import torch  # noqa: E402

from model_parallel import jsonbound  # noqa: E402
from model_parallel.allocator import keep_freed_memory  # noqa: E402
from model_parallel.cli.common import ArgumentParser, configure_logging  # noqa: E402
from model_parallel.errors import ModelParallelError, PeerError, PlanError, ProtocolError, TrainingStopped  # noqa: E402

logger = logging.getLogger(__name__)

# Exit codes (docs/reliability.md): 0 only when every requested step ran; 2 a usage or configuration
# error (cli.common.run_cli); 3 a peer died, stalled or became unreachable (the message names it);
# 4 the run was stopped before its requested steps (the message says by whom and why).
EXIT_PEER = 3
EXIT_STOPPED = 4


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
    m = p.add_argument_group("model and plan")
    m.add_argument("--model", default=None, help="a built-in model: mlp, resnet18, gpt")
    m.add_argument("--package", default=None, help="a generated package directory (graph.json + plan.json inside)")
    m.add_argument("--graph", default=None, help="graph.json of the model (with --plan)")
    m.add_argument("--plan", default=None, help="plan.json: stages and their ranks (default: even split)")
    m.add_argument("--num_stages", type=int, default=None, help="stages for the even split (default: world size)")
    m.add_argument("--stage_to_num_ranks", default=None, help="replicas per stage for the even split, e.g. 0:2,1:1")
    m.add_argument("--loss", choices=("cross_entropy", "lm"), default=None, help="loss for --graph/--package models")
    m.add_argument("--input_shape", default=None,
                   help="per-sample input shape for a PipeDream-generated --package, e.g. 3,224,224 (it records none)")
    m.add_argument("--num_classes", type=int, default=None,
                   help="classes of the synthetic data for --graph/--package models (default: the model's output width)")
    t = p.add_argument_group("training")
    t.add_argument("--batch_size", type=int, default=8)
    t.add_argument("--num_microbatches", type=int, default=4)
    t.add_argument("--schedule", choices=("1f1b", "gpipe", "pipedream"), default="1f1b")
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    t.add_argument("--lr", type=float, default=0.01)
    t.add_argument("--momentum", type=float, default=0.9)
    t.add_argument("--weight_decay", type=float, default=0.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data", default="synthetic", help="'synthetic' or an ImageFolder directory")
    t.add_argument("--recompute", default=None, help="activation recomputation: 'all' or stage ids, e.g. 0,1")
    t.add_argument("--bf16", action="store_true", help="bf16 autocast for forward passes")
    t.add_argument("--clip_grad", type=float, default=None, help="clip gradients to this global norm")
    t.add_argument("--lr_schedule", default="constant", help="constant | cosine:<steps> | warmup:<steps> | step:<every>:<gamma>")
    o = p.add_argument_group("checkpoints and observation")
    o.add_argument("--checkpoint_dir", default=None)
    o.add_argument("--checkpoint_every", type=int, default=0)
    o.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint_dir")
    o.add_argument("--keep_checkpoints", type=int, default=3,
                   help="committed checkpoints kept in --checkpoint_dir; older ones are deleted (default 3)")
    o.add_argument("--trace_dir", default=None, help="write a Chrome/Perfetto trace per rank here")
    o.add_argument("--metrics", default=None, help="per-step metrics JSONL path ('{rank}' is replaced)")
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


def parse_recompute(text: Optional[str]) -> Any:
    if not text:
        return False
    if text == "all":
        return True
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise PlanError(f"--recompute {text!r}: expected 'all' or stage ids like 0,2") from None


def make_optimizer_factory(args: Any) -> Any:
    def factory(params: list) -> torch.optim.Optimizer:
        if args.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    return factory


def load_job(args: Any, world_size: int) -> dict[str, Any]:
    """Graph, plan, seed-built model, criterion and dataset from the command line."""
    from torch.nn import functional as F

    from model_parallel.graph.plan import parse_stage_to_num_ranks, read_plan
    from model_parallel.runtime.data import make_dataset
    from model_parallel.runtime.stages import even_plan

    sources = [s for s in ("model", "package", "graph") if getattr(args, s)]
    if len(sources) != 1:
        raise PlanError(f"give exactly one of --model, --package, --graph (got {', '.join('--' + s for s in sources) or 'none'})")
    plan = None
    static = None  # a PipeDreamJob when --package is a PipeDream-generated package (static plan)
    if args.model:
        from model_parallel.profiler.trace import trace_model
        from model_parallel.runtime.zoo import recipe

        r = recipe(args.model)
        model = r.model(args.seed)
        micro = max(1, args.batch_size // args.num_microbatches)
        graph, _ = trace_model(model, r.example(micro))
        criterion = r.criterion
        shape, classes, kind = r.input_shape, r.num_classes, r.kind
    else:
        from model_parallel.codegen.build import full_model_from_graph
        from model_parallel.graph.io import load_graph

        from model_parallel.runtime.pipedream import is_pipedream_package, load_pipedream_package

        if args.package and is_pipedream_package(Path(args.package)):
            # PipeDream's converter wrote it: its stage modules are the layers of a static plan.
            micro = max(1, args.batch_size // args.num_microbatches)
            pipedream = load_pipedream_package(Path(args.package), args.seed, parse_shape(args.input_shape), micro)
            graph, plan, model, static = pipedream.graph, pipedream.plan, pipedream.model, pipedream
            logger.info("running PipeDream package %s: %d stage(s), static plan", args.package, plan.num_stages)
        elif args.package:
            package = Path(args.package)
            graph = load_graph(package / "graph.json")
            plan = ranks_from_hybrid_conf(read_plan(package / "plan.json"), package / "hybrid_conf.json")
        else:
            graph = load_graph(args.graph)
        if static is None:
            torch.manual_seed(args.seed)
            model = full_model_from_graph(graph)
        inputs = graph.metadata.get("inputs") or []
        if not inputs:
            raise PlanError(f"{args.package or args.graph}: graph metadata lacks the model inputs' shapes; re-profile the model")
        shape = tuple(inputs[0]["shape"][1:])
        kind = "tokens" if inputs[0]["dtype"].startswith("int") else "dense"
        loss = args.loss or ("lm" if kind == "tokens" else "cross_entropy")
        from model_parallel.models.gpt import lm_loss

        criterion = lm_loss if loss == "lm" else F.cross_entropy
        classes = int(args.num_classes or graph.metadata.get("num_classes") or output_width(graph)
                      or (128 if kind == "tokens" else 10))
    if args.plan:
        plan = read_plan(args.plan)
    if plan is None:
        replicas = parse_stage_to_num_ranks(args.stage_to_num_ranks) if args.stage_to_num_ranks else None
        stages = args.num_stages or (world_size - (sum(replicas.values()) - len(replicas) if replicas else 0))
        plan = even_plan(graph, stages, replicas)
    dataset = make_dataset(args.data, args.batch_size, args.seed, shape=shape, num_classes=classes, kind=kind)
    return {"graph": graph, "plan": plan.with_default_ranks(), "model": model, "criterion": criterion, "dataset": dataset,
            "static_plan": static is not None}


def parse_shape(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """`--input_shape 3,224,224` -> (3, 224, 224) (per sample, without the batch dimension)."""
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise PlanError(f"--input_shape: {text!r} is not a comma-separated list of positive sizes, e.g. 3,224,224")
    return shape


def output_width(graph: Any) -> Optional[int]:
    """Last dimension of the model output (the number of classes / vocabulary size), if the graph records it."""
    node_id = (graph.metadata.get("outputs") or {}).get("node") if isinstance(graph.metadata.get("outputs"), dict) else None
    try:
        outputs = graph[node_id].layer.outputs if node_id is not None else ()
    except Exception:  # noqa: BLE001 - unknown node or no layer: fall back to the default
        return None
    return int(outputs[0].shape[-1]) if outputs and outputs[0].shape else None


def ranks_from_hybrid_conf(plan: Any, path: Path) -> Any:
    """Place a package's stages on the ranks its `hybrid_conf.json` names (PipeDream's stage_to_rank_map)."""
    from dataclasses import replace

    if not path.is_file():
        return plan
    try:
        mapping = jsonbound.load_file(path, error=PlanError, what="hybrid_conf.json")["stage_to_rank_map"]
        ranks = {int(stage): tuple(int(r) for r in rs) for stage, rs in mapping.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise PlanError(f"{path}: expected {{\"stage_to_rank_map\": {{\"0\": [0, 1], ...}}}} ({error})") from None
    if sorted(ranks) != list(range(plan.num_stages)):
        raise PlanError(f"{path}: stage_to_rank_map names stages {sorted(ranks)}, the plan has 0..{plan.num_stages - 1}")
    stages = tuple(replace(s, ranks=ranks[s.stage_id], num_replicas=len(ranks[s.stage_id])) for s in plan.stages)
    return replace(plan, stages=stages)


def make_channel(args: Any, rank: int, world_size: int) -> Any:
    from model_parallel.runtime.control import NullChannel, ScriptedChannel

    if args.coordinator:
        from model_parallel.coordinator.client import CoordinatorChannel
        from model_parallel.coordinator.protocol import read_token

        return CoordinatorChannel(args.coordinator, read_token(args.token, args.token_file), rank, world_size)
    if args.control_script and rank == 0:
        return read_control_script(args.control_script)
    return NullChannel()


def read_control_script(path: str) -> Any:
    """--control_script FILE as a ScriptedChannel; any defect is a ProtocolError naming the file."""
    from model_parallel.runtime.control import ScriptedChannel

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ProtocolError(f"--control_script {path}: cannot read it ({error}); give the JSON file {{step: command}}") from None
    try:
        return ScriptedChannel.from_json(text)
    except ProtocolError as error:
        raise ProtocolError(f"--control_script {path}: {error}") from None


def read_jobs(path: str) -> list[list[str]]:
    """--jobs FILE: a JSON list of argument lists, each checked now (before any rank joins a world)."""
    fix = 'expected a JSON list of argument lists, e.g. [["--model", "mlp", "--steps", "2"], [...]]'
    jobs = jsonbound.load_file(path, error=PlanError, what="jobs file", fix=fix)
    if not isinstance(jobs, list) or not jobs:
        raise PlanError(f"{path}: the jobs file holds {type(jobs).__name__ if jobs != [] else 'an empty list'}; {fix}")
    argvs = []
    for number, job in enumerate(jobs):
        if not isinstance(job, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in job):
            raise PlanError(f"{path}: job [{number}] is {str(job)[:60]!r}, not a list of strings and numbers; {fix}")
        argv = list(map(str, job))
        parser = build_parser()

        def refuse(message: str, number: int = number) -> None:
            raise PlanError(f"{path}: job [{number}]: {message}; fix that job's arguments")

        parser.error = refuse  # type: ignore[method-assign]  # a bad job is our typed error, not SystemExit
        check_inputs(parser.parse_args(argv), f"{path}: job [{number}]: ")
        argvs.append(argv)
    return argvs


def check_inputs(args: Any, where: str = "") -> None:
    """Fail fast, before joining a world, on input files that cannot work (one line each, exit 2)."""
    if args.control_script:
        if not os.path.isfile(args.control_script):
            raise PlanError(f"{where}--control_script {args.control_script}: no such file; give the JSON file "
                            "{step: command} that rank 0 plays")
        read_control_script(args.control_script)
    if args.checkpoint_dir and os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        raise PlanError(f"{where}--checkpoint_dir {args.checkpoint_dir}: is a file, not a directory; give a directory "
                        "(it is created if missing)")
    if args.data != "synthetic" and not os.path.isdir(args.data):
        raise PlanError(f"{where}--data {args.data}: not a directory; give 'synthetic' or an ImageFolder directory "
                        "(root/<class>/<image files>)")
    if args.token_file and not os.path.isfile(args.token_file):
        raise PlanError(f"{where}--token-file {args.token_file}: no such file; write the shared token on its first line")


def make_config(args: Any) -> Any:
    from model_parallel.runtime.engine import TrainConfig

    return TrainConfig(
        batch_size=args.batch_size, num_microbatches=args.num_microbatches, schedule=args.schedule, seed=args.seed,
        recompute=parse_recompute(args.recompute), bf16=args.bf16, clip_grad=args.clip_grad, lr_schedule=args.lr_schedule,
        timeout=args.timeout, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume, trace_dir=args.trace_dir, metrics=args.metrics, slowdown=args.slowdown,
        slowdown_rank=args.slowdown_rank, slowdown_after_step=args.slowdown_after_step,
    )


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise PlanError("--backend nccl needs CUDA, which this machine lacks; use --backend gloo")
    return name


_JOINED = "mp/joined/{}"


def missing_ranks(store: Any, world_size: int, deadline_s: float = 5.0) -> Optional[list[int]]:
    """Ranks that never registered in the store (None if the store cannot say within `deadline_s`)."""
    import threading

    box: dict[str, list[int]] = {}

    def look() -> None:
        box["missing"] = [r for r in range(world_size) if not store.check([_JOINED.format(r)])]

    # A daemon thread with a deadline: a store call on an unreachable host would otherwise never return.
    thread = threading.Thread(target=look, name="join-check", daemon=True)
    thread.start()
    thread.join(deadline_s)
    return box.get("missing")


def init_world(args: Any, config: Any) -> tuple[int, int, Any, torch.device, Optional[int]]:
    """Join the process group (TCPStore on rank 0, or torchrun's env://); returns rank, world, store,
    device and the rank hosting the store (None under torchrun: its agent hosts it)."""
    import torch.distributed as dist

    backend = resolve_backend(args.backend)
    timeout = timedelta(seconds=config.timeout)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", -1))
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", 0))
    if rank < 0 or world_size < 1:
        raise PlanError("the rank and world size are unknown: pass --rank and --world_size, or launch with torchrun")
    if not 0 <= rank < world_size:
        raise PlanError(f"--rank {rank} is outside the world of {world_size} ranks (0..{world_size - 1})")
    device = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if args.dist_addr is None and "MASTER_ADDR" in os.environ and args.rank is None:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return rank, world_size, dist.distributed_c10d._get_default_store(), device, None
    else:
        from torch.distributed import TCPStore

        addr = args.dist_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = args.dist_port or int(os.environ.get("MASTER_PORT", 29500))
        try:
            store = TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as error:
            raise PeerError(f"rank {rank}: cannot reach the rendezvous store at {addr}:{port} within {config.timeout:.0f} s "
                            f"(is rank 0 running, and is the port free/reachable?): {str(error).splitlines()[0]}") from None
        store.set(_JOINED.format(rank), "1")  # so a rank whose join fails can name who never came
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        except (RuntimeError, dist.DistStoreError if hasattr(dist, "DistStoreError") else RuntimeError) as error:
            missing = missing_ranks(store, world_size)
            who = f"rank(s) {missing} never joined" if missing else f"{str(error).splitlines()[0]}"
            raise PeerError(f"rank {rank}: not every one of the {world_size} ranks joined within {config.timeout:.0f} s: "
                            f"{who} (are they running and pointed at {addr}:{port}?)") from None
    return rank, world_size, store, device, 0


def store_address(args: Any) -> str:
    """'host:port' of the rendezvous store, for error messages."""
    addr = args.dist_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    return f"{addr}:{args.dist_port or os.environ.get('MASTER_PORT', 29500)}"


def run_job(args: Any, config: Any, rank: int, world_size: int, health: Any, device: torch.device,
            prefix: Optional[RankPrefix] = None) -> Any:
    """Build this rank's engine for one job on the already-initialised world and train it."""
    from model_parallel.runtime.engine import PipelineEngine

    job = load_job(args, world_size)
    channel = make_channel(args, rank, world_size)
    if job["static_plan"]:
        from model_parallel.runtime.pipedream import StaticPlanChannel

        channel = StaticPlanChannel(channel, "a PipeDream-generated package has no graph.json, and switching plans "
                                             "needs graph.json (regenerate the package with our converter)")
    outcome = "training finished"  # what the coordinator is told at the end (its status shows it)
    try:
        engine = PipelineEngine(graph=job["graph"], plan=job["plan"], model=job["model"].to(device), criterion=job["criterion"],
                                optimizer_factory=make_optimizer_factory(args), dataset=job["dataset"], config=config,
                                channel=channel, health=health, device=device)
        if prefix is not None:
            prefix.engine = engine
        if rank == 0:
            logger.info("%s plan v%d:\n%s", engine.prefix, engine.plan.version, engine.plan.table())
        history = engine.train(args.steps)
        if engine.stop_reason is not None:
            outcome = (f"stopped after {engine.next_step} of the {args.steps} requested step(s): "
                       f"{engine.stop_reason}")
            raise TrainingStopped(f"{engine.prefix} {outcome}")
    except BaseException as error:
        if not isinstance(error, TrainingStopped):
            outcome = f"failed: {error}".splitlines()[0][:500]
        raise
    finally:
        channel.close(outcome)
    if history:
        print(f"{engine.prefix} done: {engine.next_step} step(s), last loss {history[-1].loss:.6f}, "
              f"switch pauses ms {[round(p, 1) for p in engine.switch_pauses_ms]}", flush=True)
    return engine


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    check_inputs(args)
    jobs = read_jobs(args.jobs) if args.jobs else [None]
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # steady allocation cost, the same the profile was taken with
    config = make_config(args)
    if args.single_process:
        configure_logging(args.verbose, prefix="[single process] ")
        from model_parallel.runtime.trainer import SingleProcessRunner

        job = load_job(args, world_size=args.world_size or 1)
        runner = SingleProcessRunner(job["graph"], job["plan"], job["model"], job["criterion"],
                                     make_optimizer_factory(args), job["dataset"], config)
        for result in runner.train(args.steps):
            print(f"step {result.step} loss {result.loss:.6f}", flush=True)
        return 0

    import torch.distributed as dist

    from model_parallel.runtime.health import Health

    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", 0))
    configure_logging(max(args.verbose, 1) if rank == 0 else args.verbose)
    prefix = install_rank_prefix(rank)
    health = None
    try:
        rank, world_size, store, device, store_host = init_world(args, config)
        health = Health(store, rank, world_size, interval=min(1.0, config.timeout / 10), store_host=store_host,
                        store_timeout=config.timeout, store_address=store_address(args)).start()
        for job_argv in jobs:
            # --jobs: several runs in one world (tests: one process launch, many checks).
            job_args = args if job_argv is None else build_parser().parse_args(job_argv)
            job_config = config if job_argv is None else make_config(job_args)
            run_job(job_args, job_config, rank, world_size, health, device, prefix)
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
        # Every rank got the same stop at the same step boundary: nobody waits for anybody.
        print(f"[rank {rank}] error: {error}", file=sys.stderr, flush=True)
        if health is not None:
            health.stop("done", None, str(error))
        logging.shutdown()
        os._exit(EXIT_STOPPED)
    except PeerError as error:
        # A dead peer can leave gloo threads blocked; exit without waiting for them.
        print(f"[rank {rank}] error: {error}", file=sys.stderr, flush=True)
        if health is not None:
            health.stop("failed", None, str(error))
            match = re.search(r"rank (\d+) stopped responding", str(error))
            blamed = int(match.group(1)) if match else None
            # The store host keeps the store up so the others can read who is to blame; not when it is
            # the culprit itself (it stood still): they gave up on it already.
            if rank == health.store_host and blamed != rank:
                health.linger(4 * health.interval + 5, blamed)
        logging.shutdown()
        os._exit(EXIT_PEER)
    except ModelParallelError as error:
        if health is not None:
            health.stop("failed", None, f"{type(error).__name__}: {error}")
            if rank == health.store_host:
                health.linger(4 * health.interval + 5)  # let the others read why before the store goes
        raise
