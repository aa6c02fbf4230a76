"""`model-parallel partition` (PipeDream's step 2): profile graph -> pipeline plan on a machine hierarchy.

    model-parallel partition -f profiles/resnet50/graph.txt -n 4 4 -b 40e9 1.25e9 --activation_compression_ratio 1 -o out/

(the seed's `python model_parallel/optimizer/optimizer_graph_hierarchical.py ...` runs the same).

Prints PipeDream's numbers and the plan as a table; with -o writes gpus=<N>.txt (the graph with a
stage_id on every node, plus its .json sidecar when the input had one), plan.json and gpus=<N>.svg.
The logic lives in `model_parallel.optimizer.partition`; this file parses arguments and writes files.
"""
from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from model_parallel.cli.common import ArgumentParser, configure_logging
from model_parallel.graph.in_flight import LOOP_SCHEDULES, MULTI_STAGE_SCHEDULES
from model_parallel.runtime.step.schedule import SCHEDULE_NAMES

log = logging.getLogger(__name__)


def build_parser(prog: Optional[str] = "model-parallel partition") -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description="Partition a profiled graph into pipeline stages (PipeDream's optimizer, exact and fast).")
    parser.add_argument("-f", "--profile_filename", required=True, help="graph.txt (PipeDream format) or graph.json to partition")
    parser.add_argument("-n", "--all_num_machines", nargs="+", type=int, required=True,
                        help="workers per level, innermost first (-n 8 2 = 8 GPUs in each of 2 servers)")
    parser.add_argument("-b", "--network_bandwidths", nargs="+", type=float, default=None,
                        help="bytes/s of each level's links, one per level (default 1e9 each)")
    parser.add_argument("-s", "--memory_size", type=float, default=16e9, help="bytes of memory per worker (default 16e9)")
    parser.add_argument("--memory_per_worker", type=float, default=None,
                        help="bytes one worker may hold, by the footprint model: -s BYTES --use_memory_constraint "
                             "--memory_model footprint in one flag (refuses with the smallest that fits)")
    parser.add_argument("--straight_pipeline", action="store_true", help="no replication of stages")
    parser.add_argument("--use_memory_constraint", action="store_true", help="discard plans whose stashed bytes exceed -s")
    parser.add_argument("--use_fewer_machines", action="store_true", help="a level may leave machines unused when faster")
    parser.add_argument("--activation_compression_ratio", type=float, default=None,
                        help="count inter-stage transfers at size/R (without it, transfers are not counted)")
    parser.add_argument("-o", "--output_directory", default=None, help="write gpus=<N>.txt, plan.json and gpus=<N>.svg here")
    parser.add_argument("--memory_model", choices=("pipedream", "1f1b", "footprint"), default=None,
                        help="memory estimate for --use_memory_constraint and the plan's memory column: PipeDream's "
                             "stash estimates, or the real footprint (default pipedream; footprint when --optimizer, "
                             "--schedule, --microbatches or --microbatch_size is given; see docs/optimizer.md)")
    parser.add_argument("--optimizer", choices=("sgd", "sgd_momentum", "adam", "adamw"), default=None,
                        help="footprint: optimizer state per parameter (sgd 0, sgd_momentum 1, adam/adamw 2; default sgd_momentum)")
    parser.add_argument("--schedule", choices=SCHEDULE_NAMES, default=None,
                        help="footprint: the schedule whose in-flight microbatches (and weight versions) a stage holds (default 1f1b)")
    parser.add_argument("--stages_per_rank", type=int, default=2,
                        help="--schedule interleaved or zbinterleaved: stages per worker (p*v stages, stage k on worker k %% p; default 2); "
                             "--schedule zbv always places 2 per worker in a V")
    parser.add_argument("--microbatches", type=int, default=None, help="footprint: microbatches per minibatch (default: the workers)")
    parser.add_argument("--microbatch_size", type=int, default=None,
                        help="footprint: samples per microbatch; activations scale by it / the graph's profiled batch_size")
    parser.add_argument("--worker_speeds", nargs="+", type=float, default=None,
                        help="relative speed of each worker in rank order, innermost level first (1.0 = as profiled); "
                             "one per worker of the whole hierarchy")
    parser.add_argument("--cuts", choices=("auto", "antichain", "topological", "all"), default="auto",
                        help="state space: PipeDream's antichains (exact reproduction), topological prefixes, all valid cuts (small graphs), or auto")
    parser.add_argument("--search", action="store_true",
                        help="with --cuts auto: where PipeDream's DP is out of reach, run the opt-in search layers "
                             "(bounded exact solves, the three-level proof) instead of settling for the best prefix plan")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v for info logs, -vv for debug")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = "model-parallel partition") -> int:
    """`model-parallel partition ...`; `prog=None`: named after the running script (the seed's optimizer_graph_hierarchical.py)."""
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.verbose)
    from model_parallel.errors import RenderError
    from model_parallel.graph.io import load_graph, save_graph, sidecar_path
    from model_parallel.graph.hierarchy import Hierarchy
    from model_parallel.graph.plan import write_plan
    from model_parallel.graph.render import render_graph
    from model_parallel.optimizer.options import PartitionOptions
    from model_parallel.optimizer.partition import partition

    _output_directory(args, create=False)  # a bad -o is refused before the solve, not with a traceback after it
    if args.memory_per_worker is not None:  # the one flag for "plans that fit", by the real footprint
        args.memory_size, args.use_memory_constraint = args.memory_per_worker, True
    graph = load_graph(args.profile_filename)
    hierarchy = Hierarchy.from_lists(args.all_num_machines, args.network_bandwidths, args.memory_size)
    memory_model, footprint = _memory_model(args, graph.metadata)
    options = PartitionOptions(
        straight_pipeline=args.straight_pipeline,
        use_fewer_machines=args.use_fewer_machines,
        activation_compression_ratio=args.activation_compression_ratio,
        use_memory_constraint=args.use_memory_constraint,
        memory_model=memory_model,
        footprint=footprint,
        worker_speeds=tuple(args.worker_speeds) if args.worker_speeds else None,
        cuts=args.cuts,
    )
    for level in hierarchy.levels:
        print(f"Solving optimization problem with {level.num_machines} machines with "
              f"inter-machine bandwidth of {level.bandwidth / 1e9:.2f} GB/s")
    if args.schedule in MULTI_STAGE_SCHEDULES:  # several stages per worker: balanced by rank sums, not PipeDream's search
        return _several_per_worker(args, graph, hierarchy.num_workers, footprint)
    if args.search:
        from model_parallel.optimizer.search import searched_partition

        plan = searched_partition(graph, hierarchy, options)
    else:
        plan = partition(graph, hierarchy, options)

    total = plan.single_machine_time_s
    pipeline = plan.time_per_minibatch_s
    data_parallel = float(plan.extra.get("data_parallel_time_s", math.nan))
    machines = ",".join(str(n) for n in args.all_num_machines)
    considered = plan.extra.get("states_considered")
    print(f"Total number of states: {plan.extra.get('num_states')} ({plan.extra.get('cuts')} cuts"
          + (f", bounded from {considered}" if considered else "") + ")")
    if plan.extra.get("exact"):
        print("Optimal over PipeDream's states: yes")
    else:
        lower = plan.extra.get("lower_bound_s") or 0.0
        within = f"; at most {plan.time_per_minibatch_s / lower - 1:.1%} above the optimum" if lower > 0 else ""
        searched = {
            "bounded": "the cuts a bounded solve kept",
            "flattened": "the cuts of plans with unreplicated outermost stages",
        }.get(plan.extra.get("cuts"), "topological cut points")
        print(f"Optimal over PipeDream's states: not proven (best over {searched}{within})")
    print(f"Total number of stages: {plan.num_stages}")
    print()
    print("Time taken by single-stage pipeline:", total)
    print("Time per stage in pipeline:", pipeline)
    print("Throughput increase (compared to single machine):", _speedup(total, pipeline))
    print(f"[Note that single-machine and ({machines})-machine DP might not fit given memory constraints]")
    print(f"Throughput increase of ({machines})-machine DP compared to single machine:", _speedup(total, data_parallel))
    print(f"Throughput increase (compared to ({machines})-machine DP):", _speedup(data_parallel, pipeline))
    print(f"Optimizer time: {plan.optimizer_seconds:.3f} s")
    print()
    print(plan.table())

    out = _output_directory(args)
    if out is not None:
        workers = hierarchy.num_workers
        partitioned = graph.with_stages(plan.stage_of)
        # Keep layer specs beside the text file only when the input carried them (graph.json or sidecar).
        source = Path(args.profile_filename)
        had_layers = source.suffix == ".json" or sidecar_path(source).exists()
        text_path = save_graph(partitioned, out / f"gpus={workers}.txt", with_sidecar=had_layers)
        plan_path = write_plan(plan, out / "plan.json")
        print(f"wrote {text_path} and {plan_path}")
        try:
            picture = render_graph(partitioned, out / f"gpus={workers}.svg", title=f"{source.name}: {plan.num_stages} stages")
            print(f"wrote {picture}")
        except RenderError as error:
            print(f"warning: {error}", file=sys.stderr)
    return 0


