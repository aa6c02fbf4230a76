"""Which values can be sent from one stage to the next, decided on a value the profiler saw.

The wire format is `runtime/wire/structure.py` (tensors, tuples/lists/dicts/namedtuples of them, ModelOutputs,
`torch.return_types`, small Python values); this module answers the same question below the runtime, so
the profiler can record on each node whether its value may cross (`Node.uncrossable`) and the optimizer
never cuts after one that cannot. `tests/unit/optimizer/test_uncrossable.py` checks both answer alike on every kind.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from model_parallel.graph.arguments import OutputDict

MAX_DEPTH = 64  # nesting deeper than this is garbage from the wire (runtime/wire/structure.py), not a model's value


def is_record(value: Any) -> bool:
    """Our OutputDict, or a transformers ModelOutput (recognised by class, without importing transformers)."""
    return isinstance(value, OutputDict) or any(
        c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.") for c in type(value).__mro__)


def value_refusal(value: Any, depth: int = 0, path: str = "") -> Optional[str]:
    """None when `value` can cross a stage boundary, else why not (naming the part at `path`)."""
    if depth > MAX_DEPTH:
        return f"the value{path} is nested deeper than {MAX_DEPTH}"
    if isinstance(value, (torch.Tensor, torch.Size, torch.dtype, torch.device, bool, int, float, str)) or value is None:
        return None  # (a float that is not finite crosses as {"float": "inf"})
    if isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            why = value_refusal(item, depth + 1, f"{path}[{index}]")
            if why is not None:
                return why
        return None
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, (str, int)) or isinstance(k, bool)]
        if bad:
            return f"the value{path} is a dict with a key of type {type(bad[0]).__name__} (only str and int keys cross)"
        if is_record(value) and any(not isinstance(k, str) for k in value):
            return f"the value{path} is a ModelOutput with a non-string key"
        for key, item in value.items():
            why = value_refusal(item, depth + 1, f"{path}[{key!r}]")
            if why is not None:
                return why
        return None
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return f"the value{path} is a {kind}, which the wire format cannot carry"
