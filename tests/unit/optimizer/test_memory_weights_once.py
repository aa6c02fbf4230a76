"""The footprint prices a weight once: a layer-by-layer profile's get_attr nodes (the weight's bytes as
their output, no `saved_bytes`) are parameters, never stashed activations (optimizer/memory.py)."""
from __future__ import annotations

import pytest

from model_parallel.errors import InfeasibleError
from model_parallel.graph.core import Graph, LayerSpec, Node
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.contiguous import even_stages
from model_parallel.optimizer.memory import Footprint, plan_footprint, stash_bytes
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.workload import preprocess

W = 4_000_000.0  # bytes of each weight
A = 1_000.0  # bytes of each layer's output


def layer_by_layer_chain(layers: int = 4) -> Graph:
    """x -> linear(x, w0) -> linear(., w1) ...: each weight a get_attr node whose output is the weight
    itself (activation_size = W, parameter_size = W), nothing profiled as saved (saved_bytes None)."""
    nodes = [Node("x", "Input0", activation_size=A, layer=LayerSpec("placeholder", "x"))]
    edges = []
    last = "x"
    for i in range(layers):
        nodes.append(Node(f"w{i}", "get_attr", activation_size=W, parameter_size=W,
                          layer=LayerSpec("get_attr", f"layers.{i}.weight", parameters=(f"layers.{i}.weight",))))
        nodes.append(Node(f"linear{i}", "linear", forward_ms=1.0, activation_size=A,
                          layer=LayerSpec("call_function", "torch.nn.functional.linear",
                                          args=({"node": last}, {"node": f"w{i}"}))))
        edges += [(last, f"linear{i}"), (f"w{i}", f"linear{i}")]
        last = f"linear{i}"
    return Graph(nodes=tuple(nodes), edges=tuple(edges), metadata={"outputs": {"node": last}})


def test_a_weight_read_by_get_attr_is_priced_once_as_parameters():
    graph = layer_by_layer_chain()
    assert graph["w0"].stash_bytes == 0.0 and graph["linear0"].stash_bytes == A
    assert preprocess(graph, "footprint").activation == (0.0, A) * 4  # the search's per-node held bytes
    plan = even_stages(graph, 2)
    # Two layers a stage (the one sent kept once); stage 1 also holds what it received. AdamW: W (2 + 2)
    # per weight, held once.
    assert stash_bytes(graph, plan.stage_of, 2) == [2 * A, A + 2 * A]
    parts = plan_footprint(graph, plan, Footprint("adamw", "1f1b", 4))
    assert [p["parameters"] for p in parts] == [2 * W, 2 * W]
    assert [p["in_flight"] for p in parts] == [2.0, 1.0]
    assert parts[0]["total"] == 4 * 2 * W + 2 * 2 * A
    assert parts[1]["total"] == 4 * 2 * W + 1 * 3 * A


def test_the_memory_constraint_fits_where_the_weights_fit():
    graph = layer_by_layer_chain()
    footprint = Footprint("adamw", "1f1b", 4)
    need = 4 * 2 * W + 2 * 2 * A  # stage 0 above: weights counted once, 2 microbatches in flight
    plan = even_stages(graph, 2, memory_per_worker=need, footprint=footprint)
    assert [len(s.node_ids) for s in plan.stages] == [5, 4]
    options = PartitionOptions(straight_pipeline=True, cuts="topological", use_memory_constraint=True,
                               memory_model="footprint", footprint=footprint)
    fitted = partition(graph, Hierarchy.from_lists([2], memory_bytes=need), options)
    assert max(s.memory_bytes for s in fitted.stages) <= need
    # Counting each weight again as a stash of 2 microbatches would need 16 MB more: refused below `need`.
    with pytest.raises(InfeasibleError, match=r"the smallest that fits is 0\.032 GB \(32004000 bytes\)"):
        even_stages(graph, 2, memory_per_worker=need - 1, footprint=footprint)


