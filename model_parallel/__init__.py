"""model_parallel: profile a model, partition it into pipeline stages, generate stage code, train it
across workers, and rebalance the pipeline while it runs.

Heavy submodules load lazily, so `import model_parallel` stays cheap in every worker process.
"""
from __future__ import annotations

import importlib
from typing import Any

from model_parallel import compat as _compat

__version__ = "0.1.0"

# transformers and timm import torchvision internally; on a CPU torch with PyPI's CUDA torchvision that
# import fails unless the repair runs first (model_parallel.compat). The hook costs nothing until then.
_compat.install_import_hook()

# name -> "module:attribute"; filled in as each workflow step lands.
_LAZY = {
    "Graph": "model_parallel.graph.core:Graph",
    "Node": "model_parallel.graph.core:Node",
    "LayerSpec": "model_parallel.graph.core:LayerSpec",
    "Plan": "model_parallel.graph.plan:Plan",
    "Hierarchy": "model_parallel.graph.hierarchy:Hierarchy",
    "load_graph": "model_parallel.graph.io:load_graph",
    "save_graph": "model_parallel.graph.io:save_graph",
    "trace_model": "model_parallel.profiler.trace:trace_model",
    "profile": "model_parallel.profiler.api:profile",
    "import_torchvision": "model_parallel.compat:import_torchvision",
    "partition": "model_parallel.optimizer.partition:partition",
    "PartitionOptions": "model_parallel.optimizer.options:PartitionOptions",
    "PipelineTrainer": "model_parallel.api.trainer:PipelineTrainer",
    "TrainConfig": "model_parallel.runtime.config:TrainConfig",
    "build_stage": "model_parallel.codegen.build:build_stage",
    "build_stages": "model_parallel.codegen.build:build_stages",
    "generate_package": "model_parallel.codegen.package:generate_package",
    "RunOptions": "model_parallel.runtime.config:RunOptions",
    "hf_init_weights": "model_parallel.graph.init_rule:hf_init_weights",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'model_parallel' has no attribute {name!r}")
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
