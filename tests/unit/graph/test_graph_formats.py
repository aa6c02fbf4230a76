"""graph.txt and graph.json: the reference profiles parse and round-trip; bad input names file:line."""
from __future__ import annotations

from pathlib import Path

import pytest

from model_parallel.errors import GraphFormatError
from model_parallel.graph.core import Graph, LayerSpec, Node, TensorMeta
from model_parallel.graph.io import load_graph, save_graph
from model_parallel.graph.json_format import graph_from_dict, graph_to_dict, read_graph_json
from model_parallel.graph.pipedream_format import format_graph_txt, parse_graph_txt, read_graph_txt
from support import REFERENCE_PROFILES as REFERENCE

REFERENCE_FILES = sorted(REFERENCE.glob("*.graph.txt"))

GOOD = "a -- Input0 -- forward_compute_time=0.0, backward_compute_time=0.0, activation_size=12.0, parameter_size=0.0"
COSTS = "forward_compute_time=1.5, backward_compute_time=2.0, activation_size=8.0, parameter_size=4.0"


def test_reference_profiles_are_present():
    names = {p.name for p in REFERENCE_FILES}
    assert {"vgg16.graph.txt", "resnet50.graph.txt", "gnmt.graph.txt", "toy_dag.graph.txt",
            "vgg16_partitioned_3stages.graph.txt"} <= names, f"missing reference profiles in {REFERENCE}"


@pytest.mark.parametrize("path", REFERENCE_FILES, ids=lambda p: p.name)
def test_reference_profile_round_trips_through_text(path: Path, tmp_path: Path):
    graph = read_graph_txt(path)
    written = tmp_path / "graph.txt"
    save_graph(graph, written, with_sidecar=False)
    again = read_graph_txt(written)
    assert again == graph
    # A second write is byte-identical: the text form is canonical after one pass.
    assert format_graph_txt(again) == written.read_text()


@pytest.mark.parametrize("path", REFERENCE_FILES, ids=lambda p: p.name)
def test_reference_profile_round_trips_through_json(path: Path, tmp_path: Path):
    graph = read_graph_txt(path)
    assert graph_from_dict(graph_to_dict(graph)) == graph
    save_graph(graph, tmp_path / "graph.json")
    assert read_graph_json(tmp_path / "graph.json") == graph


@pytest.mark.parametrize(
    "name, num_nodes, num_inputs",
    [("vgg16.graph.txt", 41, 1), ("resnet50.graph.txt", 177, 1), ("gnmt.graph.txt", None, 3), ("toy_dag.graph.txt", 6, 0)],
)
def test_reference_profile_shapes(name: str, num_nodes, num_inputs: int):
    graph = read_graph_txt(REFERENCE / name)
    if num_nodes is not None:
        assert len(graph) == num_nodes
    assert sum(node.is_input for node in graph.nodes) == num_inputs
    assert len(graph.topological_order) == len(graph)


def test_reference_resnet50_keeps_residual_branches():
    graph = read_graph_txt(REFERENCE / "resnet50.graph.txt")
    adds = [n for n in graph.nodes if n.description.startswith("Add")]
    assert len(adds) == 16, "resnet50 has 16 residual Add nodes"
    assert all(len(graph.predecessors[n.node_id]) == 2 for n in adds)


def test_partitioned_profile_keeps_stage_ids(tmp_path: Path):
    graph = read_graph_txt(REFERENCE / "vgg16_partitioned_3stages.graph.txt")
    assert graph.is_partitioned and graph.num_stages == 3
    stages = [n.stage_id for n in graph.nodes]
    assert stages.count(0) == 30 and stages.count(1) == 9 and stages.count(2) == 2
    save_graph(graph, tmp_path / "gpus=3.txt")
    again = load_graph(tmp_path / "gpus=3.txt")
    assert [n.stage_id for n in again.nodes] == stages
    assert all(line.endswith(f" -- stage_id={n.stage_id}")
               for line, n in zip((tmp_path / "gpus=3.txt").read_text().splitlines(), again.nodes))


