"""The partition optimizer: PipeDream's test vectors, plan shape, options, errors and the command line."""
from __future__ import annotations

import json
import math
import random
import sys

import pytest

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.io import load_graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import read_plan
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.costs import predict_stage_times
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import choose_states, partition
from model_parallel.optimizer.search import searched_partition
from model_parallel.optimizer.solve import solve
from model_parallel.optimizer.states import preprocess
from model_parallel.optimizer.tuning import Tuning


# FORMATS.md: PipeDream's own optimizer on the reference profiles (profile, -n, -b, flags, seconds).
VECTORS = [
    ("vgg16", [4], None, {}, 0.205520896),
    ("vgg16", [16], None, {}, 0.05652976738461538),
    ("vgg16", [4], None, {"straight_pipeline": True}, 0.411041792),
    ("vgg16", [4, 4], [40e9, 1.25e9], {}, 0.06603039533333334),
    ("resnet50", [4], None, {}, 0.16288092399999993),
    ("resnet50", [16], None, {}, 0.04780134530612244),
    ("resnet50", [4], None, {"straight_pipeline": True}, 0.25814899999999996),
    ("resnet50", [4, 4], [40e9, 1.25e9], {}, 0.04320846919999996),
    ("gnmt", [4], None, {}, 0.025868000000000016),
    ("vgg16", [8], None, {"use_memory_constraint": True, "memory": 2e9}, 0.326192577),
    ("resnet50", [8], None, {"use_fewer_machines": True}, 0.09201227199999996),
]


def _solve(reference_profiles, name, machines, bandwidths, flags, cuts="antichain", solver=partition, **options):
    flags = dict(flags)
    memory = flags.pop("memory", 16e9)
    graph = load_graph(reference_profiles / f"{name}.graph.txt")
    hierarchy = Hierarchy.from_lists(machines, bandwidths, memory)
    return graph, solver(graph, hierarchy, PartitionOptions(activation_compression_ratio=1.0, cuts=cuts, **flags, **options))


@pytest.mark.parametrize("name,machines,bandwidths,flags,expected", VECTORS)
def test_reproduces_pipedream_vectors(reference_profiles, name, machines, bandwidths, flags, expected):
    graph, plan = _solve(reference_profiles, name, machines, bandwidths, flags)
    assert plan.time_per_minibatch_s == pytest.approx(expected, rel=1e-12)
    assert plan.num_ranks <= math.prod(machines)
    if not flags.get("use_fewer_machines"):
        assert plan.num_ranks == math.prod(machines)
    # auto picks PipeDream's state space for these small profiles
    _, auto = _solve(reference_profiles, name, machines, bandwidths, flags, cuts="auto")
    assert auto.time_per_minibatch_s == plan.time_per_minibatch_s


@pytest.mark.parametrize("name,machines,bandwidths,flags,expected", [v for v in VECTORS if len(v[1]) > 1])
def test_bounded_pipedream_dp_reproduces_the_hierarchical_vectors(reference_profiles, name, machines, bandwidths, flags, expected):
    """auto bounds PipeDream's DP on hierarchies above a work threshold; forced on, the vectors still match."""
    _, auto = _solve(reference_profiles, name, machines, bandwidths, flags, cuts="auto", solver=searched_partition,
                     tuning=Tuning(prune_min_work=0.0))
    assert auto.time_per_minibatch_s == pytest.approx(expected, rel=1e-12)
    _, reference = _solve(reference_profiles, name, machines, bandwidths, flags)
    assert [s.node_ids for s in auto.stages] == [s.node_ids for s in reference.stages]


def test_plan_covers_every_node_in_dependency_order(reference_profiles):
    graph, plan = _solve(reference_profiles, "gnmt", [4], None, {})
    stage_of = plan.stage_of
    assert set(stage_of) == {n.node_id for n in graph.nodes}
    for node in graph.nodes:
        if node.is_input:
            assert stage_of[node.node_id] == 0
    for src, dst in graph.edges:
        assert stage_of[src] <= stage_of[dst], (src, dst)
    order = {n: i for i, n in enumerate(graph.topological_order)}
    for stage in plan.stages:
        positions = [order[n] for n in stage.node_ids]
        assert positions == sorted(positions)
    ranks = [r for s in plan.stages for r in s.ranks]
    assert ranks == list(range(plan.num_ranks))
    assert plan.single_machine_time_s == pytest.approx(graph.total_compute_ms / 1000.0)
    assert plan.optimizer_seconds > 0
    assert max(s.compute_s for s in plan.stages) > 0


