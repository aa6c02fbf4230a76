"""Values crossing a stage boundary, as flat tensors plus a JSON description of where they sit.

A node's value may be a tensor, a tuple from a multi-output module (`nn.MultiheadAttention`, every
Hugging Face attention), a list from `split`, a dict or `ModelOutput`, a `torch.return_types`
tuple from `max`, or a small Python value. `flatten` turns any such value into its tensors (the
leaves, sent as tensors) and a structure that says where each one goes, with the small values
inlined; `unflatten` rebuilds the value around the received tensors. The structure is plain JSON
(it travels in a message header, see comm.py), one kind per node:

    {"leaf": i}                         the i-th tensor
    {"tuple": [...]}  {"list": [...]}   containers, in order
    {"dict": [[key, ...], ...]}         a dict (str or int keys, order kept)
    {"record": [[key, ...], ...]}       our OutputDict or a Hugging Face ModelOutput: rebuilt as an
                                        OutputDict (`out.logits`, `out["logits"]`, `out[0]` all work)
    {"namedtuple": [[field, ...], ...]} rebuilt as a namedtuple with those fields
    {"return_type": name, "items": [...]}   a torch.return_types tuple (`torch.max(x, 1)`)
    {"value": v}                        None, bool, int, finite float, str
    {"float": "inf"|"-inf"|"nan"}  {"size": [...]}  {"dtype": "float32"}  {"device": "cuda"}

Decoding accepts only these kinds and constructs no type named on the wire other than a
`torch.return_types` member (closed list) and a fresh namedtuple of identifier fields: a peer can
never make this process import or build an arbitrary object. A device is re-localised to the
receiver's own device (ranks hold their stage on their own GPU).

The message header (`make_header`; comm.py sends it) is a JSON list, one entry per flat value:

    {"t": "tensor", "shape": [...], "dtype": "float32", "grad": true}
                                     (+ "cast": "float32" when it travels narrowed to a wire dtype,
                                     bf16 training: the receiver restores the dtype it had;
                                     + "stride": [...] when its layout is dense but not row-major,
                                     channels_last or a transpose: it travels in that order and
                                     arrives with those strides, `wire_stride`)
    {"t": "json", "v": <encoded>}    ints, floats, bools, None, tuples/lists, torch.Size,
                                     torch.dtype, torch.device
    {"t": "structure", "v": ...}     optional, last: how the flat values nest (the structure above)

Small Python values travel inside the header as JSON - never pickle.
"""
from __future__ import annotations

import collections
import functools
import keyword
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.return_types

from model_parallel.errors import PeerError, PlanError, ProtocolError
from model_parallel.graph.arguments import OutputDict
from model_parallel.graph.crossing import MAX_DEPTH, is_record as _is_record

Structure = Any  # the JSON description above
ALLOWED = ("tensors, tuples/lists/dicts of them, Hugging Face ModelOutputs, namedtuples, None, bool, int, "
           "float, str, torch.Size, torch.dtype and torch.device")


def _return_type(value: Any) -> Optional[str]:
    name = type(value).__name__
    if type(value).__module__ == "torch.return_types" and getattr(torch.return_types, name, None) is type(value):
        return name
    return None


def _walk(v: Any, path: str, name: str, leaves: list[torch.Tensor]) -> Structure:
    """The structure of `v` (at `path` inside boundary value `name`), appending its tensors to `leaves`."""
    if isinstance(v, torch.Tensor):
        leaves.append(v)
        return {"leaf": len(leaves) - 1}
    if v is None or isinstance(v, (bool, int, str)):
        return {"value": v}
    if isinstance(v, float):
        return {"value": v} if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, torch.Size):
        return {"size": [int(d) for d in v]}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": v.type}
    if isinstance(v, tuple):
        return_type = _return_type(v)
        if return_type is not None:
            return {"return_type": return_type,
                    "items": [_walk(x, f"{path}[{i}]", name, leaves) for i, x in enumerate(v)]}
        fields = getattr(type(v), "_fields", None)
        if isinstance(fields, tuple) and all(isinstance(f, str) for f in fields):
            return {"namedtuple": [[f, _walk(x, f"{path}.{f}", name, leaves)] for f, x in zip(fields, v)]}
        return {"tuple": [_walk(x, f"{path}[{i}]", name, leaves) for i, x in enumerate(v)]}
    if isinstance(v, list):
        return {"list": [_walk(x, f"{path}[{i}]", name, leaves) for i, x in enumerate(v)]}
    if isinstance(v, Mapping):
        bad = [k for k in v if not isinstance(k, (str, int)) or isinstance(k, bool)]
        if bad:
            raise PlanError(f"boundary value {name!r}{path} is a dict with a key of type {type(bad[0]).__name__} "
                            f"({bad[0]!r}); only str and int keys can cross a stage boundary: move the cut so that "
                            "this dict stays inside one stage")
        kind = "record" if _is_record(v) else "dict"
        return {kind: [[k, _walk(x, f"{path}[{k!r}]", name, leaves)] for k, x in v.items()]}
    kind = f"{type(v).__module__}.{type(v).__qualname__}"
    raise PlanError(f"boundary value {name!r}{path} is a {kind}, which cannot cross a stage boundary (allowed: "
                    f"{ALLOWED}); move the cut so that node {name!r} and its users are in one stage, or make the "
                    "module return one of the allowed types")