def test_gnmt_activation_lists_survive(tmp_path: Path):
    graph = read_graph_txt(REFERENCE / "gnmt.graph.txt")
    lstm = graph["node7"]
    assert lstm.activation_size == (6291456.0, 131072.0, 131072.0)
    assert lstm.activation_bytes == 6291456.0 + 2 * 131072.0
    text = format_graph_txt(graph)
    assert "activation_size=[6291456.0; 131072.0; 131072.0]" in text
    save_graph(graph, tmp_path / "graph.txt")
    assert load_graph(tmp_path / "graph.txt")["node7"].activation_size == lstm.activation_size
    assert read_graph_json(tmp_path / "graph.json")["node7"].activation_size == lstm.activation_size


def test_numbers_with_any_precision_parse():
    graph = parse_graph_txt(
        "n1 -- Input0 -- forward_compute_time=0, backward_compute_time=0.000, activation_size=6291456.0, parameter_size=0\n"
        "n2 -- Conv2d(3, 8) -- forward_compute_time=17.972, backward_compute_time=1e-3, activation_size=1.5e6, parameter_size=864\n"
        "\tn1 -- n2\n"
    )
    assert graph["n2"].forward_ms == 17.972 and graph["n2"].backward_ms == 0.001
    assert graph["n2"].activation_size == 1.5e6 and graph["n2"].parameter_size == 864.0


def test_edge_order_gives_input_order():
    graph = parse_graph_txt(
        "\n".join([GOOD, f"b -- X -- {COSTS}", f"c -- Concat(1) -- {COSTS}", "\tb -- c", "\ta -- c", "\ta -- b"]) + "\n"
    )
    assert graph.predecessors["c"] == ("b", "a")
    assert graph.topological_order == ("a", "b", "c")
    assert graph.sources == ("a",) and graph.sinks == ("c",)


# ---- bad input: every error names the file and the line --------------------------------------------
BAD_INPUTS = [
    ("malformed line", f"{GOOD}\nb -- Conv2d\n", r"bad\.txt:2: expected '<id> -- <description> -- <costs>"),
    ("duplicate id", f"{GOOD}\n{GOOD}\n", r"bad\.txt:2: duplicate node id 'a' \(first defined on line 1\)"),
    ("edge to unknown node", f"{GOOD}\n\ta -- zzz\n", r"bad\.txt:2: edge a -- zzz names unknown node 'zzz'"),
    ("cycle", f"a -- X -- {COSTS}\nb -- Y -- {COSTS}\n\ta -- b\n\tb -- a\n", r"bad\.txt:[34]: graph has a cycle"),
    ("negative number", f"a -- X -- {COSTS.replace('1.5', '-1.5')}\n", r"bad\.txt:1: forward_compute_time=-1\.5 must be a finite number >= 0"),
    ("empty graph", "\n\n", r"bad\.txt: graph is empty"),
    ("non-number", f"a -- X -- {COSTS.replace('=4.0', '=four')}\n", r"bad\.txt:1: parameter_size='four' is not a number"),
    ("fields out of order", "a -- X -- backward_compute_time=1, forward_compute_time=1, activation_size=1, parameter_size=1\n",
     r"bad\.txt:1: costs must be 'forward_compute_time=<n>, backward_compute_time"),
    ("bad stage id", f"a -- X -- {COSTS} -- stage_id=-1\n", r"bad\.txt:1: expected 'stage_id=<non-negative integer>'"),
    ("malformed edge", f"{GOOD}\n\ta b\n", r"bad\.txt:2: expected an edge"),
    ("node after edges", f"{GOOD}\nb -- X -- {COSTS}\n\ta -- b\nc -- X -- {COSTS}\n", r"bad\.txt:4: node line after edge lines"),
    ("unclosed activation list", f"a -- X -- {COSTS.replace('=8.0', '=[1; 2')}\n", r"bad\.txt:1: activation_size list .* missing its closing"),
    ("empty activation entry", f"a -- X -- {COSTS.replace('=8.0', '=[1; ; 2]')}\n", r"bad\.txt:1: activation_size list .* has an empty entry"),
    ("infinite number", f"a -- X -- {COSTS.replace('=2.0', '=inf')}\n", r"bad\.txt:1: backward_compute_time=inf must be a finite number"),
]


