"""The footprint memory model (optimizer/memory.py): formulas, solvers against brute force, the plan's
numbers, the command line, and the exact bytes a stage's module and optimizer hold after one step."""
from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from model_parallel.errors import InfeasibleError, PlanError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.brute_force import all_cuts, brute_force, chains_of
from model_parallel.optimizer.memory import Footprint, footprint_parts, multipliers, optimizer_kind, stage_bytes
from model_parallel.optimizer.optimizer_graph_hierarchical import main as optimizer_main
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.states import preprocess, prefix_states
from model_parallel.runtime.observe.memory_probe import state_bytes


def test_multipliers_by_optimizer_and_schedule():
    # 4 ranks, stage after 1 rank, unreplicated: 1F1B holds p - k = 3 microbatches (m = 8 does not cap).
    assert multipliers(Footprint("sgd", "1f1b", 8), 4, 1, 1) == (3.0, 2.0)
    assert multipliers(Footprint("sgd_momentum", "1f1b", 8), 4, 1, 1) == (3.0, 3.0)
    assert multipliers(Footprint("adamw", "1f1b", 8), 4, 1, 1) == (3.0, 4.0)
    assert multipliers(Footprint("adam", "1f1b", 2), 4, 1, 1) == (2.0, 4.0)  # m = 2 caps the warm-up
    assert multipliers(Footprint("sgd", "gpipe", 8), 4, 1, 1) == (8.0, 2.0)  # GPipe: all m before any backward
    assert multipliers(Footprint("sgd", "pipedream", 8), 4, 1, 1) == (3.0, 5.0)  # + 3 stashed weight versions
    assert multipliers(Footprint("sgd", "1f1b", 8, activation_scale=0.25), 4, 3, 1) == (0.25, 2.0)
    # The legacy estimates are unchanged: f (A + W).
    assert multipliers("pipedream", 4, 1, 1) == (2, 2) and multipliers("1f1b", 4, 1, 1) == (3, 3)
    assert stage_bytes((2, 2), 3.0, 5.0) == 16.0 and stage_bytes((3.0, 4.0), 1.0, 10.0) == 43.0
    parts = footprint_parts(Footprint("adamw", "pipedream", 4), 100.0, 10.0, 2, 0, 1)
    assert parts == {"parameters": 10.0, "gradients": 10.0, "optimizer_state": 20.0, "weight_stash": 20.0,
                     "activations": 200.0, "in_flight": 2.0, "total": 260.0}
    assert optimizer_kind("sgd", 0.9) == "sgd_momentum" and optimizer_kind("sgd", 0.0) == "sgd"


def test_footprint_options_are_validated():
    with pytest.raises(PlanError, match="optimizer must be one of"):
        Footprint(optimizer="lion")
    with pytest.raises(PlanError, match="schedule must be one of"):
        Footprint(schedule="zb")
    with pytest.raises(PlanError, match="microbatches must be an integer >= 1"):
        Footprint(microbatches=0)
    with pytest.raises(PlanError, match="activation_scale"):
        Footprint(activation_scale=0.0)
    with pytest.raises(PlanError, match="needs memory_model='footprint'"):
        PartitionOptions(footprint=Footprint())
    assert PartitionOptions(memory_model="footprint").footprint == Footprint()


def _weights_heavy_chain() -> Graph:
    """4 linear layers with 1 MB of weights each and small activations (what adam's 2 moments hit)."""
    nodes = [Node("x", "Input0", 0, 0, 1000.0)]
    nodes += [Node(f"l{i}", "Linear", 1.0, 2.0, 1000.0, 1e6) for i in range(4)]
    return Graph(tuple(nodes), tuple(zip(["x", "l0", "l1", "l2"], ["l0", "l1", "l2", "l3"])))


def test_adamw_refuses_a_layout_that_fits_with_sgd():
    graph = _weights_heavy_chain()
    hierarchy = Hierarchy.from_lists([2], memory_bytes=4.5e6)  # 2 layers per stage: 2e6 of parameters each
    sgd = PartitionOptions(straight_pipeline=True, use_memory_constraint=True, memory_model="footprint",
                           footprint=Footprint("sgd", "1f1b", 4))
    plan = partition(graph, hierarchy, sgd)
    assert [len(s.node_ids) for s in plan.stages] == [3, 2]  # x, l0, l1 | l2, l3
    # params + grads = 2 x 2e6 = 4e6, plus 1F1B's 2 (then 1) microbatches of 2000 activation bytes (the
    # model input is data loading, not a stage's activations); stage 1 also keeps the 1000 bytes of l1's
    # value it received until the backward (memory.stash_bytes, as the runtime's StashMeter counts)
    assert [s.memory_bytes for s in plan.stages] == [4e6 + 2 * 2000.0, 4e6 + 2000.0 + 1000.0]
    assert plan.extra["memory"][0]["optimizer_state"] == 0.0 and plan.extra["footprint"]["optimizer"] == "sgd"
    adamw = PartitionOptions(straight_pipeline=True, use_memory_constraint=True, memory_model="footprint",
                             footprint=Footprint("adamw", "1f1b", 4))
    with pytest.raises(InfeasibleError, match=r"memory model 'footprint'.*about [0-9.e+]+ bytes"):
        partition(graph, hierarchy, adamw)  # 4 x 2e6 = 8e6 > 4.5e6 on any 2-stage layout
    fits = partition(graph, Hierarchy.from_lists([4], memory_bytes=4.5e6), adamw)
    assert fits.num_stages == 4 and max(s.memory_bytes for s in fits.stages) <= 4.5e6
    # The legacy estimate (PipeDream's) knows no optimizer: it admits the 2-stage layout under adamw's limit.
    legacy = PartitionOptions(straight_pipeline=True, use_memory_constraint=True)
    assert partition(graph, hierarchy, legacy).num_stages == 2


