"""What a checkpoint records of the loss its run trained with, so a resume with another loss is refused (training_record.py).

    describe_loss(criterion)   "torch.nn.functional.cross_entropy", "torch.nn.modules.loss.CrossEntropyLoss(label_smoothing=0.1)"

The loss is code, not data: the criterion is named by where it is defined (`module.qualname`), with the settings
that change what it computes: an nn.Module's or a callable object's scalar attributes and tensor buffers (class
weights by a digest of their bytes), a `functools.partial`'s arguments, a closure's captured scalars. A function
that has no importable name (a lambda, one defined inside another, one in the script run as `__main__`) is named by
a digest of its code as well, so an edited body reads as another loss; a library function is not (a torch upgrade is
not another loss). A setting of another type (an object, a model) is not described: those losses compare by name.
"""
from __future__ import annotations

import functools
import hashlib
import types
from typing import Any, Optional

import torch

# What a described setting may be: anything else (a module, an object) is left out rather than printed, since its
# repr can hold a memory address, which would make every resume read as a change.
_SCALARS = (bool, int, float, str, type(None))


def describe_loss(criterion: Any) -> Optional[str]:
    """The criterion's qualified name and the settings that change what it computes; None if it cannot be named."""
    if isinstance(criterion, functools.partial):
        inner = describe_loss(criterion.func)
        if inner is None:
            return None
        arguments = [d for v in criterion.args if (d := _value(v)) is not None] + \
            [f"{k}={d}" for k, v in sorted(criterion.keywords.items()) if (d := _value(v)) is not None]
        return f"functools.partial({inner}{''.join(', ' + a for a in arguments)})"
    if isinstance(criterion, types.MethodType):
        owner = describe_loss(criterion.__self__)
        return None if owner is None else f"{owner}.{criterion.__func__.__name__}"
    if isinstance(criterion, (types.FunctionType, types.BuiltinFunctionType)):
        name = _qualified(criterion)
        if name is None:
            return None
        settings: list[str] = []
        if isinstance(criterion, types.FunctionType) and not _importable(criterion):
            settings.append(f"code {_code_digest(criterion.__code__)}")
            for var, cell in zip(criterion.__code__.co_freevars, criterion.__closure__ or ()):
                try:
                    value = _value(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
                if value is not None:
                    settings.append(f"{var}={value}")
        return name + (f"({', '.join(settings)})" if settings else "")
    name = _qualified(type(criterion))
    if name is None:
        return None
    if not isinstance(criterion, torch.nn.Module):
        listed = _attributes(criterion, "")
    else:  # a loss module holding others (a weighted sum of two criteria): each one's kind and settings, by its path
        listed = [f"{prefix}={_qualified(type(module))}" for prefix, module in criterion.named_modules() if prefix]
        for prefix, module in criterion.named_modules():
            listed += _attributes(module, f"{prefix}." if prefix else "")
        listed += [f"{key}={value}" for key, buffer in criterion.named_buffers() if (value := _value(buffer)) is not None]
    return name + (f"({', '.join(sorted(listed))})" if listed else "")


def _attributes(thing: Any, prefix: str) -> list[str]:
    """`key=value` of the thing's public scalar attributes (an nn.Module's `training` flag left out: a criterion in
    eval mode computes the same)."""
    module = isinstance(thing, torch.nn.Module)
    return [f"{prefix}{key}={described}" for key, value in getattr(thing, "__dict__", {}).items()
            if not key.startswith("_") and not (module and key == "training") and (described := _value(value)) is not None]


def _qualified(thing: Any) -> Optional[str]:
    module, qualname = getattr(thing, "__module__", None), getattr(thing, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else None


def _importable(function: types.FunctionType) -> bool:
    """Whether the function is found again by its name (a library's, or a module's of the user's own)."""
    return function.__module__ != "__main__" and "<" not in function.__qualname__


def _code_digest(code: types.CodeType) -> str:
    """Bytecode, names and constants (nested code objects included), not line numbers: a body moved is the same loss."""
    digest = hashlib.sha256()

    def add(co: types.CodeType) -> None:
        digest.update(co.co_code)
        digest.update(repr((co.co_names, co.co_varnames, co.co_freevars)).encode())
        for const in co.co_consts:
            add(const) if isinstance(const, types.CodeType) else digest.update(repr(const).encode())
    add(code)
    return digest.hexdigest()[:12]


def _value(value: Any) -> Optional[str]:
    """A setting as the record prints it: a scalar's repr, a tensor by dtype, shape and a digest of its bytes; None
    for anything else (not described)."""
    if isinstance(value, torch.Tensor):
        # Its bytes, whatever the dtype (numpy has no bfloat16 or float8).
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()[:12]
        return f"tensor({str(value.dtype).replace('torch.', '')}, {list(value.shape)}, sha256 {digest})"
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value):
        return repr(tuple(value))
    return None
