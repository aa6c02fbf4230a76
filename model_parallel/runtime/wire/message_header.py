"""The header of a point-to-point message (`runtime.wire.comm`): a JSON list, one entry per value.

    {"t": "tensor", "shape": [...], "dtype": "float32", "grad": true}
                                     (+ "cast": "float32" when it travels narrowed to a wire dtype,
                                     bf16 training: the receiver restores the dtype it had)
    {"t": "json", "v": <encoded>}    ints, floats, bools, None, tuples/lists, torch.Size,
                                     torch.dtype, torch.device
    {"t": "structure", "v": ...}     optional, last: how the flat values nest (`runtime.wire.structure`)

Small Python values travel inside the header as JSON - never pickle.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from model_parallel.errors import PeerError
from model_parallel.runtime.wire.structure import narrowed


def encode_value(value: Any) -> Any:
    """A JSON form of a non-tensor boundary value (see module docstring for what is allowed)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": value.type}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, torch.Tensor):
        # A message is flat: callers with nested values flatten them first and send the structure along.
        raise PeerError(f"cannot send a tensor (shape {list(value.shape)}) nested inside a tuple or list as one "
                        "message value: flatten nested values with runtime.wire.structure.flatten_values and pass "
                        "structure= to send_values (StepExecutor does this for stage boundaries)")
    raise PeerError(f"cannot send a value of type {type(value).__name__} between stages "
                    "(allowed: tensors, int, float, bool, str, None, tuple/list of them, torch.Size, dtype, device)")


def decode_value(data: Any, device: Optional[torch.device] = None) -> Any:
    """Inverse of `encode_value`; a device is re-localised to the receiver's `device`."""
    if isinstance(data, list):
        return [decode_value(v, device) for v in data]
    if isinstance(data, dict):
        if "size" in data:
            return torch.Size(data["size"])
        if "dtype" in data:
            return getattr(torch, data["dtype"])
        if "device" in data:
            return device if device is not None else torch.device("cpu")
        if "tuple" in data:
            return tuple(decode_value(v, device) for v in data["tuple"])
    return data


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_header(values: list[Any], structure: Any = None, wire_dtype: Optional[torch.dtype] = None) -> list[dict[str, Any]]:
    """One entry per value, then the structure's entry when there is one (see the module docstring).
    Wider floating-point tensors may be narrowed to `wire_dtype`."""
    header = []
    for value in values:
        if isinstance(value, torch.Tensor):
            entry = {"t": "tensor", "shape": list(value.shape), "dtype": _dtype_name(value.dtype),
                     "grad": bool(value.requires_grad)}
            if narrowed(value, wire_dtype):
                assert wire_dtype is not None
                entry["dtype"], entry["cast"] = _dtype_name(wire_dtype), entry["dtype"]
            header.append(entry)
        else:
            header.append({"t": "json", "v": encode_value(value)})
    if structure is not None:
        header.append({"t": "structure", "v": structure})
    return header


def structure_of(header: list[dict[str, Any]]) -> Any:
    """The header's structure entry (how the flat values nest), or None."""
    return next((entry["v"] for entry in header if entry.get("t") == "structure"), None)
