"""The reviewed allow-list (allowed_ops.txt) and the op families no graph file may call, with why.

The safe layer loader (graph/loader.py) admits an op only when two things agree: its rules say the
op is a tensor op of an allowed namespace and no refused family below names it, and the op is listed
in `allowed_ops.txt`, the list a person reviewed. tests/test_allowed_ops.py holds the two equal, so a
torch upgrade that adds ops fails that test (and the loader refuses the new ops) until someone reviews
them and rewrites the file with `python tools/write_allowed_ops.py`.

The principle: every op a graph may call must be memory-safe for any literal arguments. An op whose
safety rests on indices, strides, sizes or offsets that torch does not check, that hands out
addresses or raw memory, or that trusts an opaque packed tensor, is refused by family:
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import torch

PATH = Path(__file__).with_name("allowed_ops.txt")

# (pattern over an op's name without leading underscores, why the family is refused).
REFUSED_FAMILIES: tuple[tuple[str, str], ...] = (
    (r"^sparse_.*tensor$|^sparse_resize|_coalesced_$",
     "sparse and compressed constructors from literal indices: torch skips their invariant checks by default, "
     "so an index past the dense size writes past a heap buffer in the next op"),
    (r"^indices$|^(c?col|crow|row)_indices$",
     "aliases of a sparse tensor's index arrays: an in-place op on one (indices().add_(10**8)) breaks the "
     "invariants after they were checked, and the next op writes out of bounds (SIGSEGV)"),
    (r"as_strided", "views from literal sizes, strides and offsets over another tensor's storage"),
    (r"^set_?$|^resize|storage", "re-pointing or resizing a tensor's storage in place (aten.set is set_'s functional twin)"),
    (r"data_ptr|^pin_memory$|^is_pinned$|record_stream",
     "addresses and host/device memory management: leak heap addresses or touch allocator state"),
    (r"^from_numpy$|^frombuffer$", "tensors over foreign raw buffers"),
    (r"fbgemm|mkldnn|cudnn|miopen|vulkan|xnnpack|^mps_|^quantized_|^mkl_",
     "backend kernels that trust pre-validated or opaque packed inputs (the front-end op checks them)"),
    (r"^segment_reduce$", "a prototype op whose offsets are not bounds-checked (reads past the data)"),
    (r"backward", "autograd kernels that trust the indices their forward saved (an index from a literal tensor "
                  "writes out of bounds: embedding_dense_backward, max_pool2d_with_indices_backward)"),
    (r"fractional_max_pool", "pooling windows placed by caller-given random samples"),
)
_REFUSED = re.compile("|".join(f"(?:{pattern})" for pattern, _ in REFUSED_FAMILIES))

# Sections of allowed_ops.txt: kind -> why the ops of that kind are admitted.
KINDS: dict[str, str] = {
    "module": "torch.nn module classes: constructors take literal sizes that torch checks; forward takes tensors",
    "function": "public torch ops and a fixed list of operator/builtin/math/torchvision functions; torch checks "
                "indices, shapes and dtypes of their tensor arguments",
    "aten": "ATen operators (op names, every overload) torch.export records, under the same rules as torch ops",
    "method": "public torch.Tensor methods other than hooks, callables, storage, files and numpy",
    "attribute": "what getattr(<node>, name) may read: metadata of a tensor, never its memory",
}


def refused_family(name: str) -> str | None:
    """Why `name` (an op, method or ATen op name) is refused by family, or None when no family names it."""
    match = _REFUSED.search(name.lstrip("_"))
    if match is None:
        return None
    return next(why for pattern, why in REFUSED_FAMILIES if re.search(pattern, name.lstrip("_")))


@lru_cache(maxsize=1)
def reviewed() -> frozenset[tuple[str, str]]:
    """(kind, name) of every line of allowed_ops.txt; comment lines (#) and section headers ([kind]) skipped."""
    entries = set()
    kind = None
    for line in PATH.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            kind = line[1:-1]
            continue
        entries.add((str(kind), line))
    return frozenset(entries)


def is_reviewed(kind: str, name: str) -> bool:
    return (kind, name) in reviewed()


def render(entries: set[tuple[str, str]]) -> str:
    """allowed_ops.txt for these (kind, name) entries: the principle, the refused families, one section per kind."""
    lines = ["# The reviewed allow-list of model_parallel's safe layer loader (model_parallel/graph/allowed_ops.py).",
             "# A graph file may call exactly these, with literal arguments; tests/test_allowed_ops.py checks",
             "# that the loader admits exactly this list. Rewrite it with `python tools/write_allowed_ops.py`",
             "# after reviewing what a torch upgrade added (git diff shows the new lines).",
             "# Principle: memory-safe for any literal arguments. Refused by family (never listed):"]
    lines += [f"#   {pattern}: {why}" for pattern, why in REFUSED_FAMILIES]
    for kind, why in KINDS.items():
        lines += ["", f"# {why}", f"[{kind}]"]
        lines += sorted(name for k, name in entries if k == kind)
    return "\n".join(lines) + "\n"


# ---- where sparse values can exist -----------------------------------------------------------------
def may_make_sparse(graph: Any, node_ids: Iterable[str]) -> bool:
    """Whether any of these layers can produce sparse values (an op, argument or constructor mentions
    sparse): where it can, layers run with torch's sparse invariant checks on (`guard_sparse`)."""
    for node_id in node_ids:
        layer = graph[node_id].layer
        if layer is not None and "sparse" in repr((layer.target, layer.args, dict(layer.kwargs), layer.module)):
            return True
    return False


def guard_sparse(graph: Any, node_ids: Iterable[str]) -> None:
    """Turn on torch's sparse tensor invariant checks in this process when these layers can make sparse
    values: torch skips them by default, and an invalid sparse tensor corrupts memory in the next op.
    (The constructors that take literal indices are refused outright; this covers every other way in.)"""
    if may_make_sparse(graph, node_ids):
        torch.sparse.check_sparse_tensor_invariants.enable()
