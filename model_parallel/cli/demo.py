"""`model-parallel demo` (`make demo`): the whole workflow on this machine, through the same command lines a user types.

profile -> partition -> generate -> coordinator + workers -> train, slow one worker, rebalance live
-> report. Everything lands in `runs/<timestamp>/`.
"""
from __future__ import annotations

import re
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from model_parallel.cli.common import ArgumentParser, configure_logging
from model_parallel.errors import ModelParallelError, PeerError
from model_parallel.fileio import atomic_write_json
from model_parallel.runtime.launch import REPO_ROOT, LocalWorld, free_port, worker_commands

# Each step is `model-parallel <command>`, run from REPO_ROOT (run_step's and LocalWorld's directory).
MODEL_PARALLEL = ("-m", "model_parallel.cli.main")


def parse_args(argv: Optional[Sequence[str]]) -> "argparse.Namespace":  # noqa: F821
    p = ArgumentParser(prog="model-parallel demo", description=__doc__)
    p.add_argument("--arch", default="resnet18", help="torchvision classification model (default resnet18)")
    p.add_argument("--image-size", type=int, default=32, help="CPU-friendly input size (default 32)")
    p.add_argument("--batch-size", type=int, default=32, help="minibatch size (default 32)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per minibatch (default 4)")
    p.add_argument("--workers", type=int, default=3, help="pipeline workers (default 3)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--straggler", type=int, default=1, help="rank slowed on purpose (default 1; -1 = none)")
    p.add_argument("--slowdown", type=float, default=3.0, help="how many times slower the straggler gets (default 3)")
    p.add_argument("--slow-at", type=int, default=15, help="step at which the straggler slows down (default 15)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the training phase may take (default 600)")
    p.add_argument("--out", default=None, help="run directory (default runs/<timestamp>)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p.parse_args(argv)


def run_step(description: str, command: list[str], log: Path) -> None:
    """Run one workflow command; its output goes to `log`; failure raises with the log's tail."""
    started = time.monotonic()
    with log.open("w") as handle:
        proc = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT, timeout=900)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise ModelParallelError(f"{description} failed (exit {proc.returncode}); see {log}:\n{tail}")
    print(f"  {description}: done in {time.monotonic() - started:.1f} s  ({' '.join(_short(c) for c in command[1:])})", flush=True)


class _Echo:
    """Shows worker progress as one bar and surfaces plan switches and errors; the rest goes to the logs."""

    _STEP = re.compile(r"\] step (\d+) loss")

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    def __call__(self, rank: int, line: str) -> None:
        match = self._STEP.search(line) if rank == 0 else None
        if match:
            self.bar.n = int(match.group(1)) + 1
            self.bar.refresh()
        elif any(word in line for word in ("switch", "ERROR", "error:", "migrat")) and "%|" not in line:
            # A worker's lines name their rank already (`[rank r stage s]`); add it only where missing.
            self.bar.write(f"  {line}" if f"[rank {rank}" in line else f"  [rank {rank}] {line}")


class _CoordinatorEcho:
    """Shows the coordinator's plan decisions as they happen (above the progress bar once there is one)."""

    def __init__(self) -> None:
        self.bar: Optional[tqdm] = None

    def __call__(self, rank: int, line: str) -> None:
        if "plan v" in line:
            text = f"  [coordinator] {line.split(': ', 1)[-1]}"
            self.bar.write(text) if self.bar is not None else print(text, flush=True)


