"""Write a partitioned graph as an importable Python package (PipeDream's layout), and load one back.

    <out_dir>/stage0.py ...   class Stage0(torch.nn.Module): layers as attributes, forward over names
    <out_dir>/<arch>.py       class <ClassName>: the stages composed, returns the model outputs
    <out_dir>/__init__.py     arch(), model(criterion), full_model()
    <out_dir>/mp_conf.json, dp_conf.json, hybrid_conf.json   (docs/FORMATS.md)
    <out_dir>/graph.json, plan.json                          (rebuild any stage with build_stage)

The forward bodies are printed from the same fx graphs `build_stage` builds (with layers on the
meta device, so nothing is allocated), so the files and the in-memory stages cannot drift.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import keyword
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Union

import torch

from model_parallel.codegen.boundary import StageBoundary, is_model_input, model_output_ids, stage_boundaries
from model_parallel.codegen.build import (
    StageModule,
    ensure_layers,
    build_stage,
    check_layers,
    check_shared_modules,
    stage_assignment,
)
from model_parallel.codegen.naming import layer_name
from model_parallel.codegen.ties import check_ties, tie_lines
from model_parallel.errors import CodegenError, PlanError
from model_parallel.fileio import atomic_write_text
from model_parallel.graph.arguments import CONSTANTS, decode_argument, decode_constant
from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import read_graph_json, write_graph_json
from model_parallel.graph.loader import parse_constructor
from model_parallel.graph.plan import Plan, read_plan, write_plan

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
_FREE_SUFFIX = re.compile(r";\s+[\w\s=]+= None$")  # fx's `;  a = b = None` (frees memory early)
_ASSIGNMENT = re.compile(r"^(\s*)(\w+) = ")


# ---- configs ------------------------------------------------------------------------------------
def plan_with_replicas(plan: Plan, stage_to_num_ranks: Optional[Mapping[int, int]]) -> Plan:
    """The plan with `stage_to_num_ranks` replicas per stage and ranks 0.. assigned in stage order."""
    if not stage_to_num_ranks:
        return plan.with_default_ranks()
    unknown = sorted(set(stage_to_num_ranks) - set(range(plan.num_stages)))
    if unknown:
        raise PlanError(f"--stage_to_num_ranks names stage(s) {unknown} but the plan has stages 0..{plan.num_stages - 1}")
    stages = tuple(
        replace(s, num_replicas=int(stage_to_num_ranks.get(s.stage_id, s.num_replicas)), ranks=()) for s in plan.stages
    )
    return replace(plan, stages=stages).with_default_ranks()


def pipedream_configs(plan: Plan) -> dict[str, dict[str, Any]]:
    """mp_conf (one rank per stage), dp_conf (the whole model on every rank), hybrid_conf (the plan's replicas).

    Modules are the stages plus the criterion, which runs with the last stage.
    """
    num_stages = plan.num_stages
    module_to_stage = list(range(num_stages)) + [num_stages - 1]
    hybrid = {str(s): list(r) for s, r in plan.stage_to_ranks.items()}
    return {
        "mp_conf.json": {"module_to_stage_map": module_to_stage, "stage_to_rank_map": {str(s): [s] for s in range(num_stages)}},
        "dp_conf.json": {"module_to_stage_map": [0] * (num_stages + 1), "stage_to_rank_map": {"0": list(range(plan.num_ranks))}},
        "hybrid_conf.json": {"module_to_stage_map": module_to_stage, "stage_to_rank_map": hybrid},
    }


# ---- source rendering ---------------------------------------------------------------------------
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
        name = layer_name(layer.target)
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
    # Node ids come from the file: the docstring names them as the identifiers the code uses (layer_name).
    span = (f"{layer_name(stage.node_ids[0])} .. {layer_name(stage.node_ids[-1])}" if stage.node_ids
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
            f"Takes {', '.join(map(layer_name, stage.input_names)) or 'nothing'}; "
            f"returns {', '.join(map(layer_name, stage.output_names)) or 'nothing'}.",
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
        f"    def forward(self, {', '.join(layer_name(n) for n in inputs)}):",
    ]
    for index, stage in enumerate(stages):
        call = f"self.stage{index}({', '.join(layer_name(n) for n in stage.input_names)})"
        outputs = ", ".join(layer_name(n) for n in stage.output_names)
        if len(stage.output_names) == 1:
            lines.append(f"        ({outputs},) = {call}")
        else:
            lines.append(f"        {outputs} = {call}" if outputs else f"        {call}")
    encoded = graph.metadata.get("outputs")
    if encoded is None:
        result: Any = tuple(_Name(layer_name(o)) for o in model_output_ids(graph))
    else:
        result = decode_argument(encoded, lambda ref: _Name(layer_name(ref)))
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


# ---- the package -----------------------------------------------------------------------------------
def _check_identifier(value: str, what: str) -> None:
    if not value.isidentifier() or keyword.iskeyword(value) or re.fullmatch(r"stage\d+", value):
        raise CodegenError(f"{what} {value!r} must be a Python identifier (and not stageN), e.g. resnet152")


def generate_package(
    graph: Graph,
    plan: Plan,
    out_dir: PathLike,
    class_name: str,
    arch: str,
    stage_to_num_ranks: Optional[Mapping[int, int]] = None,
    *,
    graph_source: str = "<in memory>",
    plan_source: str = "<in memory>",
) -> Path:
    """Write the package for `graph` split by `plan` into `out_dir` (replaced atomically); returns `out_dir`."""
    _check_identifier(class_name, "class name (-n)")
    _check_identifier(arch, "arch (-a)")
    started = time.perf_counter()
    graph = ensure_layers(graph)
    check_layers(graph)  # a hostile graph is refused before any layer is built or any source printed
    plan = plan_with_replicas(plan, stage_to_num_ranks)
    stage_of = stage_assignment(graph, plan)
    boundaries = stage_boundaries(graph, stage_of)
    if len(boundaries) != plan.num_stages:
        raise PlanError(f"the plan has {plan.num_stages} stages but its nodes use stages 0..{len(boundaries) - 1}")
    check_shared_modules(graph, stage_of)
    check_ties(graph, stage_of, "a generated package's stages are separate modules (PipeDream's runtime does not "
                                "sum tied gradients; model_parallel's runtime does: train from graph.json instead)")
    unprintable = [n.node_id for n in graph.nodes if n.layer.op == "call_module" and n.layer.module is None]
    if unprintable:
        raise CodegenError(
            f"node(s) {', '.join(unprintable[:5])} run modules without a constructor expression (their repr is not "
            "their constructor), so they cannot be written as source; build those stages in memory with "
            "build_stage(..., source_model=model), or give the module an extra_repr() that rebuilds it"
        )
    header = f"Generated by model_parallel.codegen from graph {graph_source} and plan {plan_source}; do not edit."
    with torch.device("meta"):  # the layers are only printed: build them without memory or initialisation
        stages = [_stage(graph, stage_of, b, i) for i, b in enumerate(boundaries)]
    files = {f"stage{i}.py": render_stage(graph, s, i, class_name, header) for i, s in enumerate(stages)}
    files[f"{arch}.py"] = render_composed(graph, stages, class_name, arch, header)
    files["__init__.py"] = render_init(stages, class_name, arch, header)
    files = {name: format_source(text) for name, text in files.items()}

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, text in files.items():
            atomic_write_text(staging / name, text)
        for name, config in pipedream_configs(plan).items():
            atomic_write_text(staging / name, json.dumps(config) + "\n")  # one line, as PipeDream writes them
        write_graph_json(graph.with_stages(stage_of), staging / "graph.json")
        write_plan(plan, staging / "plan.json")
        _replace_directory(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("wrote %d stage(s) to %s in %.2f s", len(stages), out_dir, time.perf_counter() - started)
    return out_dir


def _stage(graph: Graph, stage_of: Mapping[str, int], boundary: StageBoundary, index: int) -> StageModule:
    node_ids = [n for n in graph.topological_order if stage_of[n] == index]
    return build_stage(graph, node_ids, boundary, class_name=f"Stage{index}")


def _replace_directory(staging: Path, out_dir: Path) -> None:
    """Swap the finished package into place; a reader sees the old package or the new one."""
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
        old.rmdir()
        os.replace(out_dir, old)
        os.replace(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out_dir)


# ---- loading -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GeneratedPackage:
    """A generated package, loaded: its graph and plan (to rebuild stages), module, and `model(criterion)` list."""

    graph: Graph
    plan: Plan
    module: ModuleType
    stages: list


def import_package(path: PathLike) -> ModuleType:
    """Import the package in `path` (its directory name need not be an identifier, e.g. `gpus=3`)."""
    path = Path(path).resolve()
    init = path / "__init__.py"
    if not init.exists():
        raise CodegenError(f"{path}: not a generated package (no __init__.py); run convert_graph_to_model.py first")
    digest = hashlib.sha1(f"{path}:{init.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    name = f"_model_parallel_generated_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_package(path: PathLike, criterion: Any = None) -> GeneratedPackage:
    """Load a generated package: graph.json, plan.json and `model(criterion)` (fresh, randomly initialised stages)."""
    path = Path(path)
    graph = read_graph_json(path / "graph.json")
    plan = read_plan(path / "plan.json")
    module = import_package(path)
    return GeneratedPackage(graph=graph, plan=plan, module=module, stages=module.model(criterion))


__all__ = ["generate_package", "load_package", "import_package", "pipedream_configs", "plan_with_replicas", "GeneratedPackage"]
