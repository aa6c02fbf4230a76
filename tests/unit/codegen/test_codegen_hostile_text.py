"""A generated package never runs text from the graph file: hostile ids, names and metadata render inert.

Every string the generator writes that came from a file must reach the source as a checked Python
identifier or a `repr()` literal. Each case below puts a payload that would create a sentinel file
into one field of a small two-stage graph (ids at the stage edges, model inputs and outputs, layer
targets, tied parameter names, constant names, descriptions, every metadata field, the file name the
header quotes), generates the package, checks the files are only docstrings, imports and definitions,
then imports the package and runs it: the sentinel must not exist.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from model_parallel.codegen.package import generate_package, load_package
from model_parallel.errors import ModelParallelError
from model_parallel.graph.json_format import graph_from_dict
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.optimizer.convert_graph_to_model import main as convert_main

torch.set_num_threads(1)


def payloads(sentinel: Path) -> dict[str, str]:
    """Texts that run `open(sentinel, 'w')` if printed raw into a docstring, a comment or a string."""
    s = str(sentinel)
    return {
        "docstring_break": f'z"""if(open("{s}","w").write("pwned"))else"""',  # the issue's id: no spaces
        "single_quotes": f"z'''if(open('{s}','w').write('pwned'))else'''",
        "newline": f"z\nopen({s!r},'w').write('pwned')\n#",
        "backslash_quote": f'z\\"""\nopen("{s}","w")\n"""',
        "carriage_return": f"z\ropen({s!r},'w')\r#",
    }


def graph_dict(ids: dict[str, str], text: str) -> dict[str, Any]:
    """x -> lin (Linear) -> relu -> cst (get_attr constant) -> add: stages 0 = x, lin; 1 = relu, cst, add."""
    x, lin, relu, cst, add = ids["x"], ids["lin"], ids["relu"], ids["cst"], ids["add"]
    meta = [{"shape": [2, 4], "dtype": "float32"}]
    nodes = [
        (x, "Input0", {"op": "placeholder", "target": ids["x_target"], "outputs": meta}),
        (lin, text, {"op": "call_module", "target": ids["lin_target"], "args": [{"node": x}],
                     "module": "torch.nn.Linear(4, 4)", "outputs": meta,
                     "parameters": [f"{ids['lin_target']}.weight", f"{ids['lin_target']}.bias"]}),
        (relu, text, {"op": "call_function", "target": "torch.relu", "args": [{"node": lin}], "outputs": meta}),
        (cst, text, {"op": "get_attr", "target": ids["cst_target"], "outputs": meta}),
        (add, text, {"op": "call_function", "target": "operator.add", "args": [{"node": relu}, {"node": cst}],
                     "outputs": meta}),
    ]
    return {
        "schema": "model_parallel.graph", "version": 1,
        "metadata": {"outputs": {"dict": {text: {"node": add}, "plain": text}}, "model": text, "model_class": text,
                     "arch": "hostile", text: text, "inputs": [{"name": text, "shape": [2, 4], "dtype": "float32"}],
                     "constants": {ids["cst_target"]: {"shape": [2, 4], "dtype": "float32", "values": [0.5] * 8}}},
        "nodes": [{"id": i, "description": d, "forward_ms": 1.0, "backward_ms": 1.0, "activation_size": 32.0,
                   "parameter_size": 80.0 if i == lin else 0.0, "stage_id": 0 if i in (x, lin) else 1, "layer": layer}
                  for i, d, layer in nodes],
        "edges": [[x, lin], [lin, relu], [relu, add], [cst, add]],
    }


PLAIN = {"x": "x", "lin": "lin", "relu": "relu", "cst": "cst", "add": "add",
         "x_target": "x", "lin_target": "lin", "cst_target": "cst"}
FIELDS = ["x", "lin", "relu", "cst", "add", "x_target", "lin_target", "cst_target"]


def cases(sentinel: Path) -> list[tuple[str, dict[str, str], str]]:
    """(name, ids, free text) with one payload in one field; the free text goes into descriptions and metadata."""
    found = []
    for kind, payload in payloads(sentinel).items():
        for name in FIELDS:
            found.append((f"{name}-{kind}", {**PLAIN, name: payload}, "plain text"))
        found.append((f"text-{kind}", PLAIN, payload))
    return found


CASE_NAMES = [name for name, _, _ in cases(Path("/x"))]


def _inert(source: str, path: Path) -> None:
    """Only a docstring, imports, classes and functions at module level; class bodies hold only functions."""
    tree = ast.parse(source, str(path))
    for index, statement in enumerate(tree.body):
        if index == 0 and isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue
        assert isinstance(statement, (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef)), \
            f"{path.name}: top-level {ast.dump(statement)[:200]}"
        if isinstance(statement, (ast.ClassDef, ast.FunctionDef)):
            assert not statement.decorator_list, f"{path.name}: a decorator runs on import"
        if isinstance(statement, ast.ClassDef):
            assert all(isinstance(s, ast.FunctionDef) and not s.decorator_list and not s.args.defaults
                       for s in statement.body), f"{path.name}: class {statement.name} body runs code on import"
            assert [ast.unparse(b) for b in statement.bases] == ["torch.nn.Module"], f"{path.name}: bases"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_hostile_text_renders_inert(name: str, tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    _, ids, text = next(c for c in cases(sentinel) if c[0] == name)
    try:
        graph = graph_from_dict(graph_dict(ids, text), f"{name}.json")
    except ModelParallelError as error:  # refused as bad input: fine, as long as nothing ran and it says so
        assert "node" in str(error) or "id" in str(error), error
        assert not sentinel.exists()
        return
    plan = Plan((StagePlan(0, tuple(graph.stage_node_ids(0)), ranks=(0,)),
                 StagePlan(1, tuple(graph.stage_node_ids(1)), ranks=(1,))))
    source = f"{tmp_path}/{text}.json" if name.startswith("text-") else "graph.json"
    try:
        out = generate_package(graph, plan, tmp_path / "pkg", "Hostile", "hostile", graph_source=source)
    except ModelParallelError as error:
        assert not sentinel.exists(), error
        return
    for path in sorted(out.glob("*.py")):
        _inert(path.read_text(), path)
    package = load_package(out)
    assert not sentinel.exists(), "importing the generated package ran code from the graph file"
    stage0, stage1 = (module for module, _, _ in package.stages[:2])
    with torch.no_grad():
        stage1(*stage0(torch.ones(2, 4)))
    full = package.module.full_model()
    with torch.no_grad():
        full(torch.ones(2, 4))
    assert not sentinel.exists(), "running the generated package ran code from the graph file"


def test_converter_with_the_issue_id_writes_inert_code(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The issue's exploit through convert_graph_to_model.py: exit 0 or 2, and loading runs nothing."""
    sentinel = tmp_path / "pwned"
    ids = {**PLAIN, "lin": payloads(sentinel)["docstring_break"]}
    (tmp_path / "graph.json").write_text(json.dumps(graph_dict(ids, "plain text")))
    code = convert_main(["-f", str(tmp_path / "graph.json"), "-n", "Hostile", "-a", "hostile", "-o", str(tmp_path / "pkg")])
    assert code in (0, 2)
    if code == 0:
        load_package(tmp_path / "pkg")
    assert not sentinel.exists()


