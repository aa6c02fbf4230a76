"""Code generator units: naming, stage boundaries, inference from graph.txt, safety and error messages."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from model_parallel.codegen.boundary import StageBoundary, stage_boundaries
from model_parallel.codegen.build import StageModule, build_stage, build_stages
from model_parallel.codegen.infer import infer_layers
from model_parallel.codegen.naming import (
    layer_name,
    original_state_from_stage,
    stage_state_from_original,
    state_key,
)
from model_parallel.errors import CodegenError, GraphFormatError, PlanError
from model_parallel.graph.core import Graph, LayerSpec, Node
from model_parallel.graph.io import load_graph
from model_parallel.graph.pipedream_format import parse_graph_txt
from model_parallel.profiler.trace import trace_model

torch.set_num_threads(1)


# ---- naming -------------------------------------------------------------------------------------
def test_layer_and_state_names() -> None:
    assert layer_name("layer1.0.conv1") == "layer1_0_conv1"
    assert layer_name("5") == "_5"
    assert state_key("layer1.0.conv1.weight") == "layer1_0_conv1.weight"
    assert state_key("bias") == "bias"
    assert state_key("blocks.0.attn.out_proj.weight", owner="blocks.0.attn") == "blocks_0_attn.out_proj.weight"
    assert state_key("pos.emb", owner="pos.emb") == "pos_emb"
    with pytest.raises(CodegenError, match="does not belong to 'b'"):
        state_key("a.weight", owner="b")


def _layer_node(node_id: str, target: str, parameters: tuple[str, ...], src: str = "x") -> Node:
    layer = LayerSpec(op="call_module", target=target, args=({"node": src},), module="torch.nn.Linear(2, 2)",
                      parameters=parameters)
    return Node(node_id, "Linear(...)", layer=layer)


def _input(node_id: str = "x") -> Node:
    return Node(node_id, "Input0", layer=LayerSpec(op="placeholder", target=node_id))


def test_state_dict_round_trip_and_strictness() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    graph, _ = trace_model(model, (torch.randn(4, 2),))
    state = stage_state_from_original(graph, model.state_dict())
    assert set(state) == {"_0.weight", "_0.bias", "_1.weight", "_1.bias", "_1.running_mean", "_1.running_var",
                          "_1.num_batches_tracked"}
    assert original_state_from_stage(graph, state).keys() == model.state_dict().keys()
    with pytest.raises(CodegenError, match="'extra.weight' is not owned by any node"):
        stage_state_from_original(graph, {**model.state_dict(), "extra.weight": torch.zeros(1)})
    with pytest.raises(CodegenError, match="lacks 1 parameter"):
        stage_state_from_original(graph, {k: v for k, v in model.state_dict().items() if k != "0.bias"})
    with pytest.raises(CodegenError, match="'nope.weight' is not a parameter of any graph node"):
        original_state_from_stage(graph, {"nope.weight": torch.zeros(1)})


# ---- boundaries ---------------------------------------------------------------------------------
def _chain_with_skip() -> Graph:
    #  x -> a -> b -> c -> add(c, a)
    nodes = [_input()] + [Node(n, "ReLU()") for n in ("a", "b", "c")] + [Node("add", "Add")]
    edges = [("x", "a"), ("a", "b"), ("b", "c"), ("c", "add"), ("a", "add")]
    return Graph(tuple(nodes), tuple(edges))


def test_boundaries_pass_values_through_neighbours() -> None:
    graph = _chain_with_skip()
    stage_of = {"x": 0, "a": 0, "b": 1, "c": 2, "add": 3}
    assert stage_boundaries(graph, stage_of) == (
        StageBoundary(inputs=("x",), outputs=("a",)),
        StageBoundary(inputs=("a",), outputs=("a", "b")),
        StageBoundary(inputs=("a", "b"), outputs=("a", "c")),
        StageBoundary(inputs=("a", "c"), outputs=("add",)),
    )


def test_model_output_before_last_stage_is_passed_through() -> None:
    graph = Graph((_input(), Node("a", "ReLU()"), Node("b", "ReLU()")), (("x", "a"), ("x", "b")),
                  metadata={"outputs": {"tuple": [{"node": "a"}, {"node": "b"}]}})
    assert stage_boundaries(graph, {"x": 0, "a": 0, "b": 1}) == (
        StageBoundary(inputs=("x",), outputs=("x", "a")),
        StageBoundary(inputs=("x", "a"), outputs=("a", "b")),
    )


def test_backward_edge_is_a_plan_error() -> None:
    graph = _chain_with_skip()
    with pytest.raises(PlanError, match=r"edge b -> c goes from stage 1 back to stage 0"):
        stage_boundaries(graph, {"x": 0, "a": 0, "b": 1, "c": 0, "add": 1})
    with pytest.raises(PlanError, match=r"no stage given for 1 node"):
        stage_boundaries(graph, {"x": 0, "a": 0, "b": 0, "c": 0})


# ---- building -----------------------------------------------------------------------------------
def test_stage_module_interface_survives_deepcopy() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    graph, _ = trace_model(model, (torch.randn(4, 2),))
    stages = build_stages(graph, {"input_1": 0, "_0": 0, "_1": 1, "_2": 1})
    assert isinstance(stages[1], StageModule)
    assert (stages[1].input_names, stages[1].output_names, stages[1].node_ids) == (("_0",), ("_2",), ("_1", "_2"))
    clone = copy.deepcopy(stages[1])
    assert (clone.input_names, clone.output_names) == (("_0",), ("_2",))
    out = stages[1](torch.randn(4, 3))
    assert isinstance(out, tuple) and out[0].shape == (4, 1)


def test_shared_module_with_parameters_across_stages_is_an_error() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.relu(self.lin(x)))

    graph, _ = trace_model(Twice(), (torch.randn(1, 2),))
    order = graph.topological_order
    stage_of = {n: 0 if i < 2 else 1 for i, n in enumerate(order)}
    with pytest.raises(CodegenError, match=r"module 'lin' \(nodes lin, lin_1\) is used by stages \[0, 1\].*keep them in one stage"):
        build_stages(graph, stage_of)
    boundary = stage_boundaries(graph, stage_of)[1]
    with pytest.raises(CodegenError, match="keep them in one stage"):
        build_stage(graph, [n for n in order if stage_of[n] == 1], boundary)
    assert len(build_stages(graph, {n: 0 for n in order})) == 1  # in one stage it is fine


def _graph_calling(target: str, op: str = "call_function", module: str | None = None) -> Graph:
    layer = LayerSpec(op=op, target=target, args=({"node": "x"},), module=module)
    return Graph((_input(), Node("f", "F", layer=layer)), (("x", "f"),))


@pytest.mark.parametrize(
    "target,op,module",
    [
        ("os.system", "call_function", None),
        ("builtins.eval", "call_function", None),
        ("eval", "call_function", None),
        ("torch.load", "call_function", None),
        ("torch.__builtins__", "call_function", None),
        ("m", "call_module", "subprocess.Popen('ls')"),
    ],
)
def test_graph_files_cannot_call_arbitrary_code(target: str, op: str, module: str | None) -> None:
    graph = _graph_calling(target, op, module)
    with pytest.raises(GraphFormatError, match="is not allowed in a graph file"):
        build_stages(graph, {"x": 0, "f": 0})


def test_unsafe_tensor_method_is_refused() -> None:
    graph = _graph_calling("__reduce_ex__", op="call_method")
    with pytest.raises(GraphFormatError, match="tensor method '__reduce_ex__' is not allowed"):
        build_stages(graph, {"x": 0, "f": 0})


def test_module_without_constructor_needs_a_source() -> None:
    graph = _graph_calling("custom", op="call_module")
    with pytest.raises(CodegenError, match=r"node f .*has no constructor expression.*pass source_model="):
        build_stages(graph, {"x": 0, "f": 0})


def test_missing_input_names_the_boundary() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    graph, _ = trace_model(model, (torch.randn(4, 2),))
    with pytest.raises(CodegenError, match=r"needs 'input_1', which is neither computed earlier in this stage nor one of its inputs"):
        build_stage(graph, ["_0"], StageBoundary(inputs=(), outputs=("_0",)))


# ---- inference from graph.txt -------------------------------------------------------------------
_TXT = """node1 -- Input -- forward_compute_time=0, backward_compute_time=0, activation_size=0, parameter_size=0
node2 -- Conv2d(3, 4, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1)) -- forward_compute_time=0, backward_compute_time=0, activation_size=0, parameter_size=0
node3 -- ReLU(inplace) -- forward_compute_time=0, backward_compute_time=0, activation_size=0, parameter_size=0
node4 -- Add(inplace) -- forward_compute_time=0, backward_compute_time=0, activation_size=0, parameter_size=0
node5 -- Concat(1) -- forward_compute_time=0, backward_compute_time=0, activation_size=0, parameter_size=0
node6 -- Size(0) -- forward_compute_time=0, backward_compute_time=0, activation_size=0, parameter_size=0
node7 -- View(-1) -- forward_compute_time=0, backward_compute_time=0, activation_size=0, parameter_size=0
node8 -- Linear(in_features=512, out_features=2, bias=True) -- forward_compute_time=0, backward_compute_time=0, activation_size=0, parameter_size=0
\tnode1 -- node2
\tnode2 -- node3
\tnode3 -- node4
\tnode2 -- node4
\tnode4 -- node5
\tnode2 -- node5
\tnode5 -- node6
\tnode5 -- node7
\tnode6 -- node7
\tnode8 -- node8
"""


def test_infer_layers_from_descriptions() -> None:
    graph = infer_layers(parse_graph_txt(_TXT.replace("\tnode8 -- node8\n", "\tnode7 -- node8\n"), "toy.txt"))
    layers = {n.node_id: n.layer for n in graph.nodes}
    assert layers["node1"] == LayerSpec(op="placeholder", target="input0")
    assert layers["node3"].module == "torch.nn.ReLU(inplace=True)"
    assert layers["node2"].parameters == ("node2.weight", "node2.bias")
    assert layers["node4"] == LayerSpec(op="call_function", target="operator.add", args=({"node": "node3"}, {"node": "node2"}))
    assert layers["node5"].args == ([{"node": "node4"}, {"node": "node2"}], 1)
    assert layers["node7"] == LayerSpec(op="call_method", target="view", args=({"node": "node5"}, {"node": "node6"}, -1))
    assert graph.metadata["outputs"] == {"node": "node8"}
    (stage,) = build_stages(graph, {n.node_id: 0 for n in graph.nodes})
    assert stage(torch.randn(2, 3, 8, 8))[0].shape == (2, 2)


def test_unknown_description_names_node_and_line() -> None:
    text = _TXT.replace("ReLU(inplace)", "Frobnicate(3)").replace("\tnode8 -- node8\n", "\tnode7 -- node8\n")
    with pytest.raises(CodegenError, match=r"line 3: node node3 \('Frobnicate\(3\)'\): 'Frobnicate' is not a torch.nn module"):
        infer_layers(parse_graph_txt(text, "toy.txt"))


def test_gnmt_custom_modules_are_reported_unsupported(reference_profiles) -> None:
    graph = load_graph(reference_profiles / "gnmt.graph.txt")
    with pytest.raises(CodegenError, match=r"node node5 .*'EmuBidirLSTM' is not a torch.nn module.*not supported from graph.txt"):
        infer_layers(graph)