def _several_per_worker(args: Any, graph: Any, workers: int, footprint: Any) -> int:
    """`--schedule interleaved` or `zbinterleaved`: p*v stages, stage k on worker k % p, priced by that schedule's
    footprint (optimizer.contiguous.loop_plan); `--schedule
    zbv`: 2p stages in a V, worker r holding stages r and 2p-1-r (optimizer.contiguous.v_plan); both balanced by each
    worker's summed stages. Prints the plan and each worker's compute (interleaved: the analytic bubble too);
    writes plan.json."""
    from model_parallel.errors import ConfigError
    from model_parallel.graph.plan import write_plan
    from model_parallel.optimizer.contiguous import loop_plan, v_plan

    ignored = [flag for flag, on in (("--search", args.search), ("--use_fewer_machines", args.use_fewer_machines),
                                     ("--cuts", args.cuts != "auto"),
                                     ("--use_memory_constraint", args.use_memory_constraint and args.memory_per_worker is None),
                                     ("--stages_per_rank", args.schedule == "zbv" and args.stages_per_rank != 2))
               if on]
    if ignored:  # the split is the straight solver's over topological cuts, bounded by --memory_per_worker only
        split = "a balanced loop split" if args.schedule in LOOP_SCHEDULES else "a V balanced by rank sums (2 stages per worker)"
        raise ConfigError(f"--schedule {args.schedule} plans {split}; {', '.join(ignored)} do not apply to it: "
                          "drop them (bound memory with --memory_per_worker)")
    speeds = tuple(args.worker_speeds) if args.worker_speeds else None
    m = args.microbatches or workers
    if args.schedule == "zbv":
        plan = v_plan(graph, workers, speeds, args.memory_per_worker, footprint)
        print(f"ZBV: {plan.num_stages} stages on {workers} workers in a V (worker r holds stages r and "
              f"{plan.num_stages - 1}-r)")
    else:
        plan = loop_plan(graph, workers, args.stages_per_rank, speeds, args.memory_per_worker, footprint, args.schedule)
        name = "Interleaved 1F1B" if args.schedule == "interleaved" else "Interleaved zero bubble"
        print(f"{name}: {plan.num_stages} stages on {workers} workers in a loop (stage k on worker k % {workers})")
    print(plan.table())
    # The plan's times are the profile's, for one minibatch at the profiled batch size (the table's "time per
    # minibatch" is the largest of these sums): "per microbatch" said otherwise.
    batch = graph.metadata.get("batch_size")
    per = f"ms per minibatch of {batch} samples (the profile's)" if isinstance(batch, int) else "ms per profiled minibatch"
    for rank in range(workers):
        held = plan.stages_of_rank(rank)
        print(f"worker {rank}: stages {','.join(map(str, held))}, compute "
              f"{sum(plan.stages[k].compute_s for k in held) * 1e3:.3f} {per}")
    if args.schedule == "interleaved":
        v = args.stages_per_rank
        print(f"analytic bubble at m={m}: {(workers - 1) / (v * m + workers - 1):.1%} (1F1B: {(workers - 1) / (m + workers - 1):.1%}); "
              f"run it with --schedule interleaved --plan plan.json (m a multiple of {workers})")
    else:  # zbinterleaved, zbv: what m they take is their builders' rule (interleaved.world_refusal)
        rounds = " (m in equal rounds of about the workers)" if args.schedule == "zbinterleaved" else ""
        print(f"run it with --schedule {args.schedule} --plan plan.json{rounds}")
    out = _output_directory(args)
    if out is not None:
        print(f"wrote {write_plan(plan, out / 'plan.json')}")
    return 0


