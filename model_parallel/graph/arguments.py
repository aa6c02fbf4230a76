"""JSON encoding of torch.fx node arguments, so a layer's call can be stored in graph.json and rebuilt.

    node reference      {"node": "<node_id>"}
    tuple               {"tuple": [...]}            list -> JSON list
    dict                {"dict": {"key": ...}}      (string keys)
    slice               {"slice": [start, stop, step]}
    torch.dtype         {"dtype": "float32"}
    torch.device        {"device": "cpu"}; {"device": "run"}: the device the code runs on (see RUN_DEVICE)
    torch.memory_format {"memory_format": "contiguous_format"}
    torch.layout        {"layout": "strided"}
    Ellipsis            {"ellipsis": true}
    None, bool, int, float, str as themselves (inf/nan floats as {"float": "inf"})

A dict decodes to an `OutputDict`: a dict that also reads its keys as attributes, so a loss written
for a Hugging Face `ModelOutput` (`out.logits`) works on a rebuilt model's output too.

`metadata["constants"]` holds the tensors a graph reads that no state dict carries (non-persistent
buffers such as Llama's rotary `inv_freq`, constants torch.export lifted), by get_attr target:
`{"shape": [...], "dtype": "float32", "values": [flat numbers]}`; "values" is left out above
`MAX_CONSTANT_ELEMENTS`, and a rebuild then needs the original model (`source_model=`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree

from model_parallel.errors import GraphError
from model_parallel.graph.references import node_reference_id, referenced_nodes  # noqa: F401 - referenced_nodes re-exported

JSONValue = Any
CONSTANTS = "constants"  # graph metadata key, see the module docstring
MAX_CONSTANT_ELEMENTS = 65536  # a rotary table or position ids are a few hundred to a few thousand
# torch.export writes the device it traced on into operators (`aten.arange(..., device=cpu)`); the
# tracer records that device as "run" (profiler.export_trace.portable_devices), so a graph traced on
# meta or on the CPU runs wherever a stage is placed: a rebuilt stage reads its inputs' device there.
RUN_DEVICE = "run"
_TYPED = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}


def encode_argument(value: Any, node_name: Callable[[Any], str | None]) -> JSONValue:
    """Encode one argument; `node_name(value)` returns the node id if `value` is a graph node."""
    name = node_name(value)
    if name is not None:
        return {"node": name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, tuple):
        return {"tuple": [encode_argument(v, node_name) for v in value]}
    if isinstance(value, list):
        return [encode_argument(v, node_name) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise GraphError(f"cannot encode a dict argument with non-string keys: {value!r}")
        return {"dict": {k: encode_argument(v, node_name) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [encode_argument(v, node_name) for v in (value.start, value.stop, value.step)]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if value is Ellipsis:
        return {"ellipsis": True}
    raise GraphError(f"cannot encode argument of type {type(value).__name__}: {value!r}")


def decode_argument(value: JSONValue, resolve_node: Callable[[str], Any],
                    run_device: Callable[[], Any] | None = None) -> Any:
    """Inverse of `encode_argument`; `resolve_node(node_id)` supplies what a node reference stands for,
    `run_device()` what the device the code runs on (`{"device": "run"}`) stands for."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode_argument(v, resolve_node, run_device) for v in value]
    if isinstance(value, Mapping) and len(value) == 1:
        (kind, payload), = value.items()
        if kind == "node":
            return resolve_node(node_reference_id(payload))
        if kind == "tuple" and isinstance(payload, list):
            return tuple(decode_argument(v, resolve_node, run_device) for v in payload)
        if kind == "dict" and isinstance(payload, Mapping) and all(isinstance(k, str) for k in payload):
            return OutputDict((k, decode_argument(v, resolve_node, run_device)) for k, v in payload.items())
        if kind == "slice" and isinstance(payload, list) and len(payload) == 3:
            return slice(*(decode_argument(v, resolve_node, run_device) for v in payload))
        if kind == "float" and payload in ("inf", "-inf", "nan"):
            return float(payload)
        if kind in ("dtype", "memory_format", "layout"):
            # Only a value of that very type: `{"dtype": "load"}` must not hand over torch.load.
            attr = getattr(torch, payload, None) if isinstance(payload, str) and not payload.startswith("_") else None
            if not isinstance(attr, _TYPED[kind]):
                raise GraphError(f"unknown torch {kind} {str(payload)[:80]!r}")
            return attr
        if kind == "device":
            if not isinstance(payload, (str, int)):
                raise GraphError(f"a device is a string like 'cpu' or 'cuda:0', got {str(payload)[:80]!r}")
            if payload == RUN_DEVICE:
                if run_device is None:
                    raise GraphError(f"device {RUN_DEVICE!r} (the device the code runs on) is only known where a "
                                     "stage is built; build the stage with codegen.build_stage")
                return run_device()
            try:
                return torch.device(payload)
            except (RuntimeError, ValueError) as error:
                raise GraphError(f"unknown device {str(payload)[:80]!r}: {error}") from None
        if kind == "ellipsis":
            return Ellipsis
    raise GraphError(f"cannot decode layer argument {value!r}")