@pytest.mark.parametrize("case, text, message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_graph_txt_names_file_and_line(case: str, text: str, message: str, tmp_path: Path):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(GraphFormatError, match=message):
        read_graph_txt(path)


def test_cycle_error_points_at_an_edge_of_the_cycle(tmp_path: Path):
    path = tmp_path / "bad.txt"
    path.write_text(f"a -- X -- {COSTS}\nb -- Y -- {COSTS}\nc -- Z -- {COSTS}\n\ta -- b\n\tb -- c\n\tc -- b\n")
    with pytest.raises(GraphFormatError, match=r"bad\.txt:(5|6): graph has a cycle: (b -> c -> b|c -> b -> c)"):
        read_graph_txt(path)


def test_missing_and_binary_files_are_format_errors(tmp_path: Path):
    with pytest.raises(GraphFormatError, match=r"nope\.txt: cannot read graph file"):
        read_graph_txt(tmp_path / "nope.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00graph")
    with pytest.raises(GraphFormatError, match=r"bin\.txt:1: not a text file"):
        read_graph_txt(tmp_path / "bin.txt")


def test_bad_graph_json_is_a_format_error(tmp_path: Path):
    path = tmp_path / "graph.json"
    path.write_text('{"schema": "model_parallel.graph", "version": 1,\n "nodes": [}')
    with pytest.raises(GraphFormatError, match=r"graph\.json:2: not valid JSON"):
        read_graph_json(path)
    path.write_text('{"schema": "something.else"}')
    with pytest.raises(GraphFormatError, match=r"not a model_parallel graph"):
        read_graph_json(path)
    path.write_text('{"schema": "model_parallel.graph", "version": 99, "nodes": [], "edges": []}')
    with pytest.raises(GraphFormatError, match=r"version 99 is not supported"):
        read_graph_json(path)
    path.write_text('{"schema": "model_parallel.graph", "version": 1, "nodes": [{"id": "a"}], "edges": []}')
    with pytest.raises(GraphFormatError, match=r"nodes\[0\]: malformed node"):
        read_graph_json(path)


def _rich_graph() -> Graph:
    conv = LayerSpec(op="call_module", target="conv", args=({"node": "x"},),
                     module="torch.nn.Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1))",
                     outputs=(TensorMeta((2, 8, 6, 6), "float32"),), parameters=("conv.weight", "conv.bias"))
    return Graph(
        nodes=(
            Node("x", "Input0", activation_size=384.0, layer=LayerSpec(op="placeholder", target="x", outputs=(TensorMeta((2, 3, 8, 8), "float32"),))),
            Node("conv", "Conv2d(3, 8)", 0.25, 0.5, 2304.0, 896.0, layer=conv),
            Node("split", "Tensor.split(4, 1)", 0.01, 0.0, (1152.0, 1152.0),
                 layer=LayerSpec(op="call_method", target="split", args=({"node": "conv"}, 4, 1),
                                 outputs=(TensorMeta((2, 4, 6, 6), "float32"),) * 2)),
        ),
        edges=(("x", "conv"), ("conv", "split")),
        metadata={"model": "Tiny", "outputs": {"node": "split"}, "inputs": [{"name": "x", "shape": [2, 3, 8, 8]}]},
    )


def test_layer_specs_and_metadata_round_trip_through_json_and_sidecar(tmp_path: Path):
    graph = _rich_graph()
    save_graph(graph, tmp_path / "graph.txt")  # writes graph.txt and the graph.json sidecar
    assert (tmp_path / "graph.json").exists()
    assert load_graph(tmp_path / "graph.json") == graph
    assert load_graph(tmp_path / "graph.txt") == graph
    plain = load_graph(tmp_path / "graph.txt", use_sidecar=False)
    assert all(n.layer is None for n in plain.nodes) and plain.metadata == {}


def test_sidecar_for_other_nodes_is_rejected(tmp_path: Path):
    graph = _rich_graph()
    save_graph(graph, tmp_path / "graph.txt")
    (tmp_path / "graph.txt").write_text(f"x -- Input0 -- {COSTS}\n")
    with pytest.raises(GraphFormatError, match=r"graph\.json: sidecar does not describe the same nodes"):
        load_graph(tmp_path / "graph.txt")


def test_a_worker_count_beyond_the_plan_limit_is_refused_before_the_optimizer():
    from model_parallel.errors import PlanError
    from model_parallel.graph.hierarchy import Hierarchy

    with pytest.raises(PlanError, match=r"-n 100000000 is more than 65536 workers in all"):
        Hierarchy.from_lists([100000000])
    with pytest.raises(PlanError, match=r"-n 300 300 is more than 65536"):
        Hierarchy.from_lists([300, 300], [1e9, 1e9])


@pytest.mark.parametrize("field, value, message", [
    ("args", [{"node": ["conv"]}], r"nodes\[2\]: a node reference is .*got \{\"node\": \"\['conv'\]\"\}"),
    ("args", [{"node": {"node": "conv"}}], r"nodes\[2\]: a node reference is"),
    ("kwargs", {"x": {"tuple": [{"node": 3}]}}, r"nodes\[2\]: a node reference is"),
    ("args", {"node": "conv"}, r"nodes\[2\]: malformed node .*layer 'args' must be a list, got dict"),
    ("kwargs", [["dim", 1]], r"nodes\[2\]: malformed node .*layer 'kwargs' must be an object, got list"),
    ("parameters", "conv.weight", r"nodes\[2\]: malformed node .*layer 'parameters' must be a list"),
    ("parameters", [{"a": 1}], r"nodes\[2\]: malformed node .*state-dict names \(strings\)"),
    ("module", 5, r"nodes\[2\]: malformed node .*layer 'module' must be a constructor expression or null"),
])
def test_graph_json_layer_fields_of_the_wrong_type_are_refused_when_read(field, value, message, tmp_path: Path):
    """A layer field of another JSON type was coerced (an object as `args` became its keys, `("node",)`, and the
    stage called `self.conv("node")`; a list of pairs became kwargs), and a reference whose id is a list or an
    object raised a bare TypeError (unhashable) in partition and generate: each is now refused naming file and node."""
    data = graph_to_dict(_rich_graph())
    data["nodes"][2]["layer"][field] = value
    with pytest.raises(GraphFormatError, match=message):
        graph_from_dict(data, "g.json")


def test_graph_json_model_outputs_must_reference_nodes_by_string():
    data = graph_to_dict(_rich_graph())
    data["metadata"]["outputs"] = {"node": ["split"]}
    with pytest.raises(GraphFormatError, match=r"g\.json: a node reference is .*got \{\"node\": \"\['split'\]\"\}"):
        graph_from_dict(data, "g.json")
    data["nodes"][2]["layer"] = ["call_method"]
    with pytest.raises(GraphFormatError, match=r"nodes\[2\]: malformed node .*a layer must be an object, got list"):
        graph_from_dict(data, "g.json")


def test_errors_on_ids_and_values_with_line_breaks_stay_one_line(tmp_path: Path):
    """An edge naming an unknown id with a line break (or an escape byte) printed it raw, splitting the one-line
    error; so did a layer field's value."""
    data = graph_to_dict(_rich_graph())
    data["edges"].append(["conv", "PWNED\r\nimport os"])
    with pytest.raises(GraphFormatError) as error:
        graph_from_dict(data, "g.json")
    assert str(error.value) == "g.json: edge conv -- 'PWNED\\r\\nimport os' names unknown node 'PWNED\\r\\nimport os'"
    data = graph_to_dict(_rich_graph())
    data["nodes"][2]["layer"]["kwargs"] = "a\nimport os"
    with pytest.raises(GraphFormatError, match=r"got str 'a\\nimport os'") as error:
        graph_from_dict(data, "g.json")
    assert "\n" not in str(error.value)
    with pytest.raises(GraphFormatError) as error:
        parse_graph_txt(f"{GOOD}\n\ta -- z\x1b[2J\n", "bad.txt")
    assert str(error.value) == "bad.txt:2: edge a -- 'z\\x1b[2J' names unknown node 'z\\x1b[2J'"