def flatten(value: Any, name: str = "value") -> tuple[list[torch.Tensor], Structure]:
    """The tensors of `value` in order, and its structure; `name` (a node id) names it in errors."""
    leaves: list[torch.Tensor] = []
    return leaves, _walk(value, "", name, leaves)


def flatten_values(values: Sequence[Any], names: Sequence[str]) -> tuple[list[torch.Tensor], Structure]:
    """`flatten` of a list of boundary values (a {"list": [...]}), each named by its node id in errors."""
    leaves: list[torch.Tensor] = []
    return leaves, {"list": [_walk(v, "", name, leaves) for v, name in zip(values, names, strict=True)]}


def _bad(structure: Any, why: str) -> ProtocolError:
    return ProtocolError(f"malformed boundary structure {str(structure)[:120]}: {why} "
                         "(are both ranks running the same version of model_parallel?)")


@functools.lru_cache(maxsize=256)
def _namedtuple(fields: tuple[str, ...]) -> type:
    return collections.namedtuple("BoundaryTuple", fields)


def unflatten(leaves: Sequence[Any], structure: Structure, device: Optional[torch.device] = None) -> Any:
    """The value `structure` describes, with its leaves taken from `leaves` (each exactly once)."""
    used = [False] * len(leaves)

    def pairs(payload: Any, depth: int, kinds: tuple[type, ...]) -> list[tuple[Any, Any]]:
        if not isinstance(payload, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], kinds) and not isinstance(p[0], bool)
                for p in payload):
            raise _bad(payload, f"expected [[key, value], ...] with keys of type {'/'.join(k.__name__ for k in kinds)}")
        return [(k, build(s, depth + 1)) for k, s in payload]

    def items(payload: Any, depth: int) -> list[Any]:
        if not isinstance(payload, list):
            raise _bad(payload, "expected a list")
        return [build(s, depth + 1) for s in payload]

    def build(s: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _bad(s, f"nested deeper than {MAX_DEPTH}")
        if not isinstance(s, dict) or not s:
            raise _bad(s, "expected an object with one kind")
        kind = "return_type" if "return_type" in s else next(iter(s))
        payload = s[kind]
        if len(s) != (2 if kind == "return_type" else 1):
            raise _bad(s, "unexpected keys")
        if kind == "leaf":
            if not isinstance(payload, int) or isinstance(payload, bool) or not 0 <= payload < len(leaves) \
                    or used[payload]:
                raise _bad(s, f"leaf index must be an unused int in 0..{len(leaves) - 1}")
            used[payload] = True
            return leaves[payload]
        if kind == "value":
            if payload is None or isinstance(payload, (bool, int, str)) or (isinstance(payload, float)
                                                                            and math.isfinite(payload)):
                return payload
            raise _bad(s, "a value is None, bool, int, str or a finite float")
        if kind == "float":
            if payload not in ("inf", "-inf", "nan"):
                raise _bad(s, "expected 'inf', '-inf' or 'nan'")
            return float(payload)
        if kind in _ATOMS:
            return _atom(kind, payload, device, lambda why: _bad(s, why))
        if kind == "tuple":
            return tuple(items(payload, depth))
        if kind == "list":
            return items(payload, depth)
        if kind == "dict":
            return dict(pairs(payload, depth, (str, int)))
        if kind == "record":
            return OutputDict(pairs(payload, depth, (str,)))
        if kind == "namedtuple":
            built = pairs(payload, depth, (str,))
            fields = tuple(f for f, _ in built)
            if not all(f.isidentifier() and not keyword.iskeyword(f) and not f.startswith("_") for f in fields) \
                    or len(set(fields)) != len(fields):
                raise _bad(s, "namedtuple fields must be distinct public identifiers")
            return _namedtuple(fields)(*(v for _, v in built))
        if kind == "return_type":
            name = payload
            cls = getattr(torch.return_types, name, None) if isinstance(name, str) and not name.startswith("_") else None
            if not (isinstance(cls, type) and issubclass(cls, tuple) and cls.__module__ == "torch.return_types"):
                raise _bad(s, "unknown torch.return_types member")
            return cls(items(s.get("items"), depth))
        raise _bad(s, f"unknown kind {str(kind)[:40]!r}")

    value = build(structure, 0)
    if not all(used):
        raise _bad(structure, f"{used.count(False)} of {len(leaves)} tensors are not placed")
    return value


def narrowed(value: torch.Tensor, wire_dtype: Optional[torch.dtype]) -> bool:
    """Whether `value` crosses a boundary as `wire_dtype`: a floating-point tensor wider than it
    (float32 -> bf16); a bf16 or float16 value, or an integer one, crosses as it is."""
    return wire_dtype is not None and value.is_floating_point() and value.dtype.itemsize > wire_dtype.itemsize


def cross(values: Sequence[Any], names: Sequence[str], wire_dtype: Optional[torch.dtype] = None) -> list[Any]:
    """What the next stage receives for `values` (same tensors, containers rebuilt as the wire rebuilds
    them): single-process mode runs exactly the values a pipeline would, and refuses the same ones.

    With `wire_dtype` (bf16 training) a wider floating-point tensor is rounded to it and back, as it
    is on the wire (comm.py). In autograd this is two casts, so the gradient flowing back through the
    cut is rounded the same way, as the pipeline sends it: both directions match a pipeline exactly."""
    leaves, structure = flatten_values(values, names)
    if wire_dtype is not None:
        leaves = [leaf.to(wire_dtype).to(leaf.dtype) if narrowed(leaf, wire_dtype) else leaf for leaf in leaves]
    return unflatten(leaves, structure)


# ---- the message header --------------------------------------------------------------------------
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


def decode_value(data: Any, device: Optional[torch.device] = None, depth: int = 0) -> Any:
    """Inverse of `encode_value`; a device is re-localised to the receiver's `device`.

    The header is a peer's bytes: only the forms `encode_value` writes are accepted, and a dtype is a torch
    dtype, never another torch attribute (`{"dtype": "load"}` or `"os"` handed to the stage as a value);
    anything else is a PeerError naming the value."""
    if depth > MAX_DEPTH:
        raise _bad_value(data, f"nested deeper than {MAX_DEPTH}")
    if data is None or isinstance(data, (bool, int, float, str)):  # json.dumps writes a NaN or inf float as is
        return data
    if isinstance(data, list):
        return [decode_value(v, device, depth + 1) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise _bad_value(data, "expected None, bool, int, float, str, a list or an object with one key")
    kind, payload = next(iter(data.items()))
    if kind in _ATOMS:
        return _atom(kind, payload, device, lambda why: _bad_value(data, why))
    if kind == "tuple":
        if not isinstance(payload, list):
            raise _bad_value(data, "a tuple is a list of values")
        return tuple(decode_value(v, device, depth + 1) for v in payload)
    raise _bad_value(data, f"unknown kind {str(kind)[:40]!r}")


_ATOMS = ("size", "dtype", "device")


def _atom(kind: str, payload: Any, device: Optional[torch.device], bad: Callable[[str], Exception]) -> Any:
    """A torch.Size, dtype or device as `encode_value` writes it (in a header's values and a structure's alike); a
    dtype is a torch dtype, never another torch attribute (`{"dtype": "load"}`); anything else is `bad(why)`."""
    if kind == "size":
        if not isinstance(payload, list) or not all(isinstance(d, int) and not isinstance(d, bool) and
                                                    -(1 << 62) < d < 1 << 62 for d in payload):
            raise bad("a size is a list of integers")
        return torch.Size(payload)
    if kind == "dtype":
        dtype = getattr(torch, payload, None) if isinstance(payload, str) and not payload.startswith("_") else None
        if not isinstance(dtype, torch.dtype):
            raise bad("not a torch dtype")
        return dtype
    if not isinstance(payload, str):  # a device: its type; the receiver's own device stands for it
        raise bad("a device is a type name")
    return device if device is not None else torch.device("cpu")


def _bad_value(data: Any, why: str) -> PeerError:
    return PeerError(f"a message header carries the value {str(data)[:120]}: {why} "
                     "(are both ranks running the same version of model_parallel?)")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def row_major(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (torch's: a dimension of size 0 counts as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether `stride` lays a tensor of `shape` over exactly its numel elements, each once (a permutation of
    row-major; a dimension of size 1 may have any stride): a buffer of numel elements holds it, nothing overlaps."""
    step = 1
    for size_stride, size in sorted((st, size) for size, st in zip(shape, stride) if size > 1):
        if size_stride != step:
            return False
        step *= size
    return True


def wire_stride(value: torch.Tensor) -> Optional[list[int]]:
    """The strides `value` crosses a boundary with, where they are not row-major: a channels_last activation (a
    convnet converted with `model.to(memory_format=torch.channels_last)`), its gradient, a transpose. The next stage's
    kernels follow the layout, and a contiguous copy rounds differently (resnet18 in channels_last: 1.2e-7 after one
    step, 0.06 after four, where single-process mode, which keeps the layout, is bitwise). None: row-major, empty, or
    not dense (a slice: sent contiguous, as its values are all the next stage can see)."""
    stride = value.stride()
    if value.numel() == 0 or stride == row_major(value.shape) or not is_dense(value.shape, stride):
        return None
    return list(stride)


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
            if (stride := wire_stride(value)) is not None:
                entry["stride"] = stride
            header.append(entry)
        else:
            header.append({"t": "json", "v": encode_value(value)})
    if structure is not None:
        header.append({"t": "structure", "v": structure})
    return header


def structure_of(header: list[dict[str, Any]]) -> Any:
    """The header's structure entry (how the flat values nest), or None."""
    return next((entry["v"] for entry in header if entry.get("t") == "structure"), None)