def test_nul_and_control_characters_in_ids_are_refused() -> None:
    for bad in ("a\x00b", "a\x1bb", "a\x7fb"):
        data = graph_dict({**PLAIN, "relu": bad}, "plain text")
        with pytest.raises(ModelParallelError, match=r"node id .* printable"):
            graph_from_dict(data, "g.json")


@pytest.mark.parametrize("kind", sorted(payloads(Path("/x"))))
def test_a_hostile_tied_parameter_name_stays_in_its_comment(kind: str, tmp_path: Path) -> None:
    """A get_attr of a module's weight is a tie; generated code restores it with a commented line naming it."""
    sentinel = tmp_path / "pwned"
    target = payloads(sentinel)[kind]
    meta = [{"shape": [2, 4], "dtype": "float32"}]
    nodes = [("x", {"op": "placeholder", "target": "x", "outputs": meta}),
             ("lin", {"op": "call_module", "target": target, "args": [{"node": "x"}], "module": "torch.nn.Linear(4, 4)",
                      "outputs": meta, "parameters": [f"{target}.weight", f"{target}.bias"]}),
             ("w", {"op": "get_attr", "target": f"{target}.weight", "outputs": [{"shape": [4, 4], "dtype": "float32"}]}),
             ("out", {"op": "call_function", "target": "torch.matmul", "args": [{"node": "lin"}, {"node": "w"}]})]
    data = {"schema": "model_parallel.graph", "version": 1, "metadata": {"outputs": {"node": "out"}},
            "nodes": [{"id": i, "description": "d", "forward_ms": 1.0, "backward_ms": 1.0, "activation_size": 32.0,
                       "parameter_size": 80.0 if i == "lin" else 0.0, "stage_id": 0, "layer": layer} for i, layer in nodes],
            "edges": [["x", "lin"], ["lin", "out"], ["w", "out"]]}
    graph = graph_from_dict(data, "tied.json")
    try:
        out = generate_package(graph, Plan((StagePlan(0, tuple(graph.topological_order), ranks=(0,)),)),
                               tmp_path / "pkg", "Tied", "tied")
    except ModelParallelError as error:  # a target with a line break is refused by the loader, naming the node
        assert "not allowed in a graph file" in str(error) and not sentinel.exists()
        return
    source = (out / "stage0.py").read_text()
    assert "# tied: one tensor" in source
    _inert(source, out / "stage0.py")
    (stage, _, _), _ = load_package(out).stages
    with torch.no_grad():
        stage(torch.ones(2, 4))
    assert not sentinel.exists()
