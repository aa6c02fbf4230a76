"""Make `import torchvision` work when its C extension cannot load (CPU torch + CUDA torchvision).

PyPI's torchvision wheel is a CUDA build; on a CPU-only torch its `_C` extension fails to load and
`torchvision/_meta_registrations.py` then dies registering fake kernels for `torchvision::nms` and
`torchvision::qnms`, which were never defined. Defining those two schemas (no kernels) lets the
models and transforms import; detection ops still need the real extension. Where torchvision
imports normally this does nothing.
"""
from __future__ import annotations

import sys
from types import ModuleType

import torch

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_library: torch.library.Library | None = None  # kept alive: dropping it would undefine the ops


def _define_missing_schemas() -> None:
    global _library
    for name, schema in _SCHEMAS.items():
        if torch._C._dispatch_has_kernel(f"torchvision::{name}") or _op_exists(name):
            continue
        if _library is None:
            _library = torch.library.Library("torchvision", "DEF")
        _library.define(schema)


def _op_exists(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


def import_torchvision() -> ModuleType:
    """Import torchvision, repairing the CPU-torch/CUDA-torchvision mismatch if needed."""
    try:
        import torchvision

        return torchvision
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
    # Forget the half-imported package, define the missing schemas, and import again.
    for module_name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[module_name]
    _define_missing_schemas()
    import torchvision

    return torchvision
