"""Helpers for the code generator tests: contiguous splits and a runtime-like pipeline oracle."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from model_parallel.codegen.build import StageModule, build_stages
from model_parallel.codegen.naming import original_state_from_stage, stage_state_from_original
from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.step.output import model_output


def contiguous_split(graph: Graph, num_stages: int) -> dict[str, int]:
    """Cut the topological order into `num_stages` chunks of (nearly) equal node counts."""
    order = graph.topological_order
    return {node_id: index * num_stages // len(order) for index, node_id in enumerate(order)}


def split_before(graph: Graph, first_nodes: Sequence[str]) -> dict[str, int]:
    """Stages starting at each of `first_nodes` (in topological order)."""
    stage, stage_of = 0, {}
    for node_id in graph.topological_order:
        if node_id in first_nodes:
            stage += 1
        stage_of[node_id] = stage
    return stage_of


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_()
    if isinstance(value, (tuple, list)):  # a multi-output node (split, LSTM) cut from its getitems
        return type(value)(_detached(v) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def run_stages(stages: Sequence[StageModule], inputs: Mapping[str, Any], loss_fn: Callable[[Any], torch.Tensor],
               whole: bool = False) -> tuple[Any, torch.Tensor]:
    """Run stages like the runtime does: every received activation is a fresh leaf (detach +
    requires_grad), the loss is taken on the last stage, and gradients are sent back stage by stage.
    `loss_fn` gets the last stage's only output, or the tuple of them (always the tuple with `whole`)."""
    env = dict(inputs)
    records = []
    for stage in stages:
        received = [_detached(env[name]) for name in stage.input_names]
        outputs = stage(*received)
        assert isinstance(outputs, tuple) and len(outputs) == len(stage.output_names)
        records.append((stage, received, outputs))
        env.update(zip(stage.output_names, outputs))
    final = records[-1][2]
    loss = loss_fn(final[0] if len(final) == 1 and not whole else final)
    loss.backward()
    for index in range(len(records) - 2, -1, -1):
        stage, _, outputs = records[index]
        next_inputs = dict(zip(records[index + 1][0].input_names, records[index + 1][1]))
        pairs = [(o, r.grad) for n, out in zip(stage.output_names, outputs)
                 for o, r in zip(_tensors(out), _tensors(next_inputs[n])) if o.requires_grad and r.grad is not None]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
    return final, loss


def _load_stage_states(stages: Sequence[nn.Module], state: Mapping[str, Any]) -> None:
    """Each stage gets its own keys of `state` (stage names), strictly."""
    for stage in stages:
        keys = stage.state_dict().keys()
        stage.load_state_dict({k: v for k, v in state.items() if k in keys}, strict=True)


def load_original_weights(graph: Graph, model: nn.Module, stages: Sequence[nn.Module]) -> None:
    _load_stage_states(stages, stage_state_from_original(graph, model.state_dict()))


def _original_grads(graph: Graph, stages: Sequence[nn.Module]) -> dict[str, Any]:
    """Every stage parameter's gradient under the original model's names."""
    grads: dict[str, Any] = {}
    for stage in stages:
        grads.update(original_state_from_stage(graph, {k: p.grad for k, p in stage.named_parameters()}))
    return grads


def assert_equivalent(
    graph: Graph,
    model: nn.Module,
    stages: Sequence[StageModule],
    inputs: Sequence[Any],
    loss_fn: Callable[[Any], torch.Tensor],
    tol: float = 1e-6,
) -> None:
    """Same outputs, loss, every parameter gradient and every buffer (BatchNorm statistics) as `model`."""
    load_original_weights(graph, model, stages)
    input_names = [n for n in graph.topological_order if graph[n].layer.op == "placeholder"]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # dropout draws the same masks: the stages run the ops in the same order
    expected = model(*inputs)
    expected_loss = loss_fn(expected)
    expected_loss.backward()
    torch.manual_seed(0)
    got, loss = run_stages(stages, dict(zip(input_names, inputs)), loss_fn)
    torch.testing.assert_close(got[0] if len(got) == 1 else got, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(loss, expected_loss, atol=tol, rtol=tol)
    grads = _original_grads(graph, stages)
    buffers = {}
    for stage in stages:
        buffers.update(original_state_from_stage(graph, dict(stage.named_buffers())))
    reference = dict(model.named_parameters())
    assert set(grads) == set(reference), set(grads) ^ set(reference)
    for name, param in reference.items():
        assert grads[name] is not None, f"no gradient for {name}"
        torch.testing.assert_close(grads[name], param.grad, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


def assert_every_cut_computes_as_the_model(model: nn.Module, example: Any, loss_fn: Callable[[Any], torch.Tensor],
                                           stride: int = 1) -> int:
    """Every two-stage cut of `model`'s traced graph (every `stride`-th), not only the ones a plan picks from
    timings (which vary with the machine's load), gives the model's loss and every parameter gradient; a cut no
    plan can make (a value that cannot cross, a weight away from its readers) is refused by name. `example`: a
    tuple of positional inputs or a dict of keyword inputs. Returns how many cuts were built and run."""
    graph, _ = trace_model(model, example)
    order = graph.topological_order
    inputs = [n for n in order if graph[n].layer.op == "placeholder"]
    model.zero_grad(set_to_none=True)
    want_loss = loss_fn(model(**example) if isinstance(example, dict) else model(*example))
    want_loss.backward()
    want = {key: p.grad for key, p in model.named_parameters() if p.grad is not None}
    state = stage_state_from_original(graph, model.state_dict(), strict=False)
    values = dict(zip(inputs, example.values() if isinstance(example, dict) else example))
    made = 0
    for cut in range(len(inputs), len(order), stride):
        where = f"cut before {order[cut]}"
        try:
            stages = build_stages(graph, {node: int(i >= cut) for i, node in enumerate(order)})
        except PlanError as error:
            assert "cannot cross a stage boundary" in str(error), f"{where}: {error}"
            continue
        _load_stage_states(stages, state)
        _, loss = run_stages(stages, values, lambda out: loss_fn(model_output(graph, stages[-1].output_names, out)),
                             whole=True)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
        got = _original_grads(graph, stages)
        assert set(want) <= set(got), f"{where}: no gradient for {sorted(set(want) - set(got))}"
        for key, grad in want.items():
            torch.testing.assert_close(got[key], grad, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{where}: {key}: {m}")
        made += 1
    return made