def test_dropped_getitem_sink_joins_its_producer():
    nodes = (Node("x", "Input0"), Node("a", "Linear", 1, 1, 8.0), Node("b", "Linear", 1, 1, 8.0),
             Node("g", "__getitem__(0)", 0, 0, 4.0), Node("c", "Linear", 3, 3, 8.0))
    graph = Graph(nodes, (("x", "a"), ("a", "b"), ("b", "g"), ("b", "c")))
    plan = partition(graph, Hierarchy.from_lists([2]), PartitionOptions(straight_pipeline=True))
    assert plan.stage_of["g"] == plan.stage_of["b"]
    assert plan.stage_of["x"] == 0
    assert [s.node_ids for s in plan.stages] == [("x", "a", "b", "g"), ("c",)]


def test_options_are_validated():
    with pytest.raises(PlanError, match="memory_model must be one of"):
        PartitionOptions(memory_model="gpipe")
    with pytest.raises(PlanError, match="activation_compression_ratio must be a positive number"):
        PartitionOptions(activation_compression_ratio=0.0)
    with pytest.raises(PlanError, match="cannot leave workers idle"):
        PartitionOptions(worker_speeds=(1.0, 2.0), use_fewer_machines=True)
    with pytest.raises(PlanError, match="worker_speeds must be positive"):
        PartitionOptions(straight_pipeline=True, worker_speeds=(1.0, -1.0))
    with pytest.raises(PlanError, match="cuts must be one of"):
        PartitionOptions(cuts="greedy")


def test_errors_say_what_to_fix():
    graph = synthetic.chain(5, seed=1)
    with pytest.raises(PlanError, match="give one bandwidth per level"):
        Hierarchy.from_lists([2, 2], [1e9])
    with pytest.raises(InfeasibleError, match="more stages than nodes: a straight pipeline on 8 workers"):
        partition(graph, Hierarchy.from_lists([8]), PartitionOptions(straight_pipeline=True))
    options = PartitionOptions(straight_pipeline=True, use_memory_constraint=True, memory_model="1f1b")
    with pytest.raises(InfeasibleError, match=r"the smallest memory any plan fits in is about [0-9.e+]+ bytes") as info:
        partition(graph, Hierarchy.from_lists([2], memory_bytes=1.0), options)
    need = float(str(info.value).split("about ")[1].split(" bytes")[0])
    assert partition(graph, Hierarchy.from_lists([2], memory_bytes=need * 1.001), options).num_stages == 2
    with pytest.raises(InfeasibleError):
        partition(graph, Hierarchy.from_lists([2], memory_bytes=need * 0.99), options)
    with pytest.raises(PlanError, match="worker_speeds has 2 value"):
        partition(graph, Hierarchy.from_lists([3]), PartitionOptions(straight_pipeline=True, worker_speeds=(1.0, 1.0)))


def test_memory_model_1f1b_counts_in_flight_microbatches():
    graph = synthetic.chain(12, seed=3)
    free = partition(graph, Hierarchy.from_lists([4]), PartitionOptions(straight_pipeline=True, memory_model="1f1b"))
    # 1F1B: stage k of 4 keeps 4-k microbatches of (activations + weight versions).
    stage_bytes = [s.memory_bytes / (4 - k) for k, s in enumerate(free.stages)]
    assert all(b > 0 for b in stage_bytes)
    limit = sorted(s.memory_bytes for s in free.stages)[-1] * 0.9
    bound = partition(graph, Hierarchy.from_lists([4], memory_bytes=limit),
                      PartitionOptions(straight_pipeline=True, use_memory_constraint=True, memory_model="1f1b"))
    assert all(s.memory_bytes <= limit for s in bound.stages)
    assert bound.time_per_minibatch_s >= free.time_per_minibatch_s
    # PipeDream's estimate ignores the last stage's own microbatch, so it admits more.
    loose = partition(graph, Hierarchy.from_lists([4], memory_bytes=limit),
                      PartitionOptions(straight_pipeline=True, use_memory_constraint=True))
    assert loose.time_per_minibatch_s <= bound.time_per_minibatch_s


