"""The loader admits exactly the reviewed list, and no op whose memory safety rests on unchecked literals.

The issue's exploits: `torch.sparse_coo_tensor([[0], [100000000]], [7.0], (2, 128))` then `torch.add`
wrote past a heap buffer, and `Tensor.const_data_ptr` leaked heap addresses. Both are refused by
family now (with the ATen spellings torch.export records), and allowed_ops.txt, the list a person
reviewed, must equal what the loader's rules admit.
"""
from __future__ import annotations

import re

import pytest
import torch

from model_parallel.codegen.build import build_stages
from model_parallel.errors import GraphFormatError
from model_parallel.graph import allowed_ops, loader
from model_parallel.graph.json_format import graph_from_dict
from model_parallel.graph.plan import Plan, StagePlan

torch.set_num_threads(1)


def test_the_reviewed_list_equals_what_the_loader_admits() -> None:
    admitted = loader.admitted_by_code()
    reviewed = set(allowed_ops.reviewed())
    assert not admitted - reviewed, f"admitted but not reviewed (review, then tools/write_allowed_ops.py): {sorted(admitted - reviewed)[:20]}"
    assert not reviewed - admitted, f"listed but not admitted by the loader's rules: {sorted(reviewed - admitted)[:20]}"
    assert {kind for kind, _ in reviewed} == set(allowed_ops.KINDS)


def test_no_reviewed_entry_belongs_to_a_refused_family() -> None:
    for kind, name in allowed_ops.reviewed():
        if kind in ("function", "aten", "method"):
            assert allowed_ops.refused_family(name.rpartition(".")[2]) is None, (kind, name)
    for pattern, _ in allowed_ops.REFUSED_FAMILIES:
        re.compile(pattern)


def _graph(*layers: tuple[str, dict]) -> dict:
    meta = [{"shape": [2, 128], "dtype": "float32"}]
    nodes = [("x", {"op": "placeholder", "target": "x", "outputs": meta}), *layers]
    edges = [[ref["node"], node_id] for node_id, layer in nodes for ref in layer.get("args", [])
             if isinstance(ref, dict) and "node" in ref]
    return {"schema": "model_parallel.graph", "version": 1, "metadata": {"outputs": {"node": nodes[-1][0]}},
            "nodes": [{"id": i, "description": layer["op"], "forward_ms": 1.0, "backward_ms": 1.0,
                       "activation_size": 1024.0, "parameter_size": 0.0, "stage_id": 0, "layer": layer}
                      for i, layer in nodes], "edges": edges}


def _call(target: str, *args, op: str = "call_function", **kwargs) -> dict:
    return {"op": op, "target": target, "args": list(args), "kwargs": kwargs}


