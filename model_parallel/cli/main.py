"""The `model-parallel` console script: one subcommand per job (`ctl`, `coordinator`, ...).

To add a subcommand, write `add_arguments(parser)` and `run(args) -> int` and call
`register_subcommand("name", "one-line help", add_arguments, run)` (or add it to `SUBCOMMANDS`).
"""
from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from model_parallel.cli.common import ArgumentParser, configure_logging, run_cli

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[Any], None]
    run: Callable[[Any], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(name: str, help: str, add_arguments: Callable[[Any], None], run: Callable[[Any], int]) -> None:
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


# ---- ctl ------------------------------------------------------------------------------------------
def _add_token_arguments(parser: Any) -> None:
    parser.add_argument("--token", help="shared secret (or --token-file, or $MODEL_PARALLEL_TOKEN)")
    parser.add_argument("--token-file", "--token_file", dest="token_file", help="file whose first line is the shared secret")


def add_ctl_arguments(parser: Any) -> None:
    parser.add_argument("--address", required=True, help="the coordinator's HOST:PORT")
    _add_token_arguments(parser)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the coordinator (default 10)")
    parser.add_argument("--json", action="store_true", help="print the raw JSON reply")
    ops = parser.add_subparsers(dest="op", required=True, metavar="OP", parser_class=ArgumentParser)
    ops.add_parser("status", help="live plan, per-stage measured times, worker speeds, plan version")
    ops.add_parser("rebalance", help="re-solve now with the measured speeds (no threshold/cooldown)")
    set_plan = ops.add_parser("set-plan", help="switch to the plan in FILE (plan.json)")
    set_plan.add_argument("file")
    scale = ops.add_parser("scale", help="move the pipeline onto K of the running workers (the rest become spares)")
    scale.add_argument("--workers", type=int, required=True)
    slow = ops.add_parser("slow", help="slow rank R down by FACTOR on purpose (1.0 = back to normal)")
    slow.add_argument("--rank", type=int, required=True)
    slow.add_argument("--factor", type=float, required=True)


def format_status(status: dict[str, Any]) -> str:
    lines = [f"plan v{status['plan_version']}"
             + (f" (v{status['pending_version']} being applied)" if status.get("pending_version") is not None else "")
             + f", policy {status['policy']}: {status['last_decision']}", status["table"], "",
             f"{'stage':>5} {'rank':>4} {'nodes':>5} {'profiled ms':>11} {'measured ms':>11} {'speed':>6}"]
    for row in status["stages"]:
        measured = "-" if row["measured_ms"] is None else f"{row['measured_ms']:.2f}"
        speed = "-" if row["speed"] is None else f"{row['speed']:.2f}"
        lines.append(f"{row['stage']:>5} {row['rank']:>4} {row['num_nodes']:>5} {row['profiled_ms']:>11.2f} {measured:>11} {speed:>6}")
    lines += ["", f"{'rank':>4} {'status':<9} {'step':>5} {'stage':>5} {'plan':>4} {'slowdown':>8} {'samples/s':>9}  host (pid)"]
    for w in status["workers"]:
        sps = "-" if w["samples_per_s"] is None else f"{w['samples_per_s']:.1f}"
        stage = "spare" if w["stage"] is None else str(w["stage"])
        lines.append(f"{w['rank']:>4} {w['status']:<9} {w['step']:>5} {stage:>5} {w['plan_version']:>4} "
                     f"{w['slowdown']:>8.2f} {sps:>9}  {w['host']} ({w['pid']})")
    for entry in status.get("history", []):
        lines.append(f"switch to v{entry['version']}: requested after step {entry['requested_at_step']}, "
                     f"applied at step {entry.get('applied_at_step', '-')}: {entry['reason']}")
    if status.get("stop_reason"):
        lines.append(f"stopping: {status['stop_reason']}")
    return "\n".join(lines)


def run_ctl(args: Any) -> int:
    from model_parallel.coordinator.client import CtlClient
    from model_parallel.coordinator.protocol import read_token
    from model_parallel.graph.plan import read_plan

    token = read_token(args.token, args.token_file)
    request: dict[str, Any] = {}
    if args.op == "set-plan":
        request = {"plan": read_plan(args.file).to_dict()}
    elif args.op == "scale":
        request = {"workers": args.workers}
    elif args.op == "slow":
        request = {"rank": args.rank, "factor": args.factor}
    with CtlClient(args.address, token, timeout=args.timeout) as client:
        result = client.request(args.op, **request)
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.op == "status":
        print(format_status(result))
    elif args.op == "slow":
        print(f"rank {result['rank']} slowed down {result['factor']:g}x")
    elif result.get("switched"):
        print(f"switching to plan v{result['version']}" + (f": {result['reason']}" if result.get("reason") else ""))
    else:
        print(f"no switch: {result.get('reason', '')}")
    return 0


# ---- coordinator (also `python test_socket.py`) -----------------------------------------------------
def add_coordinator_arguments(parser: Any) -> None:
    from model_parallel.coordinator.jobfiles import COORDINATOR_ENV, DEFAULT_COORDINATOR_PORT, SERVED_FLAGS, coordinator_port

    parser.add_argument("--host", default="0.0.0.0",
                        help="bind address (default 0.0.0.0: all interfaces, so workers on other machines reach it; "
                             "127.0.0.1 for this machine only)")
    parser.add_argument("--port", type=int, default=coordinator_port(),
                        help=f"TCP port (default: the port of ${COORDINATOR_ENV}, else {DEFAULT_COORDINATOR_PORT}; "
                             "0 = any free port, printed)")
    _add_token_arguments(parser)
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


def _coordinator_token(args: Any) -> tuple[bytes, str]:
    """The token given (flag, file, environment), else a fresh one in the local token file; and where it is."""
    import os

    from model_parallel.coordinator.jobfiles import write_fresh_token
    from model_parallel.coordinator.protocol import TOKEN_ENV, read_token

    if args.token is not None or args.token_file is not None or os.environ.get(TOKEN_ENV):
        where = "--token" if args.token is not None else args.token_file or f"${TOKEN_ENV}"
        return read_token(args.token, args.token_file), where
    token, path = write_fresh_token()
    return token, f"{path} (fresh for this run, readable only by you)"


def join_instructions(plan: Any, port: int, token_where: str) -> str:
    """What to run on the workers (printed at start: the seed's step 4 needs nothing else)."""
    lines = [f"token: {token_where}", f"start one worker per rank ({plan.num_ranks}), from this directory or any "
             "with the project installed (they get the graph, plan and training flags from here):"]
    lines += [f"  python test_parallel_0.py --rank {r} --dist_addr <rank 0's address>" for r in range(plan.num_ranks)]
    lines += ["other machines: export MODEL_PARALLEL_TOKEN=<the token file's first line> (or --token-file F);",
              f"  if this coordinator is not on rank 0's machine: export MODEL_PARALLEL_COORDINATOR=<this host>:{port}"]
    return "\n".join(lines)


def _memory_solver(limit: float, served: dict, graph: Any, plan: Any) -> Any:
    """The rebalancer's solver under `--memory_per_worker`, priced for the served training flags (else the
    worker's defaults); the starting plan must fit too."""
    from model_parallel.coordinator.solver import memory_solver
    from model_parallel.errors import ConfigError
    from model_parallel.optimizer.memory import Footprint, activation_scale, optimizer_kind, plan_footprint

    microbatches = served.get("num_microbatches", 4)
    footprint = Footprint(optimizer_kind(served.get("optimizer", "sgd"), served.get("momentum", 0.9)),
                          served.get("schedule", "1f1b"), microbatches,
                          activation_scale(graph, max(1, served.get("batch_size", 8) // microbatches)))
    for stage, parts in zip(plan.stages, plan_footprint(graph, plan.with_default_ranks(), footprint)):
        if parts["total"] > limit:
            raise ConfigError(f"the starting plan puts a predicted {parts['total']:.4g} bytes on stage {stage.stage_id}, "
                              f"over --memory_per_worker {limit:.4g}; give a plan that fits (the optimizer's "
                              "--memory_per_worker finds one) or raise --memory_per_worker")
    return memory_solver(limit, footprint)


def run_coordinator(args: Any) -> int:
    from model_parallel.coordinator.jobfiles import SERVED_FLAGS
    from model_parallel.coordinator.policy import PolicyConfig
    from model_parallel.coordinator.server import Coordinator
    from model_parallel.fileio import atomic_write_text
    from model_parallel.graph.json_format import graph_to_dict

    graph, plan, source = _coordinator_job(args)
    token, token_where = _coordinator_token(args)
    config = PolicyConfig(threshold=args.threshold, cooldown_steps=args.cooldown_steps, window=args.window,
                          speed_change=args.speed_change, persist=args.persist)
    served = {flag: getattr(args, flag) for flag in SERVED_FLAGS if getattr(args, flag) is not None}
    job = {"graph": graph_to_dict(graph), "plan": plan.to_dict(), "plan_version": plan.version, "train": served}
    solver = _memory_solver(args.memory_per_worker, served, graph, plan) if args.memory_per_worker else None
    coordinator = Coordinator(graph, plan, token, policy=args.policy, config=config, status_file=args.status_file,
                              heartbeat_timeout=args.heartbeat_timeout, job=job, solver=solver)
    port = coordinator.start(args.host, args.port)
    print(f"coordinator listening on {args.host}:{port}, serving {source} "
          f"({plan.num_stages} stage(s) on {plan.num_ranks} rank(s))", flush=True)
    print(join_instructions(plan, port, token_where), flush=True)
    if args.port_file:
        atomic_write_text(args.port_file, f"{port}\n")
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
    print(f"coordinator done: plan v{status['plan_version']}, {len(status['history'])} switch(es)"
          + (f"; {status['stop_reason']}" if status["stop_reason"] else ""), flush=True)
    return 1 if status["stop_reason"] else 0


register_subcommand("ctl", "talk to a running coordinator: status | rebalance | set-plan FILE | scale --workers K | slow",
                    add_ctl_arguments, run_ctl)
register_subcommand("coordinator", "run the coordinator (same as `python test_socket.py`)",
                    add_coordinator_arguments, run_coordinator)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="model-parallel", description="Pipeline model-parallel training for PyTorch.")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=ArgumentParser)
    for name, sub in SUBCOMMANDS.items():
        sub.add_arguments(commands.add_parser(name, help=sub.help, description=sub.help))
    return parser


def _main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose + (1 if args.command == "coordinator" else 0))
    return SUBCOMMANDS[args.command].run(args)


def coordinator_main(argv: Optional[Sequence[str]] = None) -> int:
    """`python test_socket.py ...` = `model-parallel coordinator ...`."""
    parser = ArgumentParser(prog="test_socket.py", description="The model_parallel coordinator (control plane).")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    add_coordinator_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.verbose + 1, prefix="[coordinator] ")
    return run_coordinator(args)


def main(argv: Optional[Sequence[str]] = None) -> None:
    run_cli(_main, argv)


if __name__ == "__main__":
    main()