def test_the_rebalancers_memory_solver_never_plans_past_the_cap():
    from model_parallel.coordinator.solver import default_solver, memory_solver
    from model_parallel.errors import PlanError

    graph = layer_by_layer_chain()
    footprint = Footprint("adamw", "1f1b", 4)
    cap = 4 * 2 * W + 2 * 2 * A  # two weights a worker
    # A worker 3x faster would take three layers: 12 W of AdamW state, over the cap.
    free = default_solver(graph, [0, 1], [3.0, 1.0])
    assert max(p["parameters"] for p in plan_footprint(graph, free, footprint)) == 3 * W
    guarded = memory_solver(cap, footprint)(graph, [0, 1], [3.0, 1.0])
    assert all(p["total"] <= cap for p in plan_footprint(graph, guarded, footprint))
    with pytest.raises(PlanError, match="no re-plan on 2 worker\\(s\\) fits their memory"):
        memory_solver(cap / 2, footprint)(graph, [0, 1], [1.0, 1.0])


def test_the_optimizer_command_line_takes_memory_per_worker(tmp_path, capsys):
    from model_parallel.graph.io import save_graph
    from model_parallel.optimizer.optimizer_graph_hierarchical import main

    path = save_graph(layer_by_layer_chain(), tmp_path / "graph.json")
    cap = 4 * 2 * W + 2 * 2 * A
    flags = ["-f", str(path), "-n", "2", "--straight_pipeline", "--cuts", "topological", "--optimizer", "adamw",
             "--microbatches", "4"]
    assert main([*flags, "--memory_per_worker", str(cap)]) == 0
    assert "Total number of stages: 2" in capsys.readouterr().out
    with pytest.raises(InfeasibleError, match="no partition fits"):
        main([*flags, "--memory_per_worker", str(cap - 1)])


def test_the_coordinators_memory_per_worker_checks_the_starting_plan_and_every_plan_it_issues():
    from model_parallel.cli.coordinator import _memory_limit
    from model_parallel.coordinator.server import Coordinator
    from model_parallel.errors import InfeasibleError
    from model_parallel.graph.plan import Plan, StagePlan

    graph = layer_by_layer_chain()
    plan = even_stages(graph, 2)
    served = {"optimizer": "adamw", "num_microbatches": 4, "batch_size": 4}
    cap = 4 * 2 * W + 2 * 2 * A
    with pytest.raises(InfeasibleError, match=r"the starting plan puts a predicted .* GB on stage 0 .*over memory_per_worker"):
        Coordinator(graph, plan, b"t" * 32, memory=_memory_limit(cap - 1, served, graph))
    coordinator = Coordinator(graph, plan, b"t" * 32, memory=_memory_limit(cap, served, graph))
    # Its own re-plans fit (the memory solver) ...
    replan = coordinator.rebalancer.state.solver(graph, [0, 1], [3.0, 1.0])
    assert all(p["total"] <= cap for p in plan_footprint(graph, replan, Footprint("adamw", "1f1b", 4)))
    # ... and a plan from elsewhere (ctl set-plan, scale) that does not is never issued.
    order = list(graph.topological_order)
    lopsided = Plan((StagePlan(0, tuple(order[:-2]), ranks=(0,)), StagePlan(1, tuple(order[-2:]), ranks=(1,))))
    sent = []
    with pytest.raises(InfeasibleError, match=r"plan v1 puts a predicted .* GB on stage 0"):
        coordinator.rebalancer.issue(lopsided, "test", 0, lambda rank, command: sent.append(command) or True, False)
    assert sent == [] and coordinator.rebalancer.pending is None


def test_zero_bubble_prices_microbatches_until_their_w_with_the_gradients_kept_for_it():
    # Under ZB-H1 each of p = 2 stages holds min(p, m) = 2 microbatches (the last stage too: it holds its W's
    # back), each keeping what autograd saved plus the gradient at every node that uses a weight (a linear's
    # output, A bytes), which the search prices alike.
    graph = layer_by_layer_chain()
    plan = even_stages(graph, 2)
    one, zero = (plan_footprint(graph, plan, Footprint("adamw", name, 4)) for name in ("1f1b", "zbh1"))
    assert [p["in_flight"] for p in one] == [2.0, 1.0] and [p["in_flight"] for p in zero] == [2.0, 2.0]
    assert zero[0]["activations"] == 2 * (2 * A + 2 * A)
    assert zero[1]["activations"] == 2 * (3 * A + 2 * A)
    assert preprocess(graph, "footprint", zero_bubble=True).activation == (0.0, 2 * A) * 4
    assert zero[0]["total"] - one[0]["total"] == 2 * 2 * A
