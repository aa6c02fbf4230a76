"""`model-parallel coordinator ...` (the seed's `python test_socket.py`): serve a job, collect measurements, rebalance live."""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any, Optional

from model_parallel.cli.common import ArgumentParser, add_token_arguments, configure_logging

logger = logging.getLogger(__name__)

HELP = "run the coordinator (same as `python test_socket.py`)"


def add_arguments(parser: Any) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0)
    from model_parallel.coordinator.jobfiles import COORDINATOR_ENV, DEFAULT_COORDINATOR_PORT, SERVED_FLAGS, coordinator_port

    parser.add_argument("--host", default="0.0.0.0",
                        help="bind address (default 0.0.0.0: all interfaces, so workers on other machines reach it; "
                             "127.0.0.1 for this machine only)")
    parser.add_argument("--port", type=int, default=coordinator_port(),
                        help=f"TCP port (default: the port of ${COORDINATOR_ENV}, else {DEFAULT_COORDINATOR_PORT}; "
                             "0 = any free port, printed)")
    add_token_arguments(parser)
    job = parser.add_argument_group("the job (default: the package convert_graph_to_model.py wrote last)")
    job.add_argument("--package", help="a generated package directory (graph.json + plan.json inside)")
    job.add_argument("--graph", help="the profiled graph (graph.json or graph.txt), with --plan")
    job.add_argument("--plan", help="the starting plan v0 (plan.json, or a partitioned gpus=N.txt), with --graph")
    train = parser.add_argument_group("training flags sent to workers (a worker's own flags win; unset: the worker's defaults)")
    for flag, kind in SERVED_FLAGS.items():
        train.add_argument(f"--{flag}", type=kind, default=None)
    parser.add_argument("--memory_per_worker", type=float, default=None,
                        help="bytes one worker may hold: no re-plan puts a predicted footprint over it (the training "
                             "flags above, else the worker's defaults, say which optimizer, schedule and microbatches)")
    parser.add_argument("--policy", choices=("auto", "manual"), default="auto",
                        help="auto: rebalance on measured speeds; manual: only on ctl commands")
    parser.add_argument("--threshold", type=float, default=0.1, help="minimum predicted gain to switch (default 0.1)")
    parser.add_argument("--cooldown-steps", "--cooldown_steps", dest="cooldown_steps", type=int, default=20,
                        help="steps between two switches (default 20; the first switch may come sooner when the "
                             "predicted gain is at least twice the threshold)")
    parser.add_argument("--window", type=int, default=5, help="samples per rank whose median is trusted (default 5)")
    parser.add_argument("--speed-change", "--speed_change", dest="speed_change", type=float, default=0.5,
                        help="relative change of a worker's speed that triggers re-planning (default 0.5)")
    parser.add_argument("--noise-band", "--noise_band", dest="noise_band", type=float, default=0.2,
                        help="workers whose speeds differ by at most this ratio are solved for their median: one "
                             "noisy window must not move layers (default 0.2; 0 plans for every measured difference)")
    parser.add_argument("--persist", type=int, default=3,
                        help="evaluations in a row a speed change must last before re-planning (default 3)")
    parser.add_argument("--heartbeat-timeout", "--heartbeat_timeout", dest="heartbeat_timeout", type=float, default=5.0,
                        help="seconds of silence before a worker is shown unreachable; it never stops the run (default 5)")
    parser.add_argument("--status-file", "--status_file", dest="status_file", help="JSON status, rewritten atomically")
    parser.add_argument("--port-file", "--port_file", dest="port_file", help="write the bound port here (for --port 0)")
    parser.add_argument("--timeout", type=float, default=0.0, help="exit after this many seconds (0 = no limit)")


def _load_plan(path: str) -> Any:
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import plan_from_graph, read_plan

    if path.endswith(".json"):
        return read_plan(path)
    return plan_from_graph(load_graph(path))


def _coordinator_job(args: Any) -> tuple[Any, Any, str]:
    """(graph, plan v0, where they came from): --graph/--plan, --package, else the last converted package."""
    from pathlib import Path

    from model_parallel.api.job import ranks_from_hybrid_conf
    from model_parallel.coordinator.jobfiles import read_last_job
    from model_parallel.errors import ConfigError
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import read_plan

    if args.package and (args.graph or args.plan):
        raise ConfigError("give --package or --graph/--plan, not both")
    if bool(args.graph) != bool(args.plan):
        raise ConfigError(f"--{'graph' if args.graph else 'plan'} needs --{'plan' if args.graph else 'graph'} as well "
                          "(or give --package DIR, or nothing: the package convert_graph_to_model.py wrote last)")
    if args.graph:
        return load_graph(args.graph), _load_plan(args.plan), f"{args.graph} + {args.plan}"
    package = Path(args.package) if args.package else read_last_job()
    plan = ranks_from_hybrid_conf(read_plan(package / "plan.json"), package / "hybrid_conf.json")
    return load_graph(package / "graph.json"), plan, str(package)


