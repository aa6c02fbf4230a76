"""The operator graph: nodes with costs, the dataflow edges between them, and how to rebuild each layer.

Every step of the workflow speaks this type. The profiler produces it, the optimizer reads its costs,
the code generator and the runtime rebuild layers from each node's `LayerSpec`, and the coordinator
re-partitions it while training. Graphs are immutable; derived views (order, predecessors) are cached.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Optional, Union

from model_parallel.errors import GraphError
from model_parallel.graph.names import unique_names

# JSON-compatible value: how layer arguments are stored (see `model_parallel.graph.arguments`).
JSONValue = Any

# metadata key of the tied parameters: [["wte.weight", "lm_head.weight"], ...] (see `Graph.tie_groups`).
TIED_PARAMETERS = "tied_parameters"
# metadata key of the other state-dict names of a tied tensor no node reads under that name:
# {"cls.predictions.bias": "cls.predictions.decoder.bias"} (BERT); see codegen.naming.stage_state_from_original.
STATE_ALIASES = "state_aliases"
# A graph of a real model has 10^2..10^5 nodes (an ATen-level export of a 1000-layer model a few 10^5). A file is
# bounded by its bytes (jsonbound.MAX_FILE_BYTES, 1 GiB), but 1 GiB of graph.txt lines is 10^7 nodes, ~13 GB of Node
# objects and minutes of parsing: a count past these is refused while reading, before the nodes are built.
MAX_NODES = 1_000_000
MAX_EDGES = 4 * MAX_NODES


def shown_id(text: str) -> str:
    """A node id as a message shows it: itself, or its repr where it holds a line break or a control character
    (an edge of a file names any text; raw, it would split the one-line error or drive the terminal)."""
    return text if text.isprintable() else repr(text)


def too_many(count: int, what: str) -> Optional[str]:
    """Why `count` nodes or edges (`what`) are refused, or None: the one rule both file formats apply."""
    limit = MAX_NODES if what == "nodes" else MAX_EDGES
    if count <= limit:
        return None
    return (f"more than {limit:,} {what} ({count:,} or more); a graph of a real model has at most a few 10^5 nodes: "
            "is this the right file? (profile the model again)")


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor a node produces, at the profiled batch size."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class LayerSpec:
    """Everything needed to rebuild and run one node without the original model object.

    Mirrors a torch.fx node:
    - `op`: "placeholder", "call_module", "call_function", "call_method" or "get_attr".
    - `target`: the model input's name (placeholder), the submodule path in the original model
      ("layer1.0.conv1"), a function's import path ("torch.flatten", "operator.add"), a tensor
      method name ("view"), or an attribute path (get_attr).
    - `args` / `kwargs`: JSON-encoded arguments; a reference to another node's output is
      `{"node": "<node_id>"}` (full encoding in `model_parallel.graph.arguments`).
    - `module`: for call_module, a Python expression that constructs an equivalent fresh module
      (e.g. "torch.nn.Conv2d(3, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)"),
      or None when the module cannot be rebuilt from text (then the original model supplies it).
    - `outputs`: shape and dtype of each tensor the node produces (a single output is a 1-tuple;
      empty for non-tensor results such as `x.size(0)`).
    - `parameters`: state-dict names (relative to the original model) of the parameters and
      buffers this node owns; a module called twice owns them on its first call only.
    """

    op: str
    target: str
    args: tuple[JSONValue, ...] = ()
    kwargs: Mapping[str, JSONValue] = field(default_factory=dict)
    module: Optional[str] = None
    outputs: tuple[TensorMeta, ...] = ()
    parameters: tuple[str, ...] = ()

    OPS = ("placeholder", "call_module", "call_function", "call_method", "get_attr")

    def __post_init__(self) -> None:
        if self.op not in self.OPS:
            raise GraphError(f"layer op must be one of {self.OPS}, got {self.op!r}")


ActivationSize = Union[float, tuple[float, ...]]


@dataclass(frozen=True)
class Node:
    """One operator of the model, with its measured costs (PipeDream's graph.txt fields).

    Times are milliseconds per minibatch at the profiled batch size; sizes are bytes.
    `activation_size` is a tuple for nodes with several outputs (PipeDream writes `[a; b; c]`).
    `uncrossable`: why this node's value cannot be sent to another stage (a Python object the wire
    cannot carry, a buffer its reader updates in place), as the profiler found it; None when it can.
    A plan keeps such a node and all its consumers in one stage.
    `saved_bytes`: bytes autograd saves for backward from this node's values in a training forward (its
    outputs that any consumer saves, and what its own operator saves beyond its inputs), each storage
    once (graph/saved.py); None when not profiled: the footprint then takes `activation_bytes`.
    """

    node_id: str
    description: str
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    activation_size: ActivationSize = 0.0
    parameter_size: float = 0.0
    stage_id: Optional[int] = None
    layer: Optional[LayerSpec] = None
    uncrossable: Optional[str] = None
    saved_bytes: Optional[float] = None

    def __post_init__(self) -> None:
        if not self.node_id or any(c.isspace() for c in self.node_id):
            raise GraphError(f"node id must be a non-empty token without spaces, got {self.node_id!r}")
        if not self.node_id.isprintable():  # a NUL or escape byte would reach logs, files and generated code raw
            raise GraphError(f"node id {self.node_id!r} must be printable (no NUL or control characters)")
        if " -- " in self.description or "\n" in self.description:
            raise GraphError(f"node {self.node_id}: description may not contain ' -- ' or a newline")
        for name in ("forward_ms", "backward_ms", "parameter_size"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise GraphError(f"node {self.node_id}: {name} must be a finite number >= 0, got {value}")
        for value in self.activation_sizes:
            if not math.isfinite(value) or value < 0:
                raise GraphError(f"node {self.node_id}: activation_size must be >= 0, got {value}")
        if self.stage_id is not None and self.stage_id < 0:
            raise GraphError(f"node {self.node_id}: stage_id must be >= 0, got {self.stage_id}")
        if self.uncrossable is not None and (not isinstance(self.uncrossable, str) or not self.uncrossable.strip()):
            raise GraphError(f"node {self.node_id}: uncrossable must be a reason (a non-empty string) or None, "
                             f"got {self.uncrossable!r}")
        if self.saved_bytes is not None and not (math.isfinite(self.saved_bytes) and self.saved_bytes >= 0):
            raise GraphError(f"node {self.node_id}: saved_bytes must be a finite number >= 0 or None (not profiled), "
                             f"got {self.saved_bytes}")

    @property
    def crossable(self) -> bool:
        """Whether this node's value may be sent to another stage (see `uncrossable`). A weight read as a
        bare tensor (get_attr) stays with its readers: sent, it would cross (and its gradient back) every
        microbatch, and the receiver would hold a copy of it."""
        return self.uncrossable is None and not self.reads_state

    @property
    def activation_sizes(self) -> tuple[float, ...]:
        """The activation size as a tuple (one entry per output)."""
        if isinstance(self.activation_size, tuple):
            return self.activation_size
        return (self.activation_size,)

    @property
    def activation_bytes(self) -> float:
        """Bytes leaving this node (sum over outputs)."""
        return float(sum(self.activation_sizes))

    @property
    def stash_bytes(self) -> float:
        """Bytes kept for backward from this node: `saved_bytes` where profiled, else its outputs; a get_attr
        keeps nothing new (its value is a parameter or buffer the stage holds anyway, priced once as a weight:
        the profiler never charges those either)."""
        if self.saved_bytes is not None:
            return float(self.saved_bytes)
        return 0.0 if self.reads_state else self.activation_bytes

    @property
    def reads_state(self) -> bool:
        """Whether this node's value is a tensor the model holds (a get_attr of a parameter or buffer)."""
        return self.layer is not None and self.layer.op == "get_attr"

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def is_input(self) -> bool:
        """PipeDream convention: sources described `Input...` are model inputs (data loading)."""
        return self.description.startswith("Input")


