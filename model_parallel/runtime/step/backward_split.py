"""The backward split in two (zero-bubble schedules): input gradients now (`I`), weight gradients later (`W`).

`backward_input` computes dL/dx of the stage's inputs only (`autograd.grad` runs just the nodes on
the paths from the outputs to the inputs) and, on the way, keeps the gradient arriving at every
*intermediate*: a node on those paths from which a parameter is reached off them (for `y = x @ w`,
the matmul's node). `backward_weight` later restarts autograd at the intermediates with the kept
gradients, towards the parameters only, so W does not redo the input path (torch's
`pipelining/_backward.py` `stage_backward_input` / `stage_backward_weight` work the same way):

    outputs --[I: kept at the intermediates]--> ... --> inputs        (sent upstream at once)
                        |  W: from the kept gradients
                        v
                    parameters                                          (accumulated in .grad)

Parameters are grouped by the intermediates they share; each group is one `autograd.grad`, so a
group's restart never runs another group's input path. A group with several intermediates, one
above another on the input path, would see the lower one's gradient twice (kept, and again from the
upper one): a pre-hook clamps each intermediate to its kept gradient. A group's restart may run nodes
another group needs too (a weight used twice), so every call retains the graph; it is freed when the
`WeightWork` is dropped after W. An output none of the inputs
lead to (stage 0, whose inputs are data; a branch of parameters only) is a root of its group: W starts
there with the output's gradient, which is the whole backward when the inputs need no gradient.
Exactness against the plain backward is tested in tests/unit/runtime/test_backward_split.py.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Group:
    """Parameters that share intermediates (or roots): one autograd call in W."""

    params: set[Node] = field(default_factory=set)
    intermediates: set[Node] = field(default_factory=set)
    roots: set[Node] = field(default_factory=set)


@dataclass
class WeightWork:
    """What W needs from I: per group, where to restart and with which gradients, and the parameters."""

    groups: list[_Group]
    kept: dict[Node, tuple[Optional[torch.Tensor], ...]]  # gradient arriving at each intermediate during I
    root_grads: dict[Node, list[tuple[int, torch.Tensor]]]  # outputs off the input path: (output_nr, grad)
    params: dict[Node, torch.nn.Parameter]

    def gradients(self) -> Iterator[torch.Tensor]:
        """The gradients kept for W (what a microbatch holds between its I and its W besides its activations);
        lazy: the executor hands it to a meter that reads it only when memory is measured."""
        yield from (g for grads in self.kept.values() for g in grads if g is not None)
        yield from (g for pairs in self.root_grads.values() for _, g in pairs)


def _reverse_edges(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """child -> the nodes that feed it a gradient (its parents in the backward), from the roots down."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    queue = deque(seen)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _upward(starts: Iterable[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from `starts` towards the outputs, not crossing `stop`; and the `stop` nodes met."""
    closure, met = set(starts), set()
    queue = deque(closure)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in closure:
                closure.add(parent)
                queue.append(parent)
    return closure, met


def _groups(params: Sequence[Node], input_path: set[Node], roots: set[Node],
            parents: dict[Node, list[Node]]) -> list[_Group]:
    """Each parameter's intermediates and roots; parameters that share one end up in the same group."""
    owner: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for param in params:
        closure, met = _upward([param], parents, input_path)
        group = _Group({param}, met, closure & roots)
        for node in group.intermediates | group.roots:
            other = owner.get(node)
            if other is not None and other is not group:
                group.params |= other.params
                group.intermediates |= other.intermediates
                group.roots |= other.roots
                groups.remove(other)
                for moved in other.intermediates | other.roots:
                    owner[moved] = group
        for node in group.intermediates | group.roots:
            owner[node] = group
        groups.append(group)
    return groups


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[Any], params: Iterable[torch.nn.Parameter]) -> tuple[list[Optional[torch.Tensor]], WeightWork]:
    """I: dL/dx of each input (None where it needs none) from `outputs` and their gradients (None: ones, a loss);
    returns them with what `backward_weight` needs. The parameters' .grad is untouched."""
    seeds = [torch.ones_like(o) if g is None else g.to(o.dtype) for o, g in zip(outputs, grads)]
    out_edges = [get_gradient_edge(o) for o in outputs]
    wanted = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    param_nodes = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    roots = {edge.node for edge in out_edges}
    parents = _reverse_edges(roots)
    input_path, _ = _upward([get_gradient_edge(inputs[i]).node for i in wanted], parents, set())
    groups = _groups(list(param_nodes), input_path, roots - input_path, parents)
    kept: dict[Node, tuple[Optional[torch.Tensor], ...]] = {}

    def keeper(node: Node) -> Any:
        def hook(grad_outputs: tuple[Optional[torch.Tensor], ...]) -> None:
            kept[node] = grad_outputs
        return hook

    handles = [node.register_prehook(keeper(node)) for group in groups for node in group.intermediates]
    try:
        on_path = [(o, g) for o, e, g in zip(outputs, out_edges, seeds) if e.node in input_path]
        result: list[Optional[torch.Tensor]] = [None] * len(inputs)
        if wanted and on_path:
            computed = torch.autograd.grad([o for o, _ in on_path], [inputs[i] for i in wanted],
                                           [g for _, g in on_path], retain_graph=True, allow_unused=True)
            for i, g in zip(wanted, computed):
                result[i] = g
    finally:
        for handle in handles:
            handle.remove()
    root_grads: dict[Node, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for edge, g in zip(out_edges, seeds):
        if edge.node not in input_path:
            root_grads[edge.node].append((edge.output_nr, g))
    return result, WeightWork(groups, kept, dict(root_grads), param_nodes)


def backward_weight(work: WeightWork) -> None:
    """W: accumulate each parameter's gradient from what `backward_input` kept (one autograd call per group)."""
    for group in work.groups:
        starts: list[GradientEdge] = []
        start_grads: list[torch.Tensor] = []
        for node in group.intermediates:
            for index, g in enumerate(work.kept.get(node, ())):
                if g is not None:
                    starts.append(GradientEdge(node, index))
                    start_grads.append(g)
        for node in group.roots:
            for index, g in work.root_grads.get(node, ()):
                starts.append(GradientEdge(node, index))
                start_grads.append(g)
        if not starts:
            continue  # no gradient reaches these parameters (unused, or zero paths): like backward, .grad stays
        params = [work.params[node] for node in sorted(group.params, key=id)]  # a fixed order for the call
        clamps = [node.register_prehook(lambda _grads, kept=work.kept[node]: kept)
                  for node in group.intermediates if node in work.kept] if len(starts) > 1 else []
        try:
            # Into .grad as each weight's gradient is ready (AccumulateGrad, as a plain backward does): never the
            # whole stage's weight gradients at once beside .grad (autograd.grad returns them together, which
            # held one more copy of the stage's gradients at every W: a process over its cap under zbh1/zbv).
            torch.autograd.backward(starts, start_grads, retain_graph=True, inputs=params)
        finally:
            for handle in clamps:
                handle.remove()