def test_worker_speeds_fast_path_for_the_rebalancer():
    graph = synthetic.random_dag(600, seed=5)
    speeds = (1.0, 1.0, 0.25, 1.0, 2.0, 1.0, 1.0, 1.0)
    plan = partition(graph, Hierarchy.from_lists([8]), PartitionOptions(straight_pipeline=True, worker_speeds=speeds))
    assert plan.num_stages == 8 and [s.ranks for s in plan.stages] == [(k,) for k in range(8)]
    assert plan.extra["cuts"] == "topological"
    predicted = predict_stage_times(graph, plan, speeds)
    assert max(predicted) == pytest.approx(plan.time_per_minibatch_s, rel=1e-9)
    # the slow worker gets less work than its neighbours, the fast one more
    compute = [s.compute_s for s in plan.stages]
    assert compute[2] < min(compute[1], compute[3]) and compute[4] > max(compute[3], compute[5])
    even = partition(graph, Hierarchy.from_lists([8]), PartitionOptions(straight_pipeline=True, worker_speeds=(1.0,) * 8))
    assert max(predict_stage_times(graph, even, speeds)) > plan.time_per_minibatch_s


def test_antichains_start_from_every_source():
    # Two non-Input sources: PipeDream starts its antichain walk from the first one only, so the cut
    # {a, b} (both sources, before c) was never a state and straight on 2 workers it could only do
    # [a | b c] (0.003 s). The walk now starts from a root before every source.
    nodes = (Node("a", "Embedding", 1, 0), Node("b", "Embedding", 1, 0), Node("c", "Linear", 1, 1))
    graph = Graph(nodes, (("a", "c"), ("b", "c")))
    options = dict(straight_pipeline=True)
    pipedream = partition(graph, Hierarchy.from_lists([2]), PartitionOptions(cuts="antichain", **options))
    extended = partition(graph, Hierarchy.from_lists([2]), PartitionOptions(cuts="all", **options))
    assert pipedream.time_per_minibatch_s == pytest.approx(0.002)
    assert extended.time_per_minibatch_s == pytest.approx(0.002)
    assert [s.node_ids for s in pipedream.stages] == [s.node_ids for s in extended.stages] == [("a", "b"), ("c",)]


def test_auto_beyond_pipedreams_dp_solves_exactly_with_bounds():
    graph = synthetic.branches(6, width=4, depth=3, seed=2)
    options = PartitionOptions(activation_compression_ratio=1.0, max_antichain_states=50)
    plan = searched_partition(graph, Hierarchy.from_lists([4, 2], [40e9, 1e9]), options)
    assert plan.extra["cuts"] == "bounded" and plan.extra["exact"] is True
    assert plan.extra["num_states"] < plan.extra["states_considered"]
    assert set(plan.stage_of) == {n.node_id for n in graph.nodes}
    for src, dst in graph.edges:
        assert plan.stage_of[src] <= plan.stage_of[dst]
    coarse = partition(graph, Hierarchy.from_lists([4, 2], [40e9, 1e9]),
                       PartitionOptions(activation_compression_ratio=1.0, cuts="topological", max_cut_points=10))
    assert coarse.extra["cuts"] == "topological-coarse" and coarse.extra["num_states"] <= 11
    assert coarse.extra["exact"] is False
    assert plan.time_per_minibatch_s <= coarse.time_per_minibatch_s


@pytest.mark.slow
def test_auto_says_when_it_cannot_prove_optimality(caplog):
    graph = synthetic.branches(6, width=4, depth=3, seed=2)
    options = PartitionOptions(activation_compression_ratio=1.0, max_antichain_states=10, tuning=Tuning(enumeration_limit=20))
    plan = searched_partition(graph, Hierarchy.from_lists([4, 2], [40e9, 1e9]), options)
    assert plan.extra["cuts"].startswith("topological") or plan.extra["cuts"] == "flattened"
    assert plan.extra["exact"] is False
    assert 0 < plan.extra["lower_bound_s"] <= plan.time_per_minibatch_s
    assert "not proven optimal" in caplog.text
    for src, dst in graph.edges:
        assert plan.stage_of[src] <= plan.stage_of[dst]