MIN_TOKEN_BYTES = 16  # below this a token reachable from other machines is warned about (secrets.token_hex(16): 32)


def _loopback(host: str) -> bool:
    """Whether `host` is only reachable from this machine (127.x, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _coordinator_token(args: Any) -> tuple[bytes, str]:
    """The token given (flag, file, environment), else a fresh one in the local token file; and where it is."""
    import os

    from model_parallel.coordinator.jobfiles import write_fresh_token
    from model_parallel.coordinator.protocol import TOKEN_ENV, read_token

    if args.token is not None or args.token_file is not None or os.environ.get(TOKEN_ENV):
        where = "--token" if args.token is not None else args.token_file or f"${TOKEN_ENV}"
        token = read_token(args.token, args.token_file)
        if len(token) < MIN_TOKEN_BYTES and not _loopback(args.host):
            # Every message carries an HMAC of the token: one frame seen on the network lets a short one be
            # guessed offline, and whoever has it can move layers and stop the job. A policy, so a warning.
            logger.warning("the shared token (%s) is %d bytes and the coordinator listens on %s: anyone who sees one "
                           "message can guess it offline; use at least %d random bytes (leave the token out and the "
                           "coordinator writes a fresh one, or `python -c 'import secrets; print(secrets.token_hex(16))'`)",
                           where, len(token), args.host, MIN_TOKEN_BYTES)
        return token, where
    token, path = write_fresh_token()
    return token, f"{path} (fresh for this run, readable only by you)"


def _servable(job: dict[str, Any], source: str) -> tuple[Optional[dict[str, Any]], str]:
    """(the job, "") if one `job` message carries it to a worker; else (None, why and what to do). A graph over the
    served-job limit (64 MiB; graph files may be 1 GiB) used to start a coordinator that then dropped every job
    request, visible only in its log, while the workers retried and blamed the token."""
    from model_parallel.coordinator.protocol import encode_body, make_message
    from model_parallel.errors import ProtocolError

    try:
        encode_body(make_message("job", **job))
    except ProtocolError as error:
        reason = (f"the job of {source} is not served to workers ({error}): start every worker with --graph and "
                  "--plan (the same files) and its training flags; this coordinator still coordinates them")
        logger.warning("%s", reason)
        return None, reason
    return job, ""


def join_instructions(plan: Any, port: int, token_where: str) -> str:
    """What to run on the workers (printed at start: the seed's step 4 needs nothing else)."""
    from model_parallel.coordinator.jobfiles import coordinator_port

    lines = [f"token: {token_where}", f"start one worker per rank ({plan.num_ranks}), from this directory or any "
             "with the project installed (they get the graph, plan and training flags from here):"]
    lines += [f"  python test_parallel_0.py --rank {r} --dist_addr <rank 0's address>" for r in range(plan.num_ranks)]
    lines += ["other machines: export MODEL_PARALLEL_TOKEN=<the token file's first line> (or --token-file F);"]
    if port != coordinator_port():  # workers ask rank 0's host on that port: these lines alone would wait, then fail
        lines += [f"every worker, this machine's too: export MODEL_PARALLEL_COORDINATOR=<this host>:{port} (this "
                  f"coordinator listens on port {port}, workers look on {coordinator_port()}; or add --coordinator)"]
    else:
        lines += [f"  if this coordinator is not on rank 0's machine: export MODEL_PARALLEL_COORDINATOR=<this host>:{port}"]
    return "\n".join(lines)


def run(args: Any) -> int:
    from model_parallel.coordinator.jobfiles import SERVED_FLAGS
    from model_parallel.coordinator.policy import PolicyConfig
    from model_parallel.coordinator.server import Coordinator
    from model_parallel.fileio import atomic_write_text
    from model_parallel.graph.json_format import graph_to_dict

    graph, plan, source = _coordinator_job(args)
    token, token_where = _coordinator_token(args)
    config = PolicyConfig(threshold=args.threshold, cooldown_steps=args.cooldown_steps, window=args.window,
                          speed_change=args.speed_change, persist=args.persist,
                          noise_band=args.noise_band)
    served = {flag: getattr(args, flag) for flag in SERVED_FLAGS if getattr(args, flag) is not None}
    job, no_job_reason = _servable({"graph": graph_to_dict(graph), "plan": plan.to_dict(), "plan_version": plan.version,
                                    "train": served}, source)
    memory = _memory_limit(args.memory_per_worker, served, graph) if args.memory_per_worker else None
    coordinator = Coordinator(graph, plan, token, policy=args.policy, config=config, status_file=args.status_file,
                              heartbeat_timeout=args.heartbeat_timeout, job=job, memory=memory,
                              no_job_reason=no_job_reason)
    port = coordinator.start(args.host, args.port)
    print(f"coordinator listening on {args.host}:{port}, serving {source} "
          f"({plan.num_stages} stage(s) on {plan.num_ranks} rank(s))", flush=True)
    print(join_instructions(plan, port, token_where) if job is not None else no_job_reason, flush=True)
    if args.port_file:
        try:
            atomic_write_text(args.port_file, f"{port}\n")
        except OSError as error:
            from model_parallel.errors import ConfigError

            coordinator.stop()
            raise ConfigError(f"--port-file {args.port_file}: cannot write it ({error.strerror or error}); give a "
                              "path in a directory you can write") from None
    stopping = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        logger.warning("signal %d: shutting down", signum)
        stopping.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
    import time

    deadline = time.monotonic() + args.timeout if args.timeout > 0 else None
    try:
        while not stopping.is_set():
            if coordinator.wait(0.5):
                logger.info("every worker finished or died; exiting")
                break
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("--timeout %.0f s reached; exiting", args.timeout)
                break
    finally:
        coordinator.stop()
    status = coordinator.status()
    print(f"coordinator done: plan v{status['plan_version']}, {status.get('switches', len(status['history']))} switch(es)"
          + (f"; {status['stop_reason']}" if status["stop_reason"] else ""), flush=True)
    if status["stop_reason"]:
        trained = any(row.get("samples_per_s") is not None for row in status.get("workers", []))
        print(resume_line(status.get("checkpoint_dirs", []), trained), flush=True)
    return 1 if status["stop_reason"] else 0


def resume_line(checkpoint_dirs: Sequence[str], trained: bool = True) -> str:
    """After a failed run: the latest committed checkpoint the workers named, and how to resume from it. `trained`
    False (no worker reported a step): they refused the job, and the same command would fail the same way."""
    import shlex
    import sys

    from model_parallel.errors import CheckpointError
    from model_parallel.runtime.checkpoint.layout import latest_step, step_dir

    again = shlex.join([*_launcher(), *sys.argv[1:]])
    if not trained:
        return ("the workers stopped before their first step (the error above says why): fix what it names, then start "
                f"{again} and the workers again")
    if not checkpoint_dirs:
        return (f"the workers keep no checkpoints (no --checkpoint_dir): nothing to resume from; start over with {again} "
                "and the workers")
    parts = []
    for directory in checkpoint_dirs:
        try:
            step = latest_step(directory) if os.path.isdir(directory) else None
        except (CheckpointError, OSError) as error:
            parts.append(f"{directory!r}: unreadable here ({error})")
            continue
        if step is not None:
            parts.append(f"latest committed checkpoint {str(step_dir(directory, step))!r}")
        elif os.path.isdir(directory):
            parts.append(f"no checkpoint committed in {directory!r}")
        else:
            parts.append(f"{directory!r} (on the workers' machines: their last lines name its latest step)")
    return (f"{'; '.join(parts)}; resume: {again}, then every worker with its own command line plus --resume "
            "(each worker's last line prints its exact command)")


def _launcher() -> list[str]:
    """How this coordinator was started, up to its arguments: `python test_socket.py`, `model-parallel` (its argv goes on
    with `coordinator`), `python -m model_parallel.cli.main` (the same); `python <basename of argv[0]>` named a
    `python model-parallel` or `python main.py` that does not run."""
    import sys

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    script = os.path.basename(sys.argv[0]) or "test_socket.py"
    if spec is not None:
        return [os.path.basename(sys.executable), "-m", spec.name.removesuffix(".__main__")]
    return [script] if script == "model-parallel" else [os.path.basename(sys.executable), script]


def _memory_limit(limit: float, served: dict, graph: Any) -> Any:
    """`--memory_per_worker` priced for the served training flags (else the worker's defaults). Under `--schedule
    auto` the re-plans are priced as 1f1b (the least a one-stage-per-rank plan holds) and each plan's schedule,
    chosen again at every switch, by its own footprint (coordinator/rechoose.py)."""
    from model_parallel.optimizer.memory import Footprint, MemoryLimit, activation_scale, optimizer_kind

    microbatches = served.get("num_microbatches", 4)
    schedule = served.get("schedule", "1f1b")
    return MemoryLimit(limit, Footprint(optimizer_kind(served.get("optimizer", "sgd"), served.get("momentum", 0.9)),
                                        "1f1b" if schedule == "auto" else schedule, microbatches,
                                        activation_scale(graph, max(1, served.get("batch_size", 8) // microbatches))))


def main(argv: Optional[Sequence[str]] = None, prog: str = "model-parallel coordinator") -> int:
    parser = ArgumentParser(prog=prog, description="The model_parallel coordinator (control plane).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.verbose + 1, prefix="[coordinator] ")
    return run(args)


def coordinator_main(argv: Optional[Sequence[str]] = None) -> int:
    """`python test_socket.py ...` = `model-parallel coordinator ...`."""
    return main(argv, prog="test_socket.py")