X = {"node": "x"}
SPARSE_ARGS = ([[0], [100000000]], [7.0], {"tuple": [2, 128]})
REFUSED = {
    "sparse_coo_tensor": _call("torch.sparse_coo_tensor", *SPARSE_ARGS),
    "sparse_coo_tensor_aten": _call("torch.ops.aten.sparse_coo_tensor.size", {"tuple": [2, 128]}),
    "sparse_csr_tensor": _call("torch.sparse_csr_tensor", [0, 1, 1], [100000000], [7.0], {"tuple": [2, 128]}),
    "sparse_compressed_tensor": _call("torch.sparse_compressed_tensor", [0, 1], [9], [1.0], {"tuple": [1, 2]}),
    "sparse_resize_": _call("sparse_resize_", X, {"tuple": [2, 2]}, 1, 1, op="call_method"),
    "const_data_ptr": _call("const_data_ptr", X, op="call_method"),
    "mutable_data_ptr": _call("mutable_data_ptr", X, op="call_method"),
    "as_strided": _call("torch.as_strided", X, {"tuple": [10]}, {"tuple": [100000]}),
    "as_strided_method": _call("as_strided_", X, {"tuple": [10]}, {"tuple": [1]}, 100000, op="call_method"),
    "as_strided_aten": _call("torch.ops.aten.as_strided.default", X, [10], [1]),
    "resize_": _call("resize_", X, {"tuple": [1 << 40]}, op="call_method"),
    "resize_as_": _call("torch.resize_as_", X, X),
    "set_aten": _call("torch.ops.aten.set_.source_Tensor", X, X),
    "set_functional_aten": _call("torch.ops.aten.set.source_Tensor", X, X),
    "sparse_indices_alias": _call("indices", X, op="call_method"),
    "sparse_col_indices_alias": _call("torch.ops.aten.col_indices.default", X),
    "crow_indices_alias": _call("crow_indices", X, op="call_method"),
    "segment_reduce": _call("torch.segment_reduce", X, "max", offsets=X),
    "embedding_dense_backward": _call("torch.ops.aten.embedding_dense_backward.default", X, X, 4, -1, False),
    "fbgemm": _call("torch.fbgemm_linear_fp16_weight", X, X, X),
    "mkldnn": _call("torch.mkldnn_max_pool2d", X, [2, 2]),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_memory_unsafe_ops_are_refused_naming_the_family(name: str) -> None:
    graph = graph_from_dict(_graph(("evil", REFUSED[name])), f"{name}.json")
    with pytest.raises(GraphFormatError, match=r"node evil .*is not allowed in a graph file"):
        loader.check_graph(graph)


def test_the_issue_sparse_exploit_is_refused_before_anything_runs() -> None:
    graph = graph_from_dict(_graph(("sp", REFUSED["sparse_coo_tensor"]), ("out", _call("torch.add", X, {"node": "sp"}))),
                            "sparse.json")
    with pytest.raises(GraphFormatError, match=r"node sp .*torch.sparse_coo_tensor.*not memory-safe.*sparse"):
        build_stages(graph, Plan((StagePlan(0, tuple(graph.topological_order), ranks=(0,)),)))


def test_a_stage_that_can_make_sparse_values_runs_with_invariant_checks() -> None:
    graph = graph_from_dict(_graph(("sp", _call("to_sparse", X, op="call_method")),
                                   ("out", _call("to_dense", {"node": "sp"}, op="call_method"))), "to_sparse.json")
    was = torch.sparse.check_sparse_tensor_invariants.is_enabled()
    try:
        torch.sparse.check_sparse_tensor_invariants.disable()
        (stage,) = build_stages(graph, Plan((StagePlan(0, tuple(graph.topological_order), ranks=(0,)),)))
        assert torch.sparse.check_sparse_tensor_invariants.is_enabled()
        x = torch.zeros(2, 128)
        x[1, 5] = 3.0
        (out,) = stage(x)
        assert torch.equal(out, x)
        with pytest.raises(RuntimeError, match="out of bounds|index"):  # what the checks catch, now on
            torch.sparse_coo_tensor([[0], [100000000]], [7.0], (2, 128))
    finally:
        (torch.sparse.check_sparse_tensor_invariants.enable if was else torch.sparse.check_sparse_tensor_invariants.disable)()


def test_ordinary_ops_are_still_admitted() -> None:
    for path in ("torch.relu", "torch.add", "operator.getitem", "builtins.len", "math.sqrt",
                 "torch.ops.aten.linear.default", "torch.ops.aten.index.Tensor", "torch.nn.functional.embedding"):
        assert loader.function_target(path) is not None
    for method in ("view", "to_sparse", "index_select", "__getitem__", "size"):
        assert loader.check_method(method, "t") == method


def test_a_served_job_with_the_sparse_exploit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's served job is a graph from the network: the worker vets it like a file."""
    from model_parallel.cli.served_job import fetch_served_job
    from model_parallel.cli.worker import build_parser
    from model_parallel.coordinator import client

    data = _graph(("sp", REFUSED["sparse_coo_tensor"]), ("out", _call("torch.add", X, {"node": "sp"})))
    plan = Plan((StagePlan(0, ("x", "sp", "out"), ranks=(0,)),))
    monkeypatch.setattr(client, "fetch_job", lambda *a, **k: ({"graph": data, "plan": plan.to_dict(), "train": {}}, b"t"))
    argv = ["--rank", "0", "--coordinator", "127.0.0.1:1"]
    parser = build_parser()
    with pytest.raises(GraphFormatError, match=r"node sp .*torch.sparse_coo_tensor.*not memory-safe"):
        fetch_served_job(argv, parser.parse_args(argv), parser)
