"""`traced_graph`: a small random graph shaped the way the profiler records models (several sources,
shape reads beside the main branch, a weight read per weight)."""
from __future__ import annotations

import random

from model_parallel.graph.core import Graph, Node


def traced_graph(seed: int, weights: bool = True) -> Graph:
    """A small graph the way the profiler records models: `Input0`, `x.shape` read with a free
    `getitem` chain (consumed by a real node or by a free `_assert` sink), one or two extra real
    sources (a constant, an `arange`), weight reads feeding one node each, and a random DAG."""
    rng = random.Random(seed)
    nodes = [Node("x", "Input0", activation_size=4.0)]
    edges: list[tuple[str, str]] = []
    real: list[str] = []

    def add(name: str, description: str, inputs: list[str], cost: bool = True, params: float = 0.0) -> str:
        forward = round(rng.uniform(0.1, 5.0), 3) if cost else 0.0
        activation = float(rng.choice((1, 2, 4, 8)) * 2**20) if cost else params
        nodes.append(Node(name, description, forward, round(forward * rng.uniform(1.0, 2.0), 3), activation, params))
        edges.extend((src, name) for src in inputs)
        return name

    first = add("conv", "Conv2d", ["x"])
    real.append(first)
    shape = add("size", "getattr('shape')", ["x"], cost=False)
    item = add("getitem", "__getitem__(0)", [shape], cost=False)
    for extra in range(rng.randint(1, 2)):
        real.append(add(f"arange{extra}", "arange", []))
    for index in range(rng.randint(2, 4)):  # at most 16 nodes in all: the brute force tries every subset
        inputs = rng.sample(real[-4:], k=min(len(real[-4:]), rng.randint(1, 2)))
        if weights and rng.random() < 0.5:
            inputs.append(add(f"w{index}", f"Attribute(w{index})", [], cost=False, params=float(rng.choice((1, 4)) * 2**18)))
        real.append(add(f"op{index}", "Linear", inputs))
    if rng.random() < 0.5:
        add("view", "view", [real[-1], item])  # the shape read consumed at the end, like `x.view(B, -1)`
    else:
        check = add("eq", "operator.eq(2)", [item], cost=False)
        add("assert", "torch._assert", [check], cost=False)
        # what remains unconsumed joins the output
        add("out", "add", [n for n in real if not any(src == n for src, _ in edges)] or [real[-1]])
    return Graph(tuple(nodes), tuple(edges))