@dataclass(frozen=True)
class Graph:
    """A DAG of `Node`s. Node order is the order they were given (file order); edges keep order too,
    which matters: a node's inputs are its in-edges in order (the arguments of Add, Concat, ...).

    `metadata` holds free-form facts about the profile (model name, batch size, input shapes, ...);
    one key is checked: `metadata["tied_parameters"]` (see `tie_groups`).
    """

    nodes: tuple[Node, ...]
    edges: tuple[tuple[str, str], ...]
    metadata: Mapping[str, JSONValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "edges", tuple((str(a), str(b)) for a, b in self.edges))
        if not self.nodes:
            raise GraphError("graph is empty: it needs at least one node")
        refused = too_many(len(self.nodes), "nodes") or too_many(len(self.edges), "edges")
        if refused:
            raise GraphError(refused)
        seen: set[str] = set()
        for node in self.nodes:
            if node.node_id in seen:
                raise GraphError(f"duplicate node id {node.node_id!r}")
            seen.add(node.node_id)
        for src, dst in self.edges:
            for end in (src, dst):
                if end not in seen:
                    raise GraphError(f"edge {shown_id(src)} -- {shown_id(dst)} names unknown node {end!r}")
        if len(self.topological_order) != len(self.nodes):
            cycle = self.find_cycle()
            raise GraphError(f"graph has a cycle: {' -> '.join(cycle)}")
        self.tie_groups()  # validates the record

    def tie_groups(self) -> tuple[tuple[str, ...], ...]:
        """Groups of original state-dict names that are one tensor in the model (GPT-2's `transformer.wte.weight`
        and `lm_head.weight`), as the profiler found them by identity: `metadata["tied_parameters"]`.

        Every name is a parameter or buffer some node owns (`layer.parameters`); no name is in two groups.
        """
        record = self.metadata.get(TIED_PARAMETERS)
        if record is None:
            return ()
        where = f"metadata.{TIED_PARAMETERS}"
        if not isinstance(record, (list, tuple)):
            raise GraphError(f"{where} must be a list of name lists like [[\"wte.weight\", \"lm_head.weight\"]], "
                             f"got {type(record).__name__}")
        owned = {p for n in self.nodes if n.layer is not None for p in n.layer.parameters}
        seen: set[str] = set()
        groups = []
        for index, group in enumerate(record):
            if not isinstance(group, (list, tuple)) or len(group) < 2 or not all(isinstance(g, str) for g in group):
                raise GraphError(f"{where}[{index}] must list two or more parameter names, got {group!r}")
            for name in group:
                if name not in owned:
                    raise GraphError(f"{where}[{index}]: {name!r} is not a parameter or buffer of any node "
                                     "(no node lists it in layer.parameters); re-profile the model")
                if name in seen:
                    raise GraphError(f"{where}[{index}]: {name!r} is named twice; one name belongs to one tensor")
                seen.add(name)
            groups.append(tuple(group))
        return tuple(groups)

    # ---- lookups -------------------------------------------------------------------------------
    @cached_property
    def by_id(self) -> dict[str, Node]:
        return {node.node_id: node for node in self.nodes}

    @cached_property
    def attribute_names(self) -> dict[str, str]:
        """Layer target (call_module / get_attr) -> the attribute a stage module holds it under: distinct per
        target, never a keyword or a module attribute (`graph.names.unique_names`)."""
        return unique_names(n.layer.target for n in self.nodes
                            if n.layer is not None and n.layer.op in ("call_module", "get_attr"))

    @cached_property
    def variable_names(self) -> dict[str, str]:
        """Node id -> the variable generated code holds its value in: distinct per node, never a keyword or `self`."""
        return unique_names((n.node_id for n in self.nodes), attributes=False)

    def __getitem__(self, node_id: str) -> Node:
        try:
            return self.by_id[node_id]
        except KeyError:
            raise GraphError(f"no node {node_id!r} in graph") from None

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.by_id

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def predecessors(self) -> dict[str, tuple[str, ...]]:
        """Direct inputs of each node, in edge order."""
        preds: dict[str, list[str]] = {node.node_id: [] for node in self.nodes}
        for src, dst in self.edges:
            preds[dst].append(src)
        return {k: tuple(v) for k, v in preds.items()}

    @cached_property
    def successors(self) -> dict[str, tuple[str, ...]]:
        """Direct consumers of each node, in edge order."""
        succs: dict[str, list[str]] = {node.node_id: [] for node in self.nodes}
        for src, dst in self.edges:
            succs[src].append(dst)
        return {k: tuple(v) for k, v in succs.items()}

    @cached_property
    def sources(self) -> tuple[str, ...]:
        return tuple(n.node_id for n in self.nodes if not self.predecessors[n.node_id])

    @cached_property
    def sinks(self) -> tuple[str, ...]:
        return tuple(n.node_id for n in self.nodes if not self.successors[n.node_id])

    @cached_property
    def topological_order(self) -> tuple[str, ...]:
        """Kahn's algorithm; ties broken by node order, so a file already in order keeps it."""
        position = {node.node_id: i for i, node in enumerate(self.nodes)}
        indegree = {node.node_id: 0 for node in self.nodes}
        for _, dst in self.edges:
            indegree[dst] += 1
        ready = [position[n] for n, d in indegree.items() if d == 0]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            node_id = self.nodes[heapq.heappop(ready)].node_id
            order.append(node_id)
            for succ in self.successors[node_id]:
                indegree[succ] -= 1
                if indegree[succ] == 0:
                    heapq.heappush(ready, position[succ])
        return tuple(order)

    def find_cycle(self) -> list[str]:
        """One cycle as a list of node ids (first id repeated at the end), or [] for a DAG."""
        color: dict[str, int] = {}
        stack_path: list[str] = []

        def visit(start: str) -> list[str]:
            work = [(start, iter(self.successors[start]))]
            color[start] = 1
            stack_path.append(start)
            while work:
                node_id, children = work[-1]
                child = next(children, None)
                if child is None:
                    color[node_id] = 2
                    stack_path.pop()
                    work.pop()
                elif color.get(child, 0) == 1:
                    return stack_path[stack_path.index(child):] + [child]
                elif color.get(child, 0) == 0:
                    color[child] = 1
                    stack_path.append(child)
                    work.append((child, iter(self.successors[child])))
            return []

        for node in self.nodes:
            if color.get(node.node_id, 0) == 0:
                cycle = visit(node.node_id)
                if cycle:
                    return cycle
        return []

    # ---- derived graphs -----------------------------------------------------------------------
    def with_stages(self, stage_of: Mapping[str, int]) -> "Graph":
        """A copy with `stage_id` set on every node from `stage_of` (node id -> stage)."""
        missing = [n.node_id for n in self.nodes if n.node_id not in stage_of]
        if missing:
            raise GraphError(f"no stage given for {len(missing)} node(s), e.g. {missing[:3]}")
        nodes = tuple(replace(n, stage_id=int(stage_of[n.node_id])) for n in self.nodes)
        return replace(self, nodes=nodes)

    def replace_nodes(self, nodes: Iterable[Node]) -> "Graph":
        return replace(self, nodes=tuple(nodes))

    @property
    def is_partitioned(self) -> bool:
        return all(n.stage_id is not None for n in self.nodes)

    @property
    def num_stages(self) -> int:
        stages = {n.stage_id for n in self.nodes if n.stage_id is not None}
        return len(stages)

    def stage_node_ids(self, stage_id: int) -> tuple[str, ...]:
        """Ids of the nodes of one stage, in topological order."""
        return tuple(n for n in self.topological_order if self.by_id[n].stage_id == stage_id)

    def ancestors(self, node_id: str) -> frozenset[str]:
        """All transitive inputs of a node (not including itself)."""
        seen: set[str] = set()
        todo = list(self.predecessors[node_id])
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(self.predecessors[current])
        return frozenset(seen)

    @property
    def total_compute_ms(self) -> float:
        return sum(n.compute_ms for n in self.nodes)
