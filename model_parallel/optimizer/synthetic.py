"""Seeded synthetic graphs for tests and the benchmark: chains, residual blocks, inception-like branches.

Every generator returns a `Graph` whose first node is an `Input0` source (zero cost), like a profile.
"""
from __future__ import annotations

import random
from typing import Optional

from model_parallel.graph.core import Graph, Node


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.nodes: list[Node] = [Node("input0", "Input0")]
        self.edges: list[tuple[str, str]] = []

    def add(self, description: str, inputs: list[str]) -> str:
        rng = self.rng
        node_id = f"node{len(self.nodes)}"
        forward = round(rng.uniform(0.1, 5.0), 3)
        self.nodes.append(
            Node(node_id, description, forward_ms=forward, backward_ms=round(forward * rng.uniform(1.0, 2.5), 3),
                 activation_size=float(rng.choice((1, 2, 4, 8, 16)) * 2**20),
                 parameter_size=float(rng.choice((0, 0, 1, 4, 16)) * 2**18))
        )
        self.edges.extend((src, node_id) for src in inputs)
        return node_id

    def graph(self, name: str) -> Graph:
        return Graph(tuple(self.nodes), tuple(self.edges), {"model": name})


def chain(num_nodes: int, seed: int = 0) -> Graph:
    """`Input0 -> n1 -> ... -> n_num_nodes`."""
    b = _Builder(seed)
    last = "input0"
    for _ in range(num_nodes):
        last = b.add("Linear", [last])
    return b.graph(f"chain{num_nodes}")


def residual(num_blocks: int, block_depth: int = 2, seed: int = 0) -> Graph:
    """ResNet-like: each block is `block_depth` layers on one branch plus a skip, joined by an Add."""
    b = _Builder(seed)
    last = b.add("Conv2d", ["input0"])
    for _ in range(num_blocks):
        branch = last
        for _ in range(block_depth):
            branch = b.add("Conv2d", [branch])
        last = b.add("Add", [branch, last])
    return b.graph(f"residual{num_blocks}x{block_depth}")


def branches(num_blocks: int, width: int = 4, depth: int = 2, seed: int = 0) -> Graph:
    """Inception-like: each block forks into `width` branches of 1..`depth` layers joined by a Concat."""
    b = _Builder(seed)
    last = b.add("Conv2d", ["input0"])
    for _ in range(num_blocks):
        ends = []
        for _ in range(width):
            node = last
            for _ in range(b.rng.randint(1, depth)):
                node = b.add("Conv2d", [node])
            ends.append(node)
        last = b.add("Concat(1)", ends)
    return b.graph(f"branches{num_blocks}x{width}x{depth}")


def random_dag(num_nodes: int, seed: int = 0, max_fan_in: int = 2, window: Optional[int] = 4) -> Graph:
    """A random DAG: node i reads 1..max_fan_in of the `window` nodes before it (always node i-1)."""
    b = _Builder(seed)
    ids = ["input0"]
    for i in range(num_nodes):
        earlier = ids[max(0, len(ids) - (window or len(ids))):]
        extra = b.rng.sample(earlier[:-1], min(len(earlier) - 1, b.rng.randint(0, max_fan_in - 1))) if len(earlier) > 1 else []
        ids.append(b.add("Op", [ids[-1], *sorted(set(extra) - {ids[-1]})]))
    return b.graph(f"dag{num_nodes}")


def traced_costs(graph: Graph, ms_per_mb: float = 0.05) -> Graph:
    """A traced graph (zero times) with synthetic costs: compute proportional to activation bytes.

    Nodes the profiler never times stay free, as in a real profile: inputs, weight reads (get_attr) and
    nodes without a tensor output (`x.size(0)`, `torch._assert`).
    """
    nodes = []
    for node in graph.nodes:
        if node.is_input or node.activation_bytes == 0 or (node.layer is not None and node.layer.op == "get_attr"):
            nodes.append(node)
            continue
        mb = node.activation_bytes / 2**20
        forward = round(ms_per_mb * mb + 0.01, 4)
        nodes.append(Node(node.node_id, node.description, forward, 2 * forward, node.activation_size,
                          node.parameter_size, None, node.layer, node.uncrossable))
    return graph.replace_nodes(nodes)