@pytest.mark.parametrize("machines, speeds", [([4], (2.0, 3.0, 2.0, 2.5)), ([2, 2], (2.0, 2.0, 3.0, 2.0))])
def test_lower_bound_of_an_unproven_plan_counts_faster_workers(machines, speeds):
    # Workers faster than profiled do more than their share: total compute / workers is no bound then.
    graph = synthetic.branches(6, width=4, depth=3, seed=2)
    options = PartitionOptions(straight_pipeline=len(machines) == 1, worker_speeds=speeds)
    plan = partition(graph, Hierarchy.from_lists(machines, [1e9] * len(machines)), options)
    assert plan.extra["exact"] is False
    assert plan.extra["lower_bound_s"] == pytest.approx(plan.single_machine_time_s / sum(speeds))
    assert 0 < plan.extra["lower_bound_s"] <= plan.time_per_minibatch_s


def test_three_level_hierarchy_uses_every_worker():
    graph = synthetic.residual(8, seed=4)
    plan = partition(graph, Hierarchy.from_lists([2, 2, 2], [40e9, 10e9, 1e9]), PartitionOptions(activation_compression_ratio=1.0))
    assert plan.num_ranks == 8 and plan.num_machines == (2, 2, 2)
    assert plan.time_per_minibatch_s <= plan.single_machine_time_s


