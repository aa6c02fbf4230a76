"""Partition optimizer benchmark: solve time and predicted time per minibatch, plus the optimality gap.

    python bench/optimizer.py            # full run (a few minutes on 2 shared cores)
    python bench/optimizer.py --quick    # reference profiles and small cases, well under a minute

Profiles: PipeDream's reference profiles (vgg16, resnet50, gnmt; FORMATS.md), torchvision
resnet50/resnet101 traced at 32x32 and inception_v3 at 96x96 with synthetic costs (compute
proportional to activation bytes, `optimizer.synthetic.traced_costs`), and a generated heavy-branching
graph (`synthetic.branches`, inception-like, ~1000 nodes, 9311 antichain states) and a wider one
(1551 nodes, 197,953 states: PipeDream's inception_v3 has 221,564); the full run also solves the same
generator's other seeds (2-6, 979-996 nodes) on `-n 8 16 8` alone, to show how general the 1000-node
result is. Hierarchies: `-n 4`,
`-n 4 4`, `-n 8 2` (bandwidths 40e9 1.25e9) and `-n 8 16 8` (40e9 10e9 1.25e9), all with
`--activation_compression_ratio 1`, default `cuts="auto"`: PipeDream's antichain DP when affordable
("antichain"), else the exact bounded solve over antichains and topological prefixes ("bounded"; only the DP cells a
plan within the bound can use where that pays, `optimizer/search/cells.py`), at the best plan's time or below
it, else the best plan found, `exact` false: over topological cut points ("topological*"), on
hierarchies from one pass over the cuts for plans with unreplicated outermost stages ("flattened",
`optimizer/search/flattened.py`), or the bounded solve's below the best time ("bounded"). PipeDream's own
optimizer needs 33-100 s (resnet50) and 136-462 s (resnet101) on the two-level cases.

Each row solves with the opt-in search (`search.searched_partition`) and with the core alone (`partition`: PipeDream's DP when affordable,
else the best prefix plan): `search_gain` is how much slower that plan is than the search's.

Optimality gap: on seeded small DAGs the DP ("antichain" and "all" cuts) is compared with exhaustive
search (`optimizer.brute_force`), and on medium graphs the bounded solve with the unbounded DP over
the same states; gaps are max relative differences (0.0 = exact).

Unproven plans ("exact" false) carry `lower_bound_s`, a time no plan beats (the relaxation of
`optimizer/search/relaxation.py` when it fits, else perfect balance `balance_bound_s`), and `max_gap`: the
plan is at most that fraction above the optimum.

Real models (`--real` alone, and in the full run): torchvision efficientnet_b0 and resnet50 (torch.fx),
timm efficientnet_b0 (torch.export: a node per weight read and per BatchNorm counter update, 649 nodes),
timm ViT-tiny and MLP-Mixer at 32x32, and tiny GPT-2 and Llama (torch.export: mask and rotary side
branches), random weights, synthetic costs, on `-n 4` and `-n 4 2`; `--real` writes
`bench/results/optimizer_real.json`.

Every torchvision classifier and the Hugging Face / timm cases of tests/support/hf_zoo.py at both sizes
(`--zoo`, `--zoo --quick` for a subset; bench/optimizer_zoo.py): the time of `partition` against the bar of
1 s on one level and 3 s on two; writes `bench/results/optimizer_zoo.json`.

Profiles on disk (`--profiles DIR`): every `DIR/*.graph.txt` with default options on `-n 4`, `4 2`, `4 4`
and `8 2`, e.g. the in-situ profiles of `tests/fixtures/make_real_profiles.py DIR` (the models of
bench/models.py and five torchvision classifiers); writes `bench/results/optimizer_profiles.json`.

Writes `bench/results/optimizer.json` atomically: {"rows": [{profile, num_machines, seconds,
time_per_minibatch_s, cuts, num_states, num_nodes, lower_bound_s, max_gap}], "optimality": {...},
settings}. Prints a table.
Timings on a shared machine are noisy; `seconds` is wall time of one `partition` call, `cpu_seconds`
its process CPU time (closer to what an idle machine would show when the cores are oversubscribed).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from model_parallel.fileio import atomic_write_json  # noqa: E402
from model_parallel.graph.core import Graph  # noqa: E402
from model_parallel.graph.io import load_graph  # noqa: E402
from model_parallel.graph.hierarchy import Hierarchy  # noqa: E402
from model_parallel.optimizer import synthetic  # noqa: E402
from model_parallel.optimizer.brute_force import all_cuts, brute_force, chains_of  # noqa: E402
from model_parallel.optimizer.options import PartitionOptions  # noqa: E402
from model_parallel.optimizer.partition import partition  # noqa: E402
from model_parallel.optimizer.search import searched_partition  # noqa: E402
from model_parallel.optimizer.search.bounded import bounded_solve, cut_union  # noqa: E402
from model_parallel.optimizer.solve import solve  # noqa: E402
from model_parallel.optimizer.tuning import Tuning  # noqa: E402
from model_parallel.optimizer.antichains import antichain_states, enumerate_antichains  # noqa: E402
from model_parallel.optimizer.states import cut_states, preprocess, prefix_states  # noqa: E402

RESULTS = REPO / "bench" / "results" / "optimizer.json"
REAL_RESULTS = REPO / "bench" / "results" / "optimizer_real.json"
ZOO_RESULTS = REPO / "bench" / "results" / "optimizer_zoo.json"
REFERENCE = REPO / "tests" / "fixtures" / "reference_profiles"
HIERARCHIES = {
    "4": ([4], [1e9]),
    "4 4": ([4, 4], [40e9, 1.25e9]),
    "4 2": ([4, 2], [40e9, 1.25e9]),
    "8 2": ([8, 2], [40e9, 1.25e9]),
    "8 16 8": ([8, 16, 8], [40e9, 10e9, 1.25e9]),
}


def traced(name: str, size: int = 32, **kwargs: Any) -> Graph:
    """A torchvision model traced at size x size with synthetic costs (torch imported only here)."""
    import torch

    from model_parallel.compat import import_torchvision
    from model_parallel.profiler.trace import trace_model

    torch.set_num_threads(1)
    model = getattr(import_torchvision().models, name)(**kwargs)
    graph, _ = trace_model(model, (torch.randn(2, 3, size, size),))
    return synthetic.traced_costs(graph)


def profiles(quick: bool) -> list[tuple[str, Graph]]:
    found = []
    for name in ("vgg16", "resnet50", "gnmt"):
        path = REFERENCE / f"{name}.graph.txt"
        if path.exists():
            found.append((f"{name} (reference)", load_graph(path)))
    if quick:
        found.append(("branches 250 nodes", synthetic.branches(30, width=4, depth=3, seed=1)))
        return found
    for name in ("resnet50", "resnet101"):
        found.append((f"{name} (traced)", traced(name)))
    found.append(("inception_v3 (traced)", traced("inception_v3", 96, aux_logits=False, init_weights=False)))
    found.append(("branches 1000 nodes", synthetic.branches(110, width=4, depth=3, seed=1)))
    # As wide as PipeDream's inception_v3 (221,564 states, out of memory there): 197,953 antichain states.
    found.append(("wide branches 1551 nodes", synthetic.branches(95, width=6, depth=4, seed=1)))
    return found


def real_graph(name: str) -> Graph:
    """A model as the profiler records it (torch.fx for torchvision, torch.export for timm and Hugging
    Face: a node per weight read, shape reads, mask and rotary side branches), tiny configurations with
    random weights, synthetic costs."""
    import torch

    import model_parallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    image = (torch.randn(2, 3, 32, 32),)
    if name in ("efficientnet_b0", "resnet50"):
        model, inputs = getattr(model_parallel.import_torchvision().models, name)(num_classes=10), image
    elif name in ("timm efficientnet_b0", "vit_tiny", "mixer"):
        import timm

        timm_name = {"timm efficientnet_b0": "efficientnet_b0", "vit_tiny": "vit_tiny_patch16_224", "mixer": "mixer_s16_224"}[name]
        kwargs = {} if name.startswith("timm") else {"img_size": 32}
        model, inputs = timm.create_model(timm_name, pretrained=False, num_classes=10, **kwargs), image
    else:
        import transformers

        if name == "gpt2":
            config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
            model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
            model = transformers.LlamaForCausalLM(config)
        inputs = {"input_ids": torch.randint(0, 128, (2, 16))}
    graph, _ = model_parallel.trace_model(model, inputs)
    return synthetic.traced_costs(graph)


REAL_GRAPHS = ("efficientnet_b0", "timm efficientnet_b0", "resnet50", "vit_tiny", "mixer", "gpt2", "llama")


def real_graphs(names: Sequence[str] = REAL_GRAPHS) -> list[tuple[str, Graph]]:
    return [(f"{name} (real)", real_graph(name)) for name in names]


def other_seeds() -> list[tuple[str, Graph]]:
    """The 1000-node graph's generator with other seeds: graphs of the same kind and size."""
    found = []
    for seed in range(2, 7):
        graph = synthetic.branches(110, width=4, depth=3, seed=seed)
        found.append((f"branches {len(graph)} nodes, seed {seed}", graph))
    return found


