"""`model-parallel COMMAND ...`: one command for every step; each subcommand is a module with `main(argv) -> int`.

A subcommand's module is imported only when it runs, so `model-parallel ctl status` loads no torch and
`model-parallel --help` lists every step without loading any. To add one: write the module and add
a line to SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from model_parallel.cli.common import ArgumentParser, configure_logging, run_cli


@dataclass(frozen=True)
class Subcommand:
    module: str  # a module with `main(argv) -> int` (its own parser: flags and exit codes as its script has)
    help: str
    verbose_flag: bool = True  # its parser takes -v/--verbose (so `model-parallel -v X` passes -v on)

    def run(self, args: argparse.Namespace) -> int:
        """Run the subcommand parsed by build_parser() with the arguments after its name."""
        rest = list(args.args)
        if args.verbose and self.verbose_flag:
            rest = ["-v"] * args.verbose + rest
        elif args.verbose:
            configure_logging(args.verbose)
        return importlib.import_module(self.module).main(rest)


SUBCOMMANDS: dict[str, Subcommand] = {
    "profile": Subcommand("model_parallel.cli.profile",
                          "step 1: profile a torchvision classifier into graph.txt/graph.json (= profiler/image_classification/main.py)"),
    "profile-hf": Subcommand("model_parallel.cli.profile_hf",
                             "step 1 for a Hugging Face model built from a config (config.json or model directory), "
                             "with named inputs and the model's own initialisation", verbose_flag=False),
    "partition": Subcommand("model_parallel.cli.partition",
                            "step 2: partition a profiled graph into pipeline stages (= optimizer/optimizer_graph_hierarchical.py)"),
    "generate": Subcommand("model_parallel.cli.generate",
                           "step 3: generate the package of stage modules (= optimizer/convert_graph_to_model.py)"),
    "coordinator": Subcommand("model_parallel.cli.coordinator", "step 4: run the coordinator (= test_socket.py)"),
    "worker": Subcommand("model_parallel.cli.worker", "step 4: run one pipeline worker (= test_parallel_0.py)"),
    "ctl": Subcommand("model_parallel.cli.ctl",
                      "talk to a running coordinator: status | rebalance | set-plan FILE | scale --workers K | slow"),
    "demo": Subcommand("model_parallel.cli.demo", "the whole workflow on this machine, with a straggler and a live rebalance"),
    "demo-lm": Subcommand("model_parallel.cli.demo_lm",
                          "a small GPT-2 learns Python's own sources: validation loss falls, export, from_pretrained, a line"),
    "export": Subcommand("model_parallel.cli.export",
                         "a checkpoint out as the original model's state dict or a Hugging Face directory (no workers)",
                         verbose_flag=False),
    "checkpoint-upgrade": Subcommand("model_parallel.cli.checkpoint_upgrade",
                                     "convert, once, a checkpoint of an earlier version (torch-pickle shards) to "
                                     "safetensors; only for files you trust"),
    "calibrate": Subcommand("model_parallel.cli.calibrate", "measure this machine's speeds for the cost model",
                            verbose_flag=False),
    "schedule": Subcommand("model_parallel.cli.schedule",
                           "a schedule's grid, bubble and in-flight peak; torch's schedule CSV read (checked) and written",
                           verbose_flag=False),
    "metrics": Subcommand("model_parallel.cli.metrics", "per-step summary of the workers' metrics JSONL files",
                          verbose_flag=False),
    "trace": Subcommand("model_parallel.cli.tracing", "merge per-rank traces into one timeline", verbose_flag=False),
}


def build_parser() -> ArgumentParser:
    width = max(map(len, SUBCOMMANDS))
    listing = "\n".join(f"  {name:<{width}} {sub.help}" for name, sub in SUBCOMMANDS.items())
    parser = ArgumentParser(prog="model-parallel", description="Pipeline model-parallel training for PyTorch.",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=f"commands:\n{listing}\n\n`model-parallel COMMAND --help` shows a command's flags.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (passed on to the command)")
    parser.add_argument("command", choices=tuple(SUBCOMMANDS), metavar="COMMAND", help="one of the commands below")
    # Everything after COMMAND (its --help included) belongs to the command's own parser.
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help=argparse.SUPPRESS)
    return parser


def _main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args)


def main(argv: Optional[Sequence[str]] = None) -> None:
    run_cli(_main, argv)


if __name__ == "__main__":
    main()
