"""Stage modules printed as readable Python source: a class per stage, the composed model, the package's __init__."""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from model_parallel.codegen.boundary import is_model_input, model_output_ids
from model_parallel.codegen.build import StageModule
from model_parallel.codegen.ties import tie_lines
from model_parallel.errors import CodegenError
from model_parallel.graph.arguments import CONSTANTS, decode_argument, decode_constant
from model_parallel.graph.core import Graph
from model_parallel.graph.loader import parse_constructor

log = logging.getLogger(__name__)

_FREE_SUFFIX = re.compile(r";\s+[\w\s=]+= None$")  # fx's `;  a = b = None` (frees memory early)
_ASSIGNMENT = re.compile(r"^(\s*)(\w+) = ")


def _shape_comment(meta: Any) -> str:
    outputs = meta.get("outputs") or ()
    if meta.get("comment"):
        return f"  # {meta['comment']}"
    if not outputs:
        return ""
    shapes = ", ".join(str(tuple(o.shape)) + ("" if o.dtype == "float32" else f" {o.dtype}") for o in outputs)
    return f"  # {shapes}"


def _import_lines(globals_: Mapping[str, Any], body: str) -> list[str]:
    """Imports for the globals fx's printed code really uses (fx always offers inf, nan, device, ...)."""
    lines = {"import torch"}
    for name, value in globals_.items():
        # A use is the bare name: not an attribute (`x.device`) nor a keyword argument (`device=...`).
        if name in ("__builtins__", "torch") or not re.search(rf"(?<![\w.]){re.escape(name)}\b(?!\s*=[^=])", body):
            continue
        if isinstance(value, ModuleType):
            lines.add(f"import {value.__name__}" if value.__name__ == name else f"import {value.__name__} as {name}")
        elif name in ("inf", "nan"):
            lines.add(f"from math import {name}")
        elif name == "NoneType":
            lines.add("from types import NoneType")
        elif getattr(__import__("builtins"), name, None) is value:
            continue
        else:
            module = getattr(value, "__module__", None) or ""
            module = "operator" if module == "_operator" else module
            qualname = getattr(value, "__qualname__", name)
            if not module or "." in qualname:
                raise CodegenError(f"generated code would need {name!r} ({value!r}), which cannot be imported by name")
            lines.add(f"from {module} import {qualname}" + ("" if qualname == name else f" as {name}"))
    return sorted(lines, key=lambda line: (not line.startswith("import "), line))


def _constructor_lines(graph: Graph, stage: StageModule) -> list[str]:
    """`self.<name> = <constructor>` for every layer the stage holds, in first-use order."""
    lines: list[str] = []
    seen: set[str] = set()
    for node_id in stage.node_ids:
        layer = graph[node_id].layer
        if layer is None or layer.op not in ("call_module", "get_attr"):
            continue
        name = graph.attribute_names[layer.target]
        if name in seen:
            continue
        seen.add(name)
        if layer.op == "call_module":
            if layer.module is None:
                raise CodegenError(
                    f"node {node_id}: module {layer.target!r} has no constructor expression, so it cannot be written "
                    "as source; build this stage in memory with build_stage(..., source_model=model) instead"
                )
            # Re-printed from the checked parse, so only `dotted.Class(<literals>)` reaches the source.
            lines.append(f"self.{name} = {parse_constructor(layer.module, f'node {node_id}').source}")
            continue
        tensor = getattr(stage, name)
        constant = (graph.metadata.get(CONSTANTS) or {}).get(layer.target)
        if constant is not None:  # no state dict carries it: its value is written into the source
            if "values" not in constant:
                raise CodegenError(f"node {node_id}: constant {layer.target!r} is too large to be stored in the graph, so "
                                   "it cannot be written as source; build this stage in memory with "
                                   "build_stage(..., source_model=model) instead")
            values = decode_constant(constant, f"node {node_id}: constant {layer.target!r}")
            literal = f"torch.tensor({values.reshape(-1).tolist()!r}, dtype={values.dtype}).reshape({tuple(values.shape)!r})"
            lines.append(f"self.register_buffer({name!r}, {literal}, persistent=False)  # a constant of the model")
            continue
        empty = f"torch.empty({tuple(tensor.shape)!r}, dtype={tensor.dtype})"
        if isinstance(tensor, torch.nn.Parameter):
            lines.append(f"self.{name} = torch.nn.Parameter({empty})  # loaded from the state dict")
        else:
            lines.append(f"self.register_buffer({name!r}, {empty})  # loaded from the state dict")
    return lines


def render_forward(stage: StageModule) -> tuple[list[str], dict[str, Any]]:
    """The `forward` method's lines (indented one level) printed by fx, plus the globals it uses."""
    code = stage.graph.python_code(root_module="self")
    fx_nodes = {n.name: n for n in stage.graph.nodes}
    lines = []
    for raw in code.src.strip("\n").splitlines():
        line = _FREE_SUFFIX.sub("", raw.rstrip())
        if not line.strip():
            continue
        match = _ASSIGNMENT.match(line)
        if match and match.group(2) in fx_nodes:
            line += _shape_comment(fx_nodes[match.group(2)].meta)
        lines.append("    " + line)
    return lines, code.globals


