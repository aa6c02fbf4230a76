"""A shard payload's structure as JSON, each tensor a reference to its name in the safetensors file (shardio.py).

JSON lacks what a payload holds (tuples, int keys, an OrderedDict, inf and nan), so every value that is not a
plain JSON one is a one-key object saying what it is:

    None, True, 3, 2.5, "s", [...]   themselves (a float is written so that it reads back bit for bit)
    {"tuple": [...]}                  a tuple
    {"dict": [[key, value], ...]}     a dict in order, keys of any kind below ({"odict": ...}: an OrderedDict)
    {"float": "inf"}                  inf, -inf, nan or -nan
    {"tensor": "params/fc.weight"}    the tensor of that name in the file

Nothing else is written: a value of another type (a torch.Size, a set, a dtype, a subclass of dict) is refused,
so a checkpoint never silently changes what was saved. Reading builds the values back with nothing executed.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

MAX_NESTING = 48  # containers inside containers a payload may have (its JSON is about 3 levels per container)
JSON_DEPTH = 3 * MAX_NESTING + 8  # what the reader accepts (jsonbound's max_depth)
MAX_INT_DIGITS = 64  # as jsonbound reads them
_SPECIAL = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "-nan": -math.nan}
_KEYS = (str, int, float, bool, type(None), tuple)  # what a dict key may be (a tuple of these too)


def _component(key: Any) -> str:
    """A path component in a tensor's name: '~' and '/' escaped (as JSON Pointer does), so '/' only separates."""
    return str(key).replace("~", "~0").replace("/", "~1")


def encode(payload: Any, where: str) -> tuple[Any, list[tuple[tuple[Any, ...], str, torch.Tensor]]]:
    """(the JSON structure of `payload`, [(path, name, tensor)] in the order met); a value this encoding cannot
    hold exactly is refused with ValueError naming its path and `where`."""
    tensors: list[tuple[tuple[Any, ...], str, torch.Tensor]] = []
    names: set[str] = set()

    def refuse(path: tuple[Any, ...], what: str) -> ValueError:
        return ValueError(f"{where}: {'/'.join(map(str, path)) or 'the payload'} is {what}, which a checkpoint "
                          f"shard cannot hold exactly (it holds tensors, None, bool, int, float, str, and lists, "
                          f"tuples and dicts of them)")

    def value(obj: Any, path: tuple[Any, ...], depth: int, key: bool = False) -> Any:
        kind = type(obj)
        if isinstance(obj, torch.Tensor) and key:
            raise refuse(path, "a tensor inside a dict key")
        if isinstance(obj, torch.Tensor):
            name = "/".join(map(_component, path))
            if name in names:  # '0' and 0 as keys of one dict: made unique, '~~' never comes from escaping
                name = f"{name}~~{len(tensors)}"
            names.add(name)
            tensors.append((path, name, obj))
            return {"tensor": name}
        if obj is None or kind in (bool, str):
            return obj
        if kind is int:
            if len(str(abs(obj))) > MAX_INT_DIGITS:
                raise refuse(path, f"an integer of more than {MAX_INT_DIGITS} digits")
            return obj
        if kind is float:
            if math.isfinite(obj):
                return obj
            return {"float": ("-" if math.copysign(1.0, obj) < 0 else "") + ("nan" if math.isnan(obj) else "inf")}
        if kind not in (list, tuple, dict, OrderedDict):
            raise refuse(path, f"a {kind.__module__}.{kind.__qualname__}")
        if depth >= MAX_NESTING:
            raise refuse(path, f"nested deeper than {MAX_NESTING} containers")
        if kind is list:
            return [value(item, path + (i,), depth + 1, key) for i, item in enumerate(obj)]
        if kind is tuple:
            return {"tuple": [value(item, path + (i,), depth + 1, key) for i, item in enumerate(obj)]}
        pairs = []
        for name, item in obj.items():
            if isinstance(name, torch.Tensor) or not isinstance(name, _KEYS):
                raise refuse(path + (name,), f"keyed by a {type(name).__name__}")
            pairs.append([value(name, path + ("<key>",), depth + 1, True), value(item, path + (name,), depth + 1)])
        return {"odict" if kind is OrderedDict else "dict": pairs}

    return value(payload, (), 0), tensors


def decode(data: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """The payload `data` (JSON, as `encode` writes it) describes, `tensor(name)` for each reference; a structure
    `encode` cannot have written is refused with ValueError."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(item, tensor) for item in data]
    if type(data) is not dict or len(data) != 1:
        raise ValueError(f"{str(data)[:60]!r} is not a value this format writes")
    (tag, body), = data.items()
    if tag == "tensor" and type(body) is str:
        return tensor(body)
    if tag == "float" and body in _SPECIAL:
        return _SPECIAL[body]
    if tag == "tuple" and type(body) is list:
        return tuple(decode(item, tensor) for item in body)
    if tag in ("dict", "odict") and type(body) is list:
        out: dict[Any, Any] = OrderedDict() if tag == "odict" else {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError(f"a {tag} entry {str(pair)[:60]!r} is not a [key, value] pair")
            key = decode(pair[0], _no_tensor_key)
            try:
                if key in out:
                    raise ValueError(f"the key {str(key)[:60]!r} is repeated")
            except TypeError:  # a list as a key: unhashable
                raise ValueError(f"the key {str(key)[:60]!r} is not one a dict can have") from None
            out[key] = decode(pair[1], tensor)
        return out
    raise ValueError(f"{str(data)[:60]!r} is not a value this format writes")


def _no_tensor_key(name: str) -> torch.Tensor:
    raise ValueError(f"a dict key names the tensor {name[:60]!r}; keys are never tensors")