def solve_rows(graphs: list[tuple[str, Graph]], hierarchies: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for profile, graph in graphs:
        for key in hierarchies:
            machines, bandwidths = HIERARCHIES[key]
            started, cpu = time.perf_counter(), time.process_time()
            plan = searched_partition(graph, Hierarchy.from_lists(machines, bandwidths), PartitionOptions(activation_compression_ratio=1.0))
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            # The core alone (no optimizer/search): PipeDream's DP when affordable, else the best prefix plan.
            started_core = time.perf_counter()
            core = partition(graph, Hierarchy.from_lists(machines, bandwidths), PartitionOptions(activation_compression_ratio=1.0))
            core_seconds = time.perf_counter() - started_core
            rows.append({
                "profile": profile, "num_machines": machines, "seconds": round(seconds, 4), "cpu_seconds": round(cpu, 4),
                "time_per_minibatch_s": plan.time_per_minibatch_s, "cuts": plan.extra["cuts"], "exact": plan.extra["exact"],
                "num_states": plan.extra["num_states"], "states_considered": plan.extra.get("states_considered"),
                "num_nodes": len(graph), "num_stages": plan.num_stages,
                # Unproven plans: a time no plan beats, and how far above it the plan is at most.
                "lower_bound_s": plan.extra.get("lower_bound_s"),
                "balance_bound_s": plan.single_machine_time_s / math.prod(machines),
                "max_gap": None if plan.extra["exact"] else plan.time_per_minibatch_s / plan.extra["lower_bound_s"] - 1,
                "core_time_per_minibatch_s": core.time_per_minibatch_s, "core_seconds": round(core_seconds, 4),
                "core_exact": core.extra["exact"], "search_gain": core.time_per_minibatch_s / plan.time_per_minibatch_s - 1,
            })
            gap = "" if plan.extra["exact"] else f"  <= {rows[-1]['max_gap']:.1%} above optimal"
            print(f"{profile:<24} -n {key:<7} {seconds:>8.3f} s {cpu:>7.3f} s  {plan.time_per_minibatch_s * 1e3:>10.4f} ms  "
                  f"{plan.extra['cuts']:<19} {'yes' if plan.extra['exact'] else 'no':<5} {plan.extra['num_states']:>5} states"
                  f"{'' if not plan.extra.get('states_considered') else ' of ' + str(plan.extra['states_considered']):<10}"
                  f"  {plan.num_stages:>3} stages{gap}  core {rows[-1]['search_gain']:+.2%} in {core_seconds:.3f} s", flush=True)
    return rows


def optimality(num_cases: int) -> dict[str, Any]:
    """Max relative gap between the DP and exhaustive search on seeded small graphs (one level)."""
    gaps = {"antichain": 0.0, "all": 0.0}
    improved = 0
    for seed in range(num_cases):
        rng = random.Random(seed)
        graph = [synthetic.chain(rng.randint(2, 8), seed=seed), synthetic.residual(rng.randint(1, 3), 2, seed=seed),
                 synthetic.branches(rng.randint(1, 2), width=3, depth=2, seed=seed),
                 synthetic.random_dag(rng.randint(3, 9), seed=seed, max_fan_in=3)][seed % 4]
        machines = rng.randint(1, 5)
        ratio = rng.choice([None, 1.0])
        straight = rng.random() < 0.3
        work = preprocess(graph)
        values = {}
        for cuts, family in (("antichain", chains_of(antichain_states(work))), ("all", all_cuts(work))):
            oracle, _ = brute_force(*family, machines, 1e9, ratio, straight)
            try:
                got = partition(graph, Hierarchy.from_lists([machines]),
                                PartitionOptions(cuts=cuts, straight_pipeline=straight, activation_compression_ratio=ratio)).time_per_minibatch_s
            except ValueError:
                got = math.inf
            values[cuts] = got
            if math.isfinite(oracle) and math.isfinite(got):
                gaps[cuts] = max(gaps[cuts], abs(got - oracle) / oracle)
            elif math.isfinite(oracle) != math.isfinite(got):
                gaps[cuts] = math.inf
        improved += values["all"] < values["antichain"] * (1 - 1e-9)
    return {"cases": num_cases, "max_relative_gap": gaps, "cases_where_all_cuts_beat_pipedream": improved}


def bounded_gap(num_cases: int) -> dict[str, Any]:
    """The bounded solve (bound from a coarse prefix plan) against the unbounded DP over the same
    states (antichains + prefixes), on medium branching graphs and two-level hierarchies; and the
    same bounded solve with every level over cells (`cells.py`, which auto uses only where it pays)."""
    gap, cells_gap, kept = 0.0, 0.0, []
    for seed in range(num_cases):
        graph = synthetic.branches(6 + seed % 5, width=4, depth=3, seed=seed)
        machines = [[4], [2, 2], [4, 2], [2, 2, 2]][seed % 4]
        hierarchy = Hierarchy.from_lists(machines, [40e9, 10e9, 1.25e9][: len(machines)])
        options = PartitionOptions(activation_compression_ratio=1.0)
        work = preprocess(graph)
        antichains = enumerate_antichains(work)
        union = cut_states(work, list(prefix_states(work).members) + antichains.downsets(), "bounded")
        full = solve(union, hierarchy, options).time_s
        bounded = bounded_solve(work, hierarchy, options, cut_union(work, antichains), solve(prefix_states(work, 10), hierarchy, options).time_s)
        if bounded is None:
            gap = math.inf
            continue
        gap = max(gap, abs(bounded.time_s - full) / full)
        kept.append(bounded.states.num_states / union.num_states)
        always = PartitionOptions(activation_compression_ratio=1.0, tuning=Tuning(cell_min_work=0.0, cell_gain=0.0))
        over_cells = bounded_solve(work, hierarchy, always, cut_union(work, antichains), solve(prefix_states(work, 10), hierarchy, options).time_s)
        cells_gap = max(cells_gap, math.inf if over_cells is None else abs(over_cells.time_s - full) / full)
    return {"cases": num_cases, "max_relative_gap": gap, "max_relative_gap_over_cells": cells_gap,
            "mean_fraction_of_states_kept": sum(kept) / max(len(kept), 1)}


def profile_rows(directory: Path, levels: Sequence[Sequence[int]] = ((4,), (4, 2), (4, 4), (8, 2))) -> list[dict[str, Any]]:
    """`partition` with default options (as `model_parallel.partition` is called) on every
    `directory/*.graph.txt`, e.g. the in-situ profiles `tests/fixtures/make_real_profiles.py` writes."""
    from model_parallel.graph.io import load_graph

    rows = []
    for path in sorted(directory.glob("*.graph.txt")):
        graph = load_graph(path, use_sidecar=False)
        for machines in levels:
            started, cpu = time.perf_counter(), time.process_time()
            plan = partition(graph, Hierarchy.from_lists(list(machines)))
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            rows.append({"profile": path.name.split(".")[0], "num_machines": list(machines), "seconds": round(seconds, 3),
                         "cpu_seconds": round(cpu, 3), "time_per_minibatch_s": plan.time_per_minibatch_s,
                         "cuts": plan.extra["cuts"], "exact": plan.extra["exact"], "lower_bound_s": plan.extra.get("lower_bound_s")})
            print(f"{rows[-1]['profile']:<14} -n {' '.join(map(str, machines)):<5} {seconds:>7.2f} s {cpu:>6.2f} s cpu  "
                  f"{plan.time_per_minibatch_s * 1e3:>9.4f} ms  {plan.extra['cuts']:<19} exact={plan.extra['exact']}", flush=True)
    return rows


def _machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "processor": platform.processor() or platform.machine(),
            "load_average": list(os.getloadavg())}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reference profiles, -n 4 and -n 4 4, 30 optimality cases")
    parser.add_argument("--real", action="store_true", help=f"only the real models ({', '.join(REAL_GRAPHS)}) on -n 4 and -n 4 2")
    parser.add_argument("--profiles", type=Path, default=None,
                        help="only the graph.txt profiles in this folder (default options) on -n 4, 4 2, 4 4, 8 2")
    parser.add_argument("--zoo", action="store_true",
                        help="only every torchvision classifier and the hf_zoo cases at both sizes on -n 4, 4 2, 2 2 "
                             "(bench/optimizer_zoo.py; with --quick a subset)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.zoo:
        from bench.optimizer_zoo import zoo

        output = args.output or ZOO_RESULTS
        atomic_write_json(output, {**zoo(args.quick), "machine": _machine()})
        print(f"wrote {output}")
        return 0
    if args.profiles is not None:
        output = args.output or REPO / "bench" / "results" / "optimizer_profiles.json"
        atomic_write_json(output, {"rows": profile_rows(args.profiles), "machine": _machine()})
        print(f"wrote {output}")
        return 0
    if args.real:
        print(f"{'profile':<24} {'hierarchy':<10} {'wall':>10} {'cpu':>9}  {'time/minibatch':>13}  {'cuts':<19} {'exact':<5} {'states':>5}")
        rows = solve_rows(real_graphs(), ["4", "4 2"])
        output = args.output or REAL_RESULTS
        atomic_write_json(output, {"rows": rows, "machine": _machine()})
        print(f"wrote {output}")
        return 0
    args.output = args.output or RESULTS
    hierarchies = ["4", "4 4"] if args.quick else list(HIERARCHIES)
    print(f"{'profile':<24} {'hierarchy':<10} {'wall':>10} {'cpu':>9}  {'time/minibatch':>13}  {'cuts':<19} {'exact':<5} {'states':>5}")
    rows = solve_rows(profiles(args.quick), hierarchies)
    if not args.quick:
        rows += solve_rows(other_seeds(), ["8 16 8"])
        rows += solve_rows(real_graphs(), ["4", "4 2"])
    gap = optimality(30 if args.quick else 120)
    print(f"optimality vs brute force on {gap['cases']} small DAGs: max relative gap "
          f"{gap['max_relative_gap']}; all-cuts beat PipeDream's states in {gap['cases_where_all_cuts_beat_pipedream']} case(s)")
    bounded = bounded_gap(4 if args.quick else 20)
    print(f"bounded solve vs unbounded DP over the same states on {bounded['cases']} branching graphs: max relative gap "
          f"{bounded['max_relative_gap']} ({bounded['max_relative_gap_over_cells']} over cells); "
          f"states kept {bounded['mean_fraction_of_states_kept']:.1%} on average")
    atomic_write_json(args.output, {
        "rows": rows, "optimality": gap, "bounded_vs_full_dp": bounded, "quick": args.quick,
        "machine": _machine(),
    })
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