def _docstring(first: str, *rest: str) -> str:
    """A module docstring; as a `repr()` literal when the text could end a triple-quoted string or hide a line
    (a quote, a backslash, a control character: a file name the header quotes may hold any of them)."""
    text = "\n".join((first, "", *rest)).rstrip() + "\n"
    if '"' in text or "\\" in text or not all(c == "\n" or c.isprintable() for c in text):
        return repr(text)
    return '"""' + text + '"""'


def render_stage(graph: Graph, stage: StageModule, index: int, class_name: str, header: str) -> str:
    forward, globals_ = render_forward(stage)
    body = "\n".join(forward)
    # Node ids come from the file: the docstring names them as the identifiers the code uses.
    names = graph.variable_names
    span = (f"{names[stage.node_ids[0]]} .. {names[stage.node_ids[-1]]}" if stage.node_ids
            else "no nodes (passes values through)")
    constructors = _constructor_lines(graph, stage)
    init = ["    def __init__(self):", "        super().__init__()"] + [
        f"        {c}" for c in constructors + tie_lines(graph, stage.node_ids)]
    # Layers from outside torch (torchvision, the model's own module) need their module imported.
    modules = {c.partition(" = ")[2].partition("(")[0].rpartition(".")[0] for c in constructors if " = " in c}
    imports = _import_lines(globals_, body) + sorted(f"import {m}" for m in modules if m and m.split(".")[0] != "torch")
    parts = [
        _docstring(
            f"Stage {index} of {class_name}: {len(stage.node_ids)} nodes, {span}.",
            header,
            f"Takes {', '.join((names[n] for n in stage.input_names)) or 'nothing'}; "
            f"returns {', '.join((names[n] for n in stage.output_names)) or 'nothing'}.",
            *(["Shapes in comments are at the profiled batch size."] if "  # (" in body else []),
        ),
        "\n".join(imports),
        "",
        f"class Stage{index}(torch.nn.Module):",
        "\n".join(init),
        "",
        body,
    ]
    return "\n".join(parts) + "\n"


class _Name(str):
    """A variable name that prints without quotes (renders decoded output structures as source)."""

    def __repr__(self) -> str:
        return str(self)


def render_composed(graph: Graph, stages: Sequence[StageModule], class_name: str, arch: str, header: str) -> str:
    inputs = [n for n in graph.topological_order if is_model_input(graph[n])]
    names = graph.variable_names  # distinct: two stage outputs never land in one variable
    lines = [
        _docstring(f"{class_name}: the {len(stages)} stage(s) of {arch} composed; returns what the original model returns.", header),
        "import torch",
        "",
        *[f"from .stage{i} import Stage{i}" for i in range(len(stages))],
        "",
        "",
        f"class {class_name}(torch.nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
        *[f"        self.stage{i} = Stage{i}()" for i in range(len(stages))],
        "",
        f"    def forward(self, {', '.join(names[n] for n in inputs)}):",
    ]
    for index, stage in enumerate(stages):
        call = f"self.stage{index}({', '.join(names[n] for n in stage.input_names)})"
        outputs = ", ".join(names[n] for n in stage.output_names)
        if len(stage.output_names) == 1:
            lines.append(f"        ({outputs},) = {call}")
        else:
            lines.append(f"        {outputs} = {call}" if outputs else f"        {call}")
    encoded = graph.metadata.get("outputs")
    if encoded is None:
        result: Any = tuple(_Name(names[o]) for o in model_output_ids(graph))
    else:
        result = decode_argument(encoded, lambda ref: _Name(names[ref]))
    lines.append(f"        return {result!r}")
    return "\n".join(lines) + "\n"


def render_init(stages: Sequence[StageModule], class_name: str, arch: str, header: str) -> str:
    entries = [f"        (Stage{i}(), {list(s.input_names)!r}, {list(s.output_names)!r})," for i, s in enumerate(stages)]
    last_outputs = list(stages[-1].output_names)
    lines = [
        _docstring(f"{arch} split into {len(stages)} pipeline stage(s): the PipeDream package interface.", header),
        f"from .{arch} import {class_name}",
        *[f"from .stage{i} import Stage{i}" for i in range(len(stages))],
        "",
        "",
        "def arch():",
        f"    return {arch!r}",
        "",
        "",
        "def model(criterion):",
        '    """[(module, input names, output names), ...]: the stages, then the criterion producing "loss"."""',
        "    return [",
        *entries,
        f"        (criterion, {last_outputs!r}, ['loss']),",
        "    ]",
        "",
        "",
        "def full_model():",
        f"    return {class_name}()",
    ]
    return "\n".join(lines) + "\n"


def format_source(source: str) -> str:
    """Format with black when it is installed (pinned in requirements.txt); the source is already tidy otherwise."""
    try:
        import black
    except ImportError:
        return source
    try:
        return black.format_str(source, mode=black.Mode(line_length=120))
    except Exception as error:  # black's parse errors: the source is still valid Python, keep it unformatted
        log.warning("black could not format generated code (%s); writing it unformatted", error)
        return source
