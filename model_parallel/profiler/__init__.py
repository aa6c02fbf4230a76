"""The profiler: fx trace -> operator graph (trace.py), per-node timing (timing.py), `profile` (api.py)."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy, so `import model_parallel.profiler.trace` (codegen, runtime) does not load the timing code.
    if name in ("profile", "resolve_device"):
        from model_parallel.profiler import api

        return getattr(api, name)
    raise AttributeError(f"module 'model_parallel.profiler' has no attribute {name!r}")