def _short(arg: str) -> str:
    try:
        return str(Path(arg).relative_to(REPO_ROOT)) if arg.startswith("/") else arg
    except ValueError:
        return arg


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    run_dir = Path(args.out or REPO_ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    py = sys.executable
    n = args.workers
    print(f"model_parallel demo: {args.arch} at {args.image_size}x{args.image_size}, {n} workers -> {run_dir}")

    # 1. profile
    # Profile at the microbatch size the pipeline will run: layers whose cost is dominated by their
    # weights (resnet's last blocks at small images) cost per microbatch, not per sample.
    run_step("profile", [py, *MODEL_PARALLEL, "profile", "-a", args.arch, "-b", str(max(args.batch_size // args.microbatches, 1)),
                         "--image-size", str(args.image_size),
                         "--profile_directory", str(run_dir / "profiles"), "--iterations", "3",
                         "--threads", "1", "--clock", "cpu"], logs / "profile.log")  # the calibration's clock
    graph_txt = run_dir / "profiles" / args.arch / "graph.txt"
    # This machine's link, optimizer and per-microbatch runtime cost: the report's predicted stage times.
    run_step("calibrate", [py, *MODEL_PARALLEL, "calibrate", "--out", str(run_dir / "profiles" / "calibration.json")],
             logs / "calibrate.log")
    # 2. partition
    partition_dir = run_dir / "partition"
    run_step("partition", [py, *MODEL_PARALLEL, "partition", "-f", str(graph_txt), "-n", str(n), "--straight_pipeline",
                           "--activation_compression_ratio", "1", "-o", str(partition_dir)], logs / "partition.log")
    # 3. generate
    package = run_dir / "package"
    class_name = "".join(part.capitalize() for part in args.arch.split("_")) + "Partitioned"
    run_step("generate", [py, *MODEL_PARALLEL, "generate", "-f", str(partition_dir / f"gpus={n}.txt"), "-n", class_name, "-a", args.arch,
                          "-o", str(package), "--plan", str(partition_dir / "plan.json")], logs / "generate.log")
    # 4. coordinator + workers
    token = secrets.token_hex(16)
    coordinator_port = free_port()
    status_file = run_dir / "coordinator_status.json"
    coordinator_cmd = [py, *MODEL_PARALLEL, "coordinator", "--host", "127.0.0.1", "--port", str(coordinator_port), "--token", token,
                       "--graph", str(package / "graph.json"), "--plan", str(package / "plan.json"), "--policy", "auto",
                       "--status-file", str(status_file)]
    worker_args = ["--package", str(package), "--batch_size", str(args.batch_size), "--num_microbatches", str(args.microbatches),
                   "--steps", str(args.steps), "--coordinator", f"127.0.0.1:{coordinator_port}", "--token", token,
                   "--metrics", str(run_dir / "metrics" / "rank{rank}.jsonl"), "--trace_dir", str(run_dir / "trace"), "--measure_memory",
                   "--checkpoint_dir", str(run_dir / "checkpoint"), "--checkpoint_every", str(max(args.steps // 3, 1))]
    if args.straggler >= 0:
        worker_args += ["--slowdown", str(args.slowdown), "--slowdown_rank", str(args.straggler),
                        "--slowdown_after_step", str(args.slow_at)]
    commands = worker_commands(worker_args, n)
    print(f"  coordinator: {' '.join(_short(c) for c in coordinator_cmd[1:]).replace(token, '<token>')}")
    for command in commands:
        print(f"  worker:      {' '.join(_short(c) for c in command[1:]).replace(token, '<token>')}")
    started = time.monotonic()
    echo = _CoordinatorEcho()
    with LocalWorld([coordinator_cmd], echo=echo) as coordinator:
        coordinator.wait_for_line(0, r"listening", timeout=60)
        training = echo.bar = tqdm(total=args.steps, desc="training", unit="step", file=sys.stdout, leave=False)
        with LocalWorld(commands, echo=_Echo(training)) as world:
            result = world.wait(args.timeout)
        echo.bar = None
        training.close()
        (logs / "coordinator.log").write_text("\n".join(coordinator.lines(0)) + "\n")
    for worker in result.workers:
        (logs / f"worker{worker.rank}.log").write_text(worker.output + "\n")
    if not result.ok:
        raise PeerError(f"training failed:\n{result.summary()}")
    # 5. report
    from model_parallel.cli.report import write_report

    report = write_report(run_dir, args, training_seconds=time.monotonic() - started)
    print(report)
    atomic_write_json(run_dir / "demo_args.json", vars(args))
    return 0