class OutputDict(dict):
    """A dict whose keys read as attributes too (`out.logits` and `out["logits"]`), like transformers'
    ModelOutput; an int index gives the value in that position (`out[0]`, as ModelOutput does)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"model output has no field {name!r}; its fields are {', '.join(self) or 'none'}") from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int) and not isinstance(key, bool):
            return list(self.values())[key]
        return dict.__getitem__(self, key)


# pytree (tree_map, to_device, export) sees through it like a dict; keys are kept in order.
torch.utils._pytree.register_pytree_node(
    OutputDict, lambda d: (list(d.values()), list(d.keys())),
    lambda values, keys: OutputDict(zip(keys, values)), serialized_type_name="model_parallel.OutputDict",
)


def encode_constant(tensor: torch.Tensor) -> dict[str, Any]:
    """A constant tensor's record for `metadata["constants"]` (values only up to MAX_CONSTANT_ELEMENTS)."""
    record: dict[str, Any] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
    # A meta tensor (a model traced on meta) has no values: the record keeps its shape and dtype.
    if tensor.numel() <= MAX_CONSTANT_ELEMENTS and not tensor.is_complex() and not tensor.is_meta:
        # Python floats hold float32/bfloat16/float16 values exactly; JSON keeps them exactly (repr round trip).
        values = tensor.detach().cpu().reshape(-1)
        record["values"] = [encode_argument(v, lambda _: None) for v in values.tolist()]
    return record


def decode_constant(record: Any, where: str) -> torch.Tensor | None:
    """The tensor a `metadata["constants"]` record holds, or None when its values were not stored."""
    if not isinstance(record, Mapping) or not isinstance(record.get("shape"), list) \
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in record["shape"]):
        raise GraphError(f"{where}: expected {{'shape': [ints], 'dtype': name, 'values': [numbers]}}, got {str(record)[:120]}")
    dtype = decode_argument({"dtype": record.get("dtype")}, lambda _: None)
    if "values" not in record:
        return None
    values = record["values"]
    numel = 1
    for d in record["shape"]:
        numel *= d
    if not isinstance(values, list) or len(values) != numel or numel > MAX_CONSTANT_ELEMENTS:
        raise GraphError(f"{where}: 'values' must list {numel} numbers for shape {record['shape']} "
                         f"(at most {MAX_CONSTANT_ELEMENTS})")
    decoded = [decode_argument(v, lambda _: None) for v in values]
    if not all(isinstance(v, (bool, int, float)) for v in decoded):
        raise GraphError(f"{where}: 'values' must be numbers")
    return torch.tensor(decoded, dtype=dtype).reshape(record["shape"])
