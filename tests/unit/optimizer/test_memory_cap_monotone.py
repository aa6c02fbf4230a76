"""A larger memory_per_worker never loses a plan a smaller one found, and a refusal's figure is one that plans.

The search bounds what each stage holds; the values a stage sends and receives come on top. A 4-rank GPT-2 (4 x 768,
8k vocabulary, AdamW) planned at 0.27 GB but was refused at 0.28 and 0.30 GB, and a refusal at 0.2 GB named 0.25 GB
as "the smallest that fits", itself refused: the balanced split at the larger bound was tipped over by its boundary
values, and nothing tried another (optimizer/contiguous.py `_fitting_split`)."""
from __future__ import annotations

import re

import pytest

from model_parallel.errors import InfeasibleError
from model_parallel.graph.core import Graph, LayerSpec, Node
from model_parallel.optimizer.contiguous import even_stages, v_plan
from model_parallel.optimizer.memory import OFFLOAD_CHUNK_BYTES, Footprint

FOOTPRINT = Footprint("sgd", "1f1b", 2)


def chain(parameters: list[float], outputs: list[float]) -> Graph:
    """x -> l0 -> l1 -> ...: each layer 1 ms, its parameters, its output's bytes, nothing saved for backward."""
    nodes = [Node("x", "Input0", activation_size=1e3, layer=LayerSpec("placeholder", "x"))]
    edges, last = [], "x"
    for i, (held, out) in enumerate(zip(parameters, outputs)):
        nodes.append(Node(f"l{i}", "linear", forward_ms=1.0, activation_size=out, parameter_size=held, saved_bytes=0.0,
                          layer=LayerSpec("call_module", f"l{i}")))
        edges.append((last, f"l{i}"))
        last = f"l{i}"
    return Graph(nodes=tuple(nodes), edges=tuple(edges), metadata={"outputs": {"node": last}})


def fits(graph: Graph, cap: float) -> bool:
    try:
        plan = even_stages(graph, 2, memory_per_worker=cap, footprint=FOOTPRINT)
    except InfeasibleError:
        return False
    assert max(s.memory_bytes for s in plan.stages) <= cap  # what is planned fits what was asked
    return True


def test_a_larger_cap_plans_where_a_smaller_one_did():
    # The time-balanced split (l0, l1 | l2) fits 8 MB by what its stages hold, but l2 receives l1's output on top;
    # at 6.5 MB the search had to pick (l0 | l1, l2), which fits.
    graph = chain([1e6, 2e6, 2e6], [1e3, 1e3, 1e6])
    assert fits(graph, 6.5e6)
    assert all(fits(graph, cap * 0.5e6) for cap in range(13, 60))  # 8 MB was refused


def test_the_smallest_that_fits_named_by_a_refusal_plans():
    graph = chain([1e6, 2e6, 2e6, 1e6], [4e6, 1e3, 2e6, 1e3])
    with pytest.raises(InfeasibleError, match="the smallest that fits is") as refused:
        even_stages(graph, 2, memory_per_worker=1e6, footprint=FOOTPRINT)
    named = float(re.search(r"\((\d+) bytes\)", str(refused.value)).group(1))
    assert fits(graph, named)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_refusal_names_offloading_the_optimizer_state_where_that_plans(schedule):
    # 2 x 160 MB per rank: parameters + gradients 0.32 GB fit 0.45 GB, AdamW's state (0.32 GB more) does not; with the
    # state on disk a rank holds a 64 MB chunk of it. The advice is given only where it plans.
    graph = chain([40e6] * 8, [1e3] * 8)

    def refusal(optimizer: str, cap: float) -> str:
        with pytest.raises(InfeasibleError) as refused:
            if schedule == "zbv":
                v_plan(graph, 2, memory_per_worker=cap, footprint=Footprint(optimizer, "zbv", 4))
            else:
                even_stages(graph, 2, memory_per_worker=cap, footprint=Footprint(optimizer, "1f1b", 2))
        return str(refused.value)

    assert "offload_optimizer=DIR" in refusal("adamw", 450e6)
    offloaded = Footprint("adamw", schedule, 4 if schedule == "zbv" else 2, offload_chunk=OFFLOAD_CHUNK_BYTES)
    plan = (v_plan(graph, 2, memory_per_worker=450e6, footprint=offloaded) if schedule == "zbv" else
            even_stages(graph, 2, memory_per_worker=450e6, footprint=offloaded))
    assert max(s.memory_bytes for s in plan.stages) <= 450e6
    assert "offload" not in refusal("adamw", 300e6)  # parameters and gradients alone are over: offloading cannot help
    assert "offload" not in refusal("sgd", 300e6)  # plain SGD has no state to offload
