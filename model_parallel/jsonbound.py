"""Bounded JSON decoding for everything read from a file or a socket.

`json.loads` alone lets hostile input escape as the wrong exception: an integer of more than 4300
digits raises a plain ValueError (CPython's int-to-str limit), nesting deeper than the interpreter
stack raises RecursionError, `1e999` silently becomes inf and `NaN` is accepted. Here the size,
the nesting depth and every number are bounded, and any failure is one error of the caller's type
whose message says where (file:line or key path), what is wrong and how to fix it.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Union

from model_parallel.userfile import read_bytes

MAX_DEPTH = 64  # our own files nest about 8 levels deep (graph.json: nodes[i].layer.args[j]...)
MAX_INT_DIGITS = 64  # a 64-bit counter has 20 digits; longer integers are mistakes or attacks
MAX_FILE_BYTES = 1 << 30  # a graph of a very large model is tens of MB; a file of a GiB is a mistake


class _Limit(Exception):
    """A bound was crossed inside the parser (raised from the parse hooks, converted below)."""

    def __init__(self, what: str, literal: str) -> None:
        super().__init__(what)
        self.what, self.literal = what, literal


def _parse_int(max_digits: int) -> Any:
    def parse(literal: str) -> int:
        digits = len(literal) - literal.startswith("-")
        if digits > max_digits:
            raise _Limit(f"an integer of {digits} digits (at most {max_digits} are accepted)", literal)
        return int(literal)
    return parse


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Limit(f"the number {literal[:24]}{'...' if len(literal) > 24 else ''} does not fit a 64-bit float", literal)
    return value


def _parse_constant(literal: str) -> float:
    raise _Limit(f"{literal} is not a number JSON allows (write a finite number or null)", literal)


def _line_of(text: str, literal: str) -> Optional[int]:
    index = text.find(literal)
    return None if index < 0 else text.count("\n", 0, index) + 1


def _too_deep(value: Any, max_depth: int) -> Optional[str]:
    """The key path of the first container nested deeper than `max_depth` (None if within)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:  # iterative: a recursive walk would hit the recursion limit we are guarding against
        node, depth, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        if not items:
            continue
        if depth > max_depth:
            return (path if len(path) <= 60 else path[:57] + "...") or "the top level"
        for key, child in items:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, f"{path}.{key}" if isinstance(node, dict) else f"{path}[{key}]"))
    return None


def loads(text: Union[str, bytes], *, where: str, error: type[Exception], fix: str = "",
          max_depth: int = MAX_DEPTH, max_int_digits: int = MAX_INT_DIGITS, max_bytes: Optional[int] = None,
          allow_nan: bool = False) -> Any:
    """Decode JSON `text`; any defect raises `error(f"{where}[:line]: ...")`, nothing else escapes.

    `where` names the source (a path, "frame from 127.0.0.1:5000"); `fix` is appended to every message.
    `allow_nan`: accept NaN, Infinity and -Infinity (what Python's json.dumps writes for a NaN loss in a log).
    """
    suffix = f"; {fix}" if fix else ""
    if max_bytes is not None and len(text) > max_bytes:
        raise error(f"{where}: {len(text)} bytes is more than the {max_bytes} accepted{suffix}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{where}: not UTF-8 text (byte {exc.start}: {exc.reason}){suffix}") from None
    try:
        value = json.loads(text, parse_int=_parse_int(max_int_digits), parse_float=_parse_float,
                           parse_constant=float if allow_nan else _parse_constant)
    except _Limit as exc:
        line = _line_of(text, exc.literal)
        raise error(f"{where}{f':{line}' if line else ''}: {exc.what}{suffix}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno}){suffix}") from None
    except RecursionError:
        raise error(f"{where}: nested deeper than {max_depth} levels{suffix}") from None
    except ValueError as exc:  # e.g. a float literal CPython cannot convert; never expected, never a traceback
        raise error(f"{where}: not valid JSON ({exc}){suffix}") from None
    path = _too_deep(value, max_depth)
    if path is not None:
        raise error(f"{where}: nested deeper than {max_depth} levels at {path}{suffix}")
    return value


def load_file(path: Union[str, "os.PathLike[str]"], *, error: type[Exception], what: str = "file", fix: str = "",
              max_bytes: int = MAX_FILE_BYTES, **limits: Any) -> Any:
    """Read and decode the JSON file `path` (see `loads`); a missing or unreadable file, and one that is not a
    regular file (`userfile.read_bytes`), is `error` too."""
    data = read_bytes(path, error=error, what=what, max_bytes=max_bytes, fix=fix)
    return loads(data, where=str(path), error=error, fix=fix, max_bytes=max_bytes, **limits)


def json_number(value: Any, what: str, integer: bool = False) -> Any:
    """A JSON number as a finite float (or an int): a string such as "nan", "inf" or "1e3" and a bool are
    refused, and so is a fraction where a count is meant (int(2.7) would silently read 2)."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (isinstance(value, float) and not math.isfinite(value)):
        expected = "an integer" if integer else "a finite number"
        raise ValueError(f"{what} must be {expected} (a JSON number), got {str(value)[:40]!r}")
    return value if integer else float(value)


_JSON_KINDS: dict[type, str] = {list: "a JSON list", str: "a JSON string", dict: "a JSON object"}


def json_typed(value: Any, kind: Union[type, tuple[type, ...]], what: str, expected: Optional[str] = None) -> Any:
    """`value` when it is of the JSON `kind` (list, str or dict; or a tuple of kinds, with `expected` saying what is
    meant), else a ValueError: a string where a list is meant would be read letter by letter (tuple("abc")), a list
    of pairs where an object is meant as its pairs (dict([...])), an object where a list is meant as its keys."""
    if not isinstance(value, kind):
        meant = expected or _JSON_KINDS[kind]  # type: ignore[index]  # a tuple of kinds comes with `expected`
        raise ValueError(f"{what} must be {meant}, got {type(value).__name__} {str(value)[:60]!r}")
    return value