def test_cli_writes_partitioned_graph_plan_and_picture(reference_profiles, tmp_path, capsys):
    from model_parallel.optimizer.optimizer_graph_hierarchical import main

    out = tmp_path / "out"
    code = main(["-f", str(reference_profiles / "vgg16.graph.txt"), "-n", "4", "4", "-b", "40e9", "1.25e9",
                 "--activation_compression_ratio", "1", "-o", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "Time per stage in pipeline: 0.0660303953333333" in text
    assert "time per minibatch (slowest stage)" in text
    partitioned = load_graph(out / "gpus=16.txt")
    assert partitioned.is_partitioned and partitioned.num_stages == 4
    plan = read_plan(out / "plan.json")
    assert plan.time_per_minibatch_s == pytest.approx(0.06603039533333334, rel=1e-12)
    assert {n.node_id: n.stage_id for n in partitioned.nodes} == plan.stage_of
    data = json.loads((out / "plan.json").read_text())
    assert {"time_per_minibatch_s", "single_machine_time_s", "stages"} <= set(data)
    assert "optimizer_seconds" not in data  # wall time would make two runs' plan.json differ
    assert (out / "gpus=16.svg").exists() or (out / "gpus=16.dot").exists()
    assert not (out / "gpus=16.json").exists()  # plain graph.txt input: no layer sidecar to keep


def test_cli_reports_no_speedup_for_a_profile_of_zero_times(reference_profiles, capsys):
    from model_parallel.optimizer.optimizer_graph_hierarchical import main

    assert main(["-f", str(reference_profiles / "toy_dag.graph.txt"), "-n", "2", "--activation_compression_ratio", "1"]) == 0
    text = capsys.readouterr().out
    assert "Throughput increase (compared to single machine): n/a (all times are zero)" in text
    assert "inf" not in text


def test_stage_communication_uses_the_bandwidth_of_the_level_that_splits_it():
    from model_parallel.optimizer.costs import stage_costs
    from model_parallel.optimizer.solve import solve
    from model_parallel.optimizer.antichains import antichain_states
    from model_parallel.optimizer.states import preprocess

    graph = synthetic.chain(12, seed=4)
    hierarchy = Hierarchy.from_lists([2, 2], [40e9, 2e9])
    options = PartitionOptions(activation_compression_ratio=1.0)
    solution = solve(antichain_states(preprocess(graph)), hierarchy, options)
    assert 1 in solution.boundary_levels, "the plan should cross the slow outer level"
    plan = partition(graph, hierarchy, options)
    costs = stage_costs(graph, plan.stage_of, plan.num_stages)
    for index, level in enumerate(solution.boundary_levels):
        replicas = solution.level_replicas[index][level]
        bandwidth = hierarchy.levels[level].bandwidth
        expected = 2.0 * costs[index].output_bytes / (bandwidth * replicas)
        assert plan.stages[index].communication_s >= expected * (1 - 1e-12)
        if level == 1:  # the slow link is the larger term here, and the old innermost-only figure missed it
            assert plan.stages[index].communication_s > 2.0 * costs[index].output_bytes / (40e9 * replicas)


def test_forcing_pipedreams_states_on_a_huge_graph_is_a_clear_error(monkeypatch):
    from model_parallel.optimizer import antichains as antichains_module

    monkeypatch.setattr(antichains_module, "MAX_DP_STATES", 30)
    graph = synthetic.branches(6, width=4, depth=3, seed=2)
    with pytest.raises(InfeasibleError, match=r"antichain states: its DP would need .* use cuts='auto'"):
        partition(graph, Hierarchy.from_lists([4]), PartitionOptions(cuts="antichain"))
    assert searched_partition(graph, Hierarchy.from_lists([4]), PartitionOptions()).extra["exact"] is True


@pytest.mark.slow
def test_multi_level_plans_place_replicas_where_the_cost_model_put_them():
    # Ranks number workers innermost first (-n 4 2: ranks 0-3 in server 0). A stage replicated r_l times at
    # level l must span exactly r_l machines of that level, so its all-reduce and activations use the links
    # the DP charged them to; every worker is used at most once.
    rng = random.Random(7)
    for case in range(12):
        graph = synthetic.branches(rng.randint(2, 4), width=3, depth=2, seed=case)
        machines = rng.choice(([4, 2], [2, 4], [2, 2, 2], [3, 2]))
        hierarchy = Hierarchy.from_lists(machines, [40e9] * len(machines))  # fast outer links: replicas span servers
        options = PartitionOptions(activation_compression_ratio=1.0, use_fewer_machines=case % 3 == 0, cuts="antichain")
        plan = partition(graph, hierarchy, options)
        solution = solve(choose_states(preprocess(graph), hierarchy, options), hierarchy, options)
        assert [len(s.ranks) for s in plan.stages] == [s.num_replicas for s in plan.stages]
        used = [r for s in plan.stages for r in s.ranks]
        assert len(used) == len(set(used)) and all(0 <= r < hierarchy.num_workers for r in used)
        for stage, replicas in zip(plan.stages, solution.level_replicas):
            within = 1
            for level, count in zip(hierarchy.levels, replicas):
                positions = {(rank // within) % level.num_machines for rank in stage.ranks}
                assert len(positions) == count, (machines, stage.ranks, replicas)
                within *= level.num_machines


def test_replicas_across_servers_sit_on_the_same_gpus_of_each():
    from model_parallel.optimizer.solve import hierarchy_ranks

    hierarchy = Hierarchy.from_lists([4, 2], [40e9, 1e9])
    assert hierarchy_ranks(hierarchy, (1, 2), (2, 0)) == (2, 6)
    assert hierarchy_ranks(hierarchy, (2, 2), (0, 0)) == (0, 1, 4, 5)
    assert hierarchy_ranks(Hierarchy.from_lists([4]), (3,), (1,)) == (1, 2, 3)


def test_speed_profiles_are_solved_once_each():
    from model_parallel.optimizer.solve import profile_counts as _profile_counts

    two_by_two = Hierarchy.from_lists([2, 2])
    assert _profile_counts([1.0, 1.0, 1.0, 0.5], two_by_two) == [2, 1]  # server 0, server 1 = min of both
    assert _profile_counts([1.0] * 4, two_by_two) == [1, 1]


def test_speeds_differing_everywhere_fall_back_to_the_slowest_profile(caplog):
    # Measured speeds differ on every worker: solving each window's profile at every level would blow
    # the budget, so each outer level plans with the slowest worker of each position, and says so.
    graph = synthetic.residual(5, seed=2)
    hierarchy = Hierarchy.from_lists([2, 2, 2], [40e9, 10e9, 1e9])
    rng = random.Random(4)
    speeds = tuple(rng.uniform(0.5, 1.5) for _ in range(8))
    plan = partition(graph, hierarchy, PartitionOptions(worker_speeds=speeds, cuts="topological", tuning=Tuning(work_budget=1.0)))
    assert plan.extra["worker_speeds_simplified"] is True
    assert "too many to solve each" in caplog.text
    slowest = [min(speeds[position::2]) for position in range(2)]
    uniform = partition(graph, hierarchy, PartitionOptions(worker_speeds=tuple(slowest * 4), cuts="topological"))
    assert plan.time_per_minibatch_s == uniform.time_per_minibatch_s
    assert "worker_speeds_simplified" not in uniform.extra
