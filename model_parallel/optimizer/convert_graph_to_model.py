"""Command line (PipeDream's converter): partitioned graph -> importable package of stage modules.

    python model_parallel/optimizer/convert_graph_to_model.py -f out/gpus=3.txt -n ResNet152Partitioned \\
        -a resnet152 -o model_parallel/models/resnet152/gpus=3 --stage_to_num_ranks 0:1,1:1,2:1

The logic lives in `model_parallel.codegen.package`; this file only parses arguments.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a plain script from a checkout: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model_parallel.cli.common import ArgumentParser, configure_logging, run_cli  # noqa: E402

log = logging.getLogger("model_parallel.optimizer.convert_graph_to_model")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description="Generate a package of pipeline stage modules from a partitioned graph.")
    parser.add_argument("-f", "--profile_filename", required=True,
                        help="partitioned graph: gpus=N.txt (with its .json sidecar if any) or graph.json")
    parser.add_argument("-n", "--model_name", required=True, help="class name of the composed model, e.g. ResNet152Partitioned")
    parser.add_argument("-a", "--arch", required=True, help="architecture name, e.g. resnet152 (becomes <arch>.py)")
    parser.add_argument("-o", "--output_directory", required=True, help="package directory to write (replaced atomically)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--stage_to_num_ranks", help="replicas per stage, e.g. 0:3,1:1 (default 1 each)")
    group.add_argument("--plan", help="plan.json from the optimizer (instead of the graph's stage_id fields)")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    from model_parallel.codegen.package import generate_package
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import parse_stage_to_num_ranks, plan_from_graph, read_plan

    started = time.perf_counter()
    graph = load_graph(args.profile_filename)
    if args.plan:
        plan, plan_source = read_plan(args.plan), args.plan
        replicas = None
    else:
        replicas = parse_stage_to_num_ranks(args.stage_to_num_ranks) if args.stage_to_num_ranks else None
        plan, plan_source = plan_from_graph(graph), f"stage_id fields of {args.profile_filename}"
    out = generate_package(graph, plan, args.output_directory, args.model_name, args.arch, replicas,
                           graph_source=args.profile_filename, plan_source=plan_source)
    print(f"wrote {plan.num_stages} stage(s) to {out} in {time.perf_counter() - started:.2f} s")
    return 0


if __name__ == "__main__":
    run_cli(main)
