"""Keep freed memory in the process instead of returning it to the OS (glibc malloc on Linux).

A CPU training step frees and re-allocates tens of megabytes of gradients and activations. By
default glibc serves large blocks with fresh `mmap`s, so every step page-faults and zeroes that
memory again: 10-25 ms of a 50 ms resnet18 step here, and the amount varies from process to process.
The profiler and every worker call `keep_freed_memory()` so that profiles and training pay the same
(lower, steadier) allocation cost. Elsewhere (macOS, musl) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit: blocks up to this come from the heap
_TRIM_THRESHOLD = 1 << 40  # never give the heap's top back to the OS
_applied = False
MAPPED_MIN = 1 << 20  # `mapped_empty` maps tensors from this size


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True if applied."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, min(_TRIM_THRESHOLD, 2**31 - 1)))
    if not ok:
        logger.debug("mallopt refused the thresholds; allocation costs stay as they are")
    _applied = ok
    return ok


def return_freed_memory() -> bool:
    """Give the heap's free memory back to the OS now (glibc `malloc_trim`); True if it released any.

    `keep_freed_memory` keeps freed blocks for the next step; after a plan switch the layers that left
    a rank (and their gradients and optimizer state) are not coming back, so a worker returns them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in a private memory map of its own (from MAPPED_MIN bytes), unmapped when it dies.

    For buffers read one after another while the heap is in use (a checkpoint's optimizer state, a parameter at a
    time): from glibc's heap (its mmap threshold raised by `keep_freed_memory`), each freed buffer's space was cut
    by small allocations made meanwhile and the next came from new memory, measured +32 MB of RLIMIT_DATA per
    16 MB parameter read. Private, so RLIMIT_DATA counts it as it counts the heap (a shared map, Python's
    default for mmap, would escape the cap)."""
    nbytes = math.prod(int(size) for size in shape) * dtype.itemsize
    if nbytes < MAPPED_MIN:  # small: the heap (a map each would count against vm.max_map_count, 65530 by default)
        return torch.empty(shape, dtype=dtype)
    try:
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as error:  # ENOMEM: out of memory as a heap allocation would say (the OOM reports catch that)
        raise MemoryError(f"cannot map {nbytes} bytes for a {dtype} tensor of shape {tuple(shape)}: "
                          f"{error.strerror or error}") from None
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor keeps the map alive