def _output_directory(args: Any, create: bool = True) -> Optional[Path]:
    """-o checked (a file there, or above it, is a ConfigError naming it) and created (`create`); None without -o."""
    from model_parallel.errors import ConfigError
    from model_parallel.fileio import check_output_path

    if not args.output_directory:
        return None
    out = check_output_path(args.output_directory, ConfigError, "-o", directory=True)
    if create:
        out.mkdir(parents=True, exist_ok=True)
    return out


def _memory_model(args: Any, metadata: Any) -> tuple[str, Any]:
    """`--memory_model` and the footprint the flags describe (`optimizer/memory.py`)."""
    from model_parallel.errors import ConfigError
    from model_parallel.optimizer.memory import Footprint

    flags = {"--optimizer": args.optimizer, "--schedule": args.schedule, "--microbatches": args.microbatches,
             "--microbatch_size": args.microbatch_size}
    given = [flag for flag, value in flags.items() if value is not None]
    if args.memory_per_worker is not None and args.memory_model not in (None, "footprint"):
        raise ConfigError(f"--memory_per_worker prices the footprint; drop --memory_model {args.memory_model} "
                          "(or use -s with --use_memory_constraint for the legacy estimates)")
    model = args.memory_model or ("footprint" if given or args.memory_per_worker is not None else "pipedream")
    if model != "footprint":
        if given:
            raise ConfigError(f"{', '.join(given)} describe the footprint memory model; drop --memory_model {model} "
                             "or use --memory_model footprint")
        return model, None
    scale = 1.0
    if args.microbatch_size is not None:
        profiled = metadata.get("batch_size") if hasattr(metadata, "get") else None
        if not isinstance(profiled, int) or isinstance(profiled, bool) or profiled < 1 or args.microbatch_size < 1:
            raise ConfigError(f"--microbatch_size {args.microbatch_size} needs the graph's metadata batch_size (found "
                             f"{profiled!r}) and a size >= 1; profile with a batch size, or leave --microbatch_size out")
        scale = args.microbatch_size / profiled
    return model, Footprint(optimizer=args.optimizer or "sgd_momentum", schedule=args.schedule or SCHEDULE_NAMES[0],
                            microbatches=args.microbatches, activation_scale=scale)


def _speedup(before: float, after: float) -> object:
    """`before / after`; a profile whose times are all zero has no speedup to report."""
    if after > 0:
        return before / after
    return "n/a (all times are zero)" if before == 0 else math.inf

