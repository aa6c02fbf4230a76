"""`model-parallel profile` (PipeDream's step 1): profile a torchvision classifier into graph.txt + graph.json.

    model-parallel profile -a resnet152 -b 64      (= python model_parallel/profiler/image_classification/main.py ...)

The job itself is `profiler.image_classification.classifier.profile_arch`; this parses flags and prints.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

from model_parallel.cli.common import ArgumentParser, configure_logging
from model_parallel.errors import ConfigError
from model_parallel.fileio import check_output_path
from model_parallel.profiler.image_classification.classifier import profile_arch, write_profile
from model_parallel.profiler.resume import PARTIAL_NAME


def build_parser(prog: Optional[str] = "model-parallel profile") -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description="Profile a torchvision image classifier into a PipeDream graph.txt (+ graph.json).")
    parser.add_argument("-a", "--arch", default="resnet18", help="torchvision model name (default resnet18)")
    parser.add_argument("-b", "--batch-size", "--batch_size", dest="batch_size", type=int, default=64, help="minibatch size (default 64)")
    parser.add_argument("--image-size", "--image_size", dest="image_size", type=int, default=224, help="input side in pixels (default 224)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda if available)")
    parser.add_argument("--profile_directory", "--profile-directory", dest="profile_directory", default="profiles",
                        help="output root; files go to <dir>/<arch>/ (default profiles/)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed replays per node (default 1)")
    parser.add_argument("--iterations", type=int, default=3, help="timed replays per node, median kept (default 3)")
    parser.add_argument("--step-iterations", "--step_iterations", dest="step_iterations", type=int, default=5,
                        help="plain training steps timed before and after profiling (default 5)")
    parser.add_argument("--data_dir", "--data-dir", dest="data_dir", default=None,
                        help="an ImageFolder to take the minibatch from (default: synthetic data)")
    parser.add_argument("--num-classes", "--num_classes", dest="num_classes", type=int, default=None,
                        help="classifier outputs (default 1000, or the ImageFolder's class count)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time (default), or this process's CPU time (CPU only; ignores time other "
                             "processes take on a shared machine)")
    parser.add_argument("--bf16", action="store_true",
                        help="time under the bf16 autocast that training with --bf16 uses, and record bf16 sizes")
    parser.add_argument("--force", action="store_true",
                        help="profile even when the memory estimate says the batch does not fit")
    parser.add_argument("--fresh", action="store_true",
                        help=f"ignore measurements an interrupted run left in <dir>/<arch>/{PARTIAL_NAME} (default: resume from them)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug logging")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = "model-parallel profile") -> int:
    """`model-parallel profile ...`; `prog=None`: named after the running script (the seed's main.py)."""
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.verbose)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    directory = Path(args.profile_directory) / args.arch
    # A file there was a NotADirectoryError traceback at the first partial save, after the first timings.
    check_output_path(directory, ConfigError, "--profile_directory", directory=True)
    partial_path = directory / PARTIAL_NAME
    if args.fresh:
        partial_path.unlink(missing_ok=True)
    try:
        graph, summary = profile_arch(
            args.arch, args.batch_size, args.image_size, device=args.device, warmup=args.warmup,
            iterations=args.iterations, num_classes=args.num_classes, data_dir=args.data_dir,
            step_iterations=args.step_iterations, progress=True, clock=args.clock,
            partial_path=partial_path, estimate=True, force=args.force, precision="bf16" if args.bf16 else "fp32",
        )
    except KeyboardInterrupt:
        if partial_path.exists():
            print(f"measurements so far are kept in {partial_path}: run the same command again to resume", file=sys.stderr)
        raise
    written = write_profile(graph, summary, directory)
    partial_path.unlink(missing_ok=True)  # the profile is complete: nothing left to resume
    print(f"{args.arch}: {summary['num_nodes']} nodes, batch {args.batch_size}, {args.image_size}x{args.image_size}, {summary['device']}")
    clock = {"wall": " (wall clock)", "cpu": " (CPU clock)"}.get(str(summary.get("clock")), "")  # --clock: which ms
    print(f"  measured training step {summary['measured_step_ms']:.2f} ms, sum of layers {summary['sum_layer_ms']:.2f} ms{clock} "
          f"(ratio {summary['accuracy_ratio']:.3f}); profiling took {summary['profiling_seconds']:.1f} s "
          f"({summary['overhead_ratio']:.1f} steps)")
    for name, path in written.items():
        print(f"  wrote {path}")
    return 0

