"""numba's `njit`/`prange` when installed (`pip install model_parallel[search]`), else plain Python.

The search's loops (`flat_kernel.py`, `inner_rows.py`) are written in the subset of Python numba
compiles, so without numba they still run, unchanged, as ordinary functions: the same results, about a
hundred times slower, which the tests' small problems do not notice. `partition` only runs the flattened
search on its own when numba is present (`AVAILABLE`).

numba is imported here and nowhere else, on first use of the search, so `import model_parallel` never
loads it (nor sets its process-wide threading layer).
"""
from __future__ import annotations

from typing import Any, Callable

try:
    from numba import config, njit as _njit, prange as _prange
except ImportError:  # the optional extra is not installed
    AVAILABLE = False
    _njit, _prange = None, range
else:
    AVAILABLE = True
    # numba's own thread pool: its OpenMP layer would load a second OpenMP runtime beside torch's.
    config.THREADING_LAYER = "workqueue"

prange = _prange


def njit(*args: Any, **kwargs: Any) -> Any:
    """`numba.njit(...)` when numba is installed; otherwise a decorator that returns the function as is."""
    if _njit is not None:
        return _njit(*args, **kwargs)
    if args and callable(args[0]):
        return args[0]

    def keep(function: Callable[..., Any]) -> Callable[..., Any]:
        return function

    return keep
