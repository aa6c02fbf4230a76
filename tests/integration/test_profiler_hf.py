"""Profiling a Hugging Face transformer (tiny GPT-2, random init) operator by operator, in situ."""
from __future__ import annotations

import pytest

import model_parallel
from support.profiling import assert_unchanged, snapshot


@pytest.mark.slow  # a Hugging Face model
def test_insitu_times_an_exported_transformer_operator_by_operator():
    from support.hf_zoo import CASES  # transformers: imported only by the test that needs it

    case = CASES["gpt2"]
    model, example = case.build(), case.example(2)
    target = case.data.batch(0)[1][:2]
    before = snapshot(model)
    graph = model_parallel.profile(model, example, lambda out: case.loss(out, target), warmup=1, iterations=1)
    assert graph.metadata["route"] == "export" and graph.metadata["profile"]["timing"] == "insitu"
    # every ATen operator that reads a weight (addmm, embedding, layer_norm) computes its gradient in backward
    weights = [n.node_id for n in graph.nodes if n.layer.op == "get_attr" and n.parameter_size > 0]
    readers = {user for w in weights for user in graph.successors[w]}
    assert len(weights) >= 10 and len(readers) >= 10
    for node_id in readers:
        assert graph[node_id].forward_ms > 0 and graph[node_id].backward_ms > 0, node_id
    assert all(n.compute_ms == 0 for n in graph.nodes if n.layer.op in ("placeholder", "get_attr"))
    assert_unchanged(model, before)
