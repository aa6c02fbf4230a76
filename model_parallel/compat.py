"""Make `import torchvision` work when its C extension cannot load (CPU torch + CUDA torchvision).

PyPI's torchvision wheel is a CUDA build; on a CPU-only torch its `_C` extension fails to load and
`torchvision/_meta_registrations.py` then dies registering fake kernels for `torchvision::nms` and
`torchvision::qnms`, which were never defined. Defining those two schemas (no kernels) lets the
models and transforms import; detection ops still need the real extension. Where torchvision
imports normally this does nothing.

`import model_parallel` installs `install_import_hook()`: the first `import torchvision` of the
process, by anyone (transformers and timm import it internally), is preceded by the repair, so
importing them after `import model_parallel` just works. The hook imports nothing until then.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # torch loads only when torchvision is imported: `import model_parallel` stays cheap
    import torch

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_library: "torch.library.Library | None" = None  # kept alive: dropping it would undefine the ops


def _define_missing_schemas() -> None:
    global _library
    import torch

    for name, schema in _SCHEMAS.items():
        if torch._C._dispatch_has_kernel(f"torchvision::{name}") or _op_exists(name):
            continue
        if _library is None:
            _library = torch.library.Library("torchvision", "DEF")
        _library.define(schema)


def _op_exists(name: str) -> bool:
    import torch

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


def _extension_loads() -> bool:
    """Whether torchvision's compiled `_C` extension loads into this torch (found and loaded the way
    torchvision's own `extension.py` does; a loaded library stays loaded, so its import reuses it)."""
    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True  # not installed: the import fails on its own, with Python's usual message
    import torch

    details = (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    for directory in spec.submodule_search_locations:
        library = importlib.machinery.FileFinder(directory, details).find_spec("_C")
        if library is not None and library.origin:
            try:
                torch.ops.load_library(library.origin)
                return True
            except OSError:  # a CUDA build on a CPU torch: undefined symbols
                return False
    return False


class _RepairBeforeImport(importlib.abc.MetaPathFinder):
    """Runs the repair just before the process's first `import torchvision`, then steps aside
    (returns None, so the ordinary finders import the real package unchanged)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> None:
        if fullname == "torchvision":
            if self in sys.meta_path:
                sys.meta_path.remove(self)  # once per process is enough
            if not _extension_loads():
                _define_missing_schemas()
        return None


def install_import_hook() -> None:
    """Make every later `import torchvision` in this process (direct, or inside transformers/timm) work."""
    if "torchvision" in sys.modules or any(isinstance(f, _RepairBeforeImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _RepairBeforeImport())
