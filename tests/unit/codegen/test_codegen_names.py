"""Node ids and targets as Python names: distinct per graph, never a keyword or a module attribute (graph/names.py).

Before, `x.y` and `x_y` both became `self.x_y` (one layer dropped, the other applied twice, exit 0), and
ids like `self`, `forward`, `class` broke the generated package or the stages the runtime builds."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from model_parallel.cli.common import run_cli
from model_parallel.codegen.build import build_stages, full_model_from_graph
from model_parallel.codegen.naming import original_state_from_stage, stage_state_from_original, state_key_map
from model_parallel.codegen.package import load_package
from model_parallel.graph.core import Graph, LayerSpec, Node
from model_parallel.graph.names import unique_names
from model_parallel.optimizer.convert_graph_to_model import main as convert_main

torch.set_num_threads(1)

COSTS = "forward_compute_time=1.0, backward_compute_time=2.0, activation_size=2048.0, parameter_size=576.0"


def test_ordinary_names_map_as_before() -> None:
    targets = ["layer1.0.conv1", "fc", "5", "node12", "transformer.h.0.attn"]
    assert unique_names(targets) == {"layer1.0.conv1": "layer1_0_conv1", "fc": "fc", "5": "_5", "node12": "node12",
                                     "transformer.h.0.attn": "transformer_h_0_attn"}


def test_colliding_names_get_distinct_ones_whatever_the_order() -> None:
    keys = ["x.y", "x_y", "5", "_5", "x_y_1", "a.b_c", "a_b.c"]
    names = unique_names(keys)
    assert len(set(names.values())) == len(keys)
    assert names["x_y"] == "x_y" and names["_5"] == "_5"  # the key that is its own name keeps it
    assert names["x_y_1"] == "x_y_1" and names["x.y"] == "x_y_2"  # a numbered variant skips a taken name
    for _ in range(5):
        random.shuffle(keys)
        assert unique_names(keys) == names


@pytest.mark.parametrize("key", ["self", "class", "import", "forward", "_modules", "register_buffer", "graph",
                                 "training", "input_names", "__x"])
def test_reserved_names_are_renamed(key: str) -> None:
    name = unique_names([key])[key]
    assert name.isidentifier() and name != key and not name.startswith("__")
    assert unique_names([key], attributes=False)[key] != key or key not in ("self", "class", "import", "__x")


def test_the_old_state_key_collision_gets_distinct_keys() -> None:
    def node(node_id: str, target: str, src: str) -> Node:
        return Node(node_id, "Linear", layer=LayerSpec(op="call_module", target=target, args=({"node": src},),
                                                       module="torch.nn.Linear(2, 2)", parameters=(f"{target}.weight",)))
    graph = Graph(nodes=(Node("x", "Input0", layer=LayerSpec(op="placeholder", target="x")),
                         node("a", "a.b_c", "x"), node("b", "a_b.c", "a")), edges=(("x", "a"), ("a", "b")))
    mapping = state_key_map(graph)
    assert mapping == {"a.b_c.weight": "a_b_c.weight", "a_b.c.weight": "a_b_c_1.weight"}
    state = {"a.b_c.weight": torch.ones(2, 2), "a_b.c.weight": torch.zeros(2, 2)}
    assert original_state_from_stage(graph, stage_state_from_original(graph, state)).keys() == state.keys()


def _graph_txt(ids: list[str], path: Path) -> Path:
    """Input -> Linear(8, 16) -> ids[0] .. ids[-1] (each Linear(16, 16)) -> Linear(16, 4), one stage."""
    chain = ["n1", "a", *ids, "z"]
    described = ["Input0", "Linear(8, 16)", *["Linear(16, 16)"] * len(ids), "Linear(16, 4)"]
    lines = [f"{n} -- {d} -- {COSTS} -- stage_id=0" for n, d in zip(chain, described)]
    lines += [f"\t{a} -- {b}" for a, b in zip(chain, chain[1:])]
    path.write_text("\n".join(lines) + "\n")
    return path


def _by_hand(ids: list[str], original: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for layer in ["a", *ids, "z"]:  # every layer once, in order, with its own weights
        x = nn.functional.linear(x, original[f"{layer}.weight"], original[f"{layer}.bias"])
    return x


@pytest.mark.parametrize("ids", [["x.y", "x_y"], ["5", "_5"], ["self", "forward", "_modules", "register_buffer"],
                                 ["class", "import", "graph", "training"]])
def test_generated_package_and_runtime_stages_keep_every_layer(ids: list[str], tmp_path: Path) -> None:
    graph_txt = _graph_txt(ids, tmp_path / "graph.txt")
    assert convert_main(["-f", str(graph_txt), "-n", "M", "-a", "m", "-o", str(tmp_path / "pkg")]) == 0
    package = load_package(tmp_path / "pkg")
    full = package.module.full_model()
    assert len([m for m in full.modules() if isinstance(m, nn.Linear)]) == len(ids) + 2
    x = torch.randn(2, 8)
    original = original_state_from_stage(package.graph, full.stage0.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(full(x), _by_hand(ids, original, x))
    # The runtime builds the same stages in memory from the package's graph.json (no generated source).
    graph = package.graph
    for built in (build_stages(graph, {n.node_id: 0 for n in graph.nodes})[0], full_model_from_graph(graph)):
        built.load_state_dict(stage_state_from_original(graph, original), strict=True)
        with torch.no_grad():
            out = built(x)
        torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, _by_hand(ids, original, x))


@pytest.mark.parametrize("class_name", ["Stage0", "Stage1", "model", "full_model"])
def test_a_class_name_the_package_already_uses_is_refused(class_name: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """`-n Stage0` made the composed class shadow the stage class: Stage0() recursed forever."""
    graph_txt = _graph_txt(["b"], tmp_path / "graph.txt")
    text = graph_txt.read_text().replace("z -- Linear(16, 4) -- " + COSTS + " -- stage_id=0",
                                         "z -- Linear(16, 4) -- " + COSTS + " -- stage_id=1")
    graph_txt.write_text(text)
    with pytest.raises(SystemExit) as exited:
        run_cli(convert_main, ["-f", str(graph_txt), "-n", class_name, "-a", "m", "-o", str(tmp_path / "pkg")])
    assert exited.value.code == 2
    assert re.search(rf"class name \(-n\) '{class_name}' is a name the generated package already uses "
                     r"\(Stage0, Stage1, torch, arch, model, full_model\)", capsys.readouterr().err)
    assert not (tmp_path / "pkg").exists()
