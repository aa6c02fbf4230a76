"""`model-parallel generate` (PipeDream's step 3, its converter): partitioned graph -> importable package of stage modules.

    model-parallel generate -f out/gpus=3.txt -n ResNet152Partitioned -a resnet152 -o models/resnet152/gpus=3 \\
        --stage_to_num_ranks 0:1,1:1,2:1

(the seed's `python model_parallel/optimizer/convert_graph_to_model.py ...` runs the same).

The logic lives in `model_parallel.codegen.package`; this file parses arguments, checks that `-a` names
the model the graph was profiled from, and prices a plan read off the graph's stage ids (e.g. with
`--stage_to_num_ranks`) from the profile, so workers and `ctl status` show real per-stage costs.
"""
from __future__ import annotations

import logging
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from model_parallel.cli.common import ArgumentParser, configure_logging
from model_parallel.errors import CodegenError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan

if TYPE_CHECKING:
    from model_parallel.optimizer.memory import Footprint

log = logging.getLogger(__name__)


def build_parser(prog: Optional[str] = "model-parallel generate") -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description="Generate a package of pipeline stage modules from a partitioned graph.")
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


def check_arch(graph: Graph, arch: str, source: str) -> None:
    """Refuse `-a` naming another model than the one the graph was profiled from (the package would
    be named, and later looked up, as that model); warn where the graph does not say which it is."""
    profiled = graph.metadata.get("arch")
    if isinstance(profiled, str) and profiled:
        if profiled != arch:
            raise CodegenError(f"{source} was profiled from {profiled!r} but -a says {arch!r}; use -a {profiled} "
                               f"(or profile {arch} and partition that graph)")
        return
    model = graph.metadata.get("model")
    if not isinstance(model, str) or not model:
        log.warning("%s does not say which model it was profiled from (no graph.json sidecar?); -a %s is not checked", source, arch)
        return

    def plain(name: str) -> str:
        return re.sub(r"[^a-z0-9]", "", name.lower())

    # Only the class is known (a model profiled through the Python API): ResNet for resnet152, VGG for vgg16.
    if plain(model) not in plain(arch) and plain(arch) not in plain(model):
        log.warning("%s was profiled from a %s model; -a %s may name another model", source, model, arch)


def price_plan(graph: Graph, plan: Plan, bandwidth: float = 1e9, footprint: Optional["Footprint"] = None) -> Plan:
    """`plan` (ranks assigned) with the per-stage costs the graph's profile predicts, under the optimizer's
    cost model at `bandwidth` bytes/s with transfers counted (as step 2's `--activation_compression_ratio 1`),
    and each stage's memory by the footprint model (`optimizer/memory.py`; default `Footprint()`: SGD with
    momentum, 1F1B, as many microbatches as ranks), its parts in `extra["memory"]` as the optimizer records them.
    A plan read off a graph's stage ids carries no costs; a priced plan (the optimizer's) is returned as is."""
    from dataclasses import replace

    from model_parallel.optimizer.costs import predict_stage_times, stage_costs
    from model_parallel.optimizer.memory import Footprint, footprint_parts, stash_bytes

    plan = plan.with_default_ranks()
    if plan.time_per_minibatch_s or any(s.compute_s or s.communication_s or s.memory_bytes for s in plan.stages):
        return plan
    footprint = footprint if footprint is not None else Footprint()
    costs = stage_costs(graph, plan.stage_of, plan.num_stages)
    stash = stash_bytes(graph, plan.stage_of, plan.num_stages)
    stages, memory_parts, before = [], [], 0
    for stage, cost, kept in zip(plan.stages, costs, stash):
        r = stage.num_replicas
        transfers = [4 * (r - 1) * cost.parameter_bytes / (bandwidth * r)]  # all-reduce among its replicas
        if stage.stage_id > 0:
            transfers.append(2.0 * cost.input_bytes / (bandwidth * r))
        if stage.stage_id < plan.num_stages - 1:
            transfers.append(2.0 * cost.output_bytes / (bandwidth * r))
        parts = footprint_parts(footprint, kept, cost.parameter_bytes, plan.num_ranks, before, r)
        memory_parts.append(parts)
        stages.append(replace(stage, compute_s=cost.compute_s, communication_s=max(transfers), memory_bytes=parts["total"]))
        before += r
    times = predict_stage_times(graph, plan, bandwidth=bandwidth, activation_compression_ratio=1.0)
    extra = {**plan.extra, "priced_from": "profile", "bandwidths": [bandwidth], "memory_model": "footprint",
             "footprint": footprint.to_dict(), "memory": memory_parts}
    return replace(plan, stages=tuple(stages), time_per_minibatch_s=max(times) if times else math.nan,
                   single_machine_time_s=sum(c.compute_s for c in costs), extra=extra)


