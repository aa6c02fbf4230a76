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
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Union

import torch

from model_parallel.codegen.boundary import StageBoundary, stage_boundaries
from model_parallel.codegen.build import (
    StageModule,
    ensure_layers,
    build_stage,
    check_layers,
    check_shared_modules,
    stage_assignment,
)
from model_parallel.codegen.source import format_source, render_composed, render_init, render_stage
from model_parallel.codegen.ties import check_ties
from model_parallel.errors import CodegenError, PlanError
from model_parallel.fileio import atomic_write_text
from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import read_graph_json, write_graph_json
from model_parallel.graph.plan import Plan, read_plan, write_plan

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]


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


# ---- the package -----------------------------------------------------------------------------------
def _check_identifier(value: str, what: str) -> None:
    if not value.isidentifier() or keyword.iskeyword(value) or re.fullmatch(r"stage\d+", value):
        raise CodegenError(f"{what} {value!r} must be a Python identifier (and not stageN), e.g. resnet152")


def _check_class_name(class_name: str, num_stages: int) -> None:
    """The composed class shares a namespace with the stage classes (`<arch>.py` imports them) and with the
    package's `__init__.py` (`arch`, `model`, `full_model`): taking one of their names shadows it, and
    `full_model()` then recurses forever or returns a stage."""
    taken = [f"Stage{i}" for i in range(num_stages)] + ["torch", "arch", "model", "full_model"]
    if class_name in taken:
        raise CodegenError(f"class name (-n) {class_name!r} is a name the generated package already uses "
                           f"({', '.join(taken)}); pick another, e.g. {class_name}Model")


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
    _check_class_name(class_name, len(boundaries))
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