@pytest.mark.parametrize("footprint", [Footprint("adamw", "1f1b", 3), Footprint("sgd", "gpipe", 2, 0.5),
                                       Footprint("sgd_momentum", "pipedream")])
def test_footprint_solvers_match_brute_force(footprint):
    for seed in range(20):
        rng = random.Random(seed)
        graph = synthetic.random_dag(rng.randint(3, 8), seed=seed, max_fan_in=3) if seed % 2 else synthetic.chain(rng.randint(2, 8), seed=seed)
        work = preprocess(graph)
        machines = rng.randint(1, 4)
        limit = (sum(work.activation) + sum(work.parameters)) * rng.choice([0.5, 1.0, 3.0])
        straight = rng.random() < 0.4
        options = PartitionOptions(straight_pipeline=straight, use_memory_constraint=True, memory_model="footprint",
                                   footprint=footprint, cuts="all")
        for cuts, oracle_cuts, fast in (("all", all_cuts(work), straight), ("topological", chains_of(prefix_states(work)), True)):
            opts = PartitionOptions(**{**options.__dict__, "cuts": cuts, "straight_pipeline": fast})
            try:
                got = partition(graph, Hierarchy.from_lists([machines], [1e9], limit), opts).time_per_minibatch_s
            except InfeasibleError as error:
                # The search sums per-node stash; a plan whose boundary values then overflow is refused, loudly.
                got = None if "once the values it sends and receives are counted" in str(error) else math.inf
            oracle, _ = brute_force(*oracle_cuts, machines, 1e9, None, fast, False, limit, footprint)
            if got is None:  # the search found the oracle's feasible optimum, and the full footprint refused it
                assert math.isfinite(oracle), (seed, cuts, oracle)
                continue
            assert got == oracle == math.inf or math.isclose(got, oracle, rel_tol=1e-9), (seed, cuts, got, oracle)


def test_cli_footprint_flags(tmp_path, capsys, reference_profiles):
    profile = str(reference_profiles / "vgg16.graph.txt")
    assert optimizer_main(["-f", profile, "-n", "4", "--optimizer", "adamw", "--schedule", "gpipe",
                           "--microbatches", "8", "-o", str(tmp_path)]) == 0
    import json
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["extra"]["memory_model"] == "footprint"
    assert plan["extra"]["footprint"] == {"optimizer": "adamw", "schedule": "gpipe", "microbatches": 8,
                                          "activation_scale": 1.0}
    for stage, parts in zip(plan["stages"], plan["extra"]["memory"]):
        # GPipe: every microbatch before any backward, dealt round-robin over the stage's replicas
        assert parts["in_flight"] == math.ceil(8 / stage["num_replicas"])
        assert parts["optimizer_state"] == 2 * parts["parameters"]
        assert stage["memory_bytes"] == pytest.approx(parts["total"])
    from model_parallel.errors import ConfigError
    with pytest.raises(ConfigError, match="describe the footprint memory model"):
        optimizer_main(["-f", profile, "-n", "2", "--memory_model", "1f1b", "--optimizer", "adam"])
    with pytest.raises(ConfigError, match="needs the graph's metadata batch_size"):
        optimizer_main(["-f", profile, "-n", "2", "--microbatch_size", "4"])


@pytest.mark.parametrize("name,kind,momentum", [("sgd", "sgd", 0.0), ("sgd", "sgd_momentum", 0.9), ("adamw", "adamw", 0.0)])
def test_predicted_static_bytes_equal_what_a_stage_allocates(name, kind, momentum):
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    parameter_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    if name == "adamw":
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=momentum)
    stage(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    parts = footprint_parts(Footprint(optimizer_kind(name, momentum), "1f1b", 1), 0.0, parameter_bytes, 1, 0, 1)
    held = state_bytes(stage, optimizer)
    assert held["parameters"] == parts["parameters"]
    assert held["gradients"] == parts["gradients"]
    # AdamW also keeps a 0-d `step` counter per parameter: state the size of the parameters is exact.
    assert held["optimizer_state"] == parts["optimizer_state"]


def test_the_meter_counts_what_a_microbatch_keeps_for_its_w_until_released():
    from model_parallel.runtime.observe.memory_probe import StashMeter

    meter = StashMeter(torch.device("cpu"))
    kept = [torch.zeros(256), torch.zeros(64)]  # gradients an I keeps for its W
    with meter.step(None):
        meter.keep(3, kept)
        assert meter.total == 4 * (256 + 64)
        meter.release(3)
        assert meter.total == 0
    assert meter.step_peak == 4 * (256 + 64)