def straight_recut(graph: Graph, plan: Plan, replicas: Optional[dict[int, int]], source: str) -> Plan:
    """The plan, or a fresh straight pipeline when `--stage_to_num_ranks` asks for K stages of one rank each
    and the partitioned graph has another shape: PipeDream's README runs step 3 with `0:1,1:1,2:1` whatever
    step 2 chose (it may replicate a stage and cut fewer), so the flag, which describes the deployment, wins."""
    if not replicas or set(replicas) <= set(range(plan.num_stages)):
        return plan
    if sorted(replicas) != list(range(len(replicas))) or set(replicas.values()) != {1}:
        return plan  # another shape: plan_with_replicas says what is wrong
    from model_parallel.graph.hierarchy import Hierarchy
    from model_parallel.optimizer.options import PartitionOptions
    from model_parallel.optimizer.partition import partition

    recut = partition(graph, Hierarchy.from_lists([len(replicas)]),
                      PartitionOptions(straight_pipeline=True, activation_compression_ratio=1.0))
    if recut.num_stages != len(replicas):
        return plan
    # Say what was done, not what to do: the optimizer's plan is being replaced, and the user should know why.
    log.warning("NOT using the %d-stage plan in %s: --stage_to_num_ranks asks for %d stage(s) of one rank each, so "
                "this converter re-cut the profile itself into a straight %d-stage pipeline (the optimizer with "
                "--straight_pipeline) and generates that. To keep the partitioner's plan, leave out "
                "--stage_to_num_ranks or give one entry per stage of it; to make steps 2 and 3 agree, partition with "
                "--straight_pipeline -n %d", plan.num_stages, source, len(replicas), len(replicas), len(replicas))
    return recut.with_default_ranks()


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = "model-parallel generate") -> int:
    """`model-parallel generate ...`; `prog=None`: named after the running script (the seed's convert_graph_to_model.py)."""
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.verbose)
    from model_parallel.codegen.build import ensure_layers, check_layers
    from model_parallel.codegen.package import generate_package, plan_with_replicas
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import parse_stage_to_num_ranks, plan_from_graph, read_plan

    started = time.perf_counter()
    graph = load_graph(args.profile_filename)
    check_layers(ensure_layers(graph))  # a hostile file is refused before anything else is said about it
    if args.plan:
        plan, plan_source = read_plan(args.plan), args.plan
        replicas = None
    else:
        replicas = parse_stage_to_num_ranks(args.stage_to_num_ranks) if args.stage_to_num_ranks else None
        plan, plan_source = plan_from_graph(graph), f"stage_id fields of {args.profile_filename}"
        recut = straight_recut(graph, plan, replicas, args.profile_filename)
        if recut is not plan:
            plan, plan_source = recut, f"a straight pipeline re-cut from {args.profile_filename} (--stage_to_num_ranks)"
        else:
            plan = price_plan(graph, plan_with_replicas(plan, replicas))
        replicas = None  # applied above, so the costs account for them
    check_arch(graph, args.arch, args.profile_filename)
    out = generate_package(graph, plan, args.output_directory, args.model_name, args.arch, replicas,
                           graph_source=args.profile_filename, plan_source=plan_source)
    from model_parallel.coordinator.jobfiles import record_last_job

    # `python test_socket.py` with no arguments serves this package (the seed's step 4).
    record = record_last_job(out, arch=args.arch, model_name=args.model_name, num_stages=plan.num_stages,
                             num_ranks=plan.with_default_ranks().num_ranks)
    print(f"wrote {plan.num_stages} stage(s) to {out} in {time.perf_counter() - started:.2f} s "
          f"(recorded in {record}: `python test_socket.py` serves it)")
    return 0

