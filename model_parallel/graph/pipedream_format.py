"""Read and write PipeDream's graph.txt (docs/FORMATS.md): node lines, then tab-indented edges.

    <id> -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>, activation_size=<bytes>, parameter_size=<bytes>[ -- stage_id=<k>]
    \t<src> -- <dst>
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Optional, Union

from model_parallel.errors import GraphError, GraphFormatError
from model_parallel.fileio import atomic_write_text
from model_parallel.graph.core import ActivationSize, Graph, Node, shown_id, too_many
from model_parallel.jsonbound import MAX_FILE_BYTES
from model_parallel.userfile import read_text

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_STAGE_RE = re.compile(r"^stage_id=(\d+)$")
_MAX_STAGE_DIGITS = 9


def _number(text: str, where: str, field_name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise GraphFormatError(f"{where}: {field_name}={text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise GraphFormatError(f"{where}: {field_name}={text} must be a finite number >= 0")
    return value


def _parse_activation(text: str, where: str) -> ActivationSize:
    text = text.strip()
    if text.startswith("["):
        if not text.endswith("]"):
            raise GraphFormatError(f"{where}: activation_size list {text!r} is missing its closing ']'")
        items = [t.strip() for t in text[1:-1].split(";")]
        if not items or any(not t for t in items):
            raise GraphFormatError(f"{where}: activation_size list {text!r} has an empty entry; write [a; b; c]")
        return tuple(_number(t, where, "activation_size") for t in items)
    return _number(text, where, "activation_size")


def _parse_node(line: str, where: str) -> Node:
    parts = line.split(" -- ")
    if len(parts) not in (3, 4):
        raise GraphFormatError(
            f"{where}: expected '<id> -- <description> -- <costs>[ -- stage_id=<k>]', "
            f"found {len(parts)} ' -- '-separated part(s)"
        )
    node_id, description, costs = parts[0].strip(), parts[1], parts[2].strip()
    if not node_id or any(c.isspace() for c in node_id):
        raise GraphFormatError(f"{where}: node id {node_id!r} must be a token without spaces")
    entries = [e.strip() for e in costs.split(", ")]
    names = [e.split("=", 1)[0] for e in entries]
    if names != list(_FIELDS) or any("=" not in e for e in entries):
        raise GraphFormatError(
            f"{where}: costs must be '{'=<n>, '.join(_FIELDS)}=<n>' in that order, found {costs!r}"
        )
    values = [e.split("=", 1)[1] for e in entries]
    stage_id: Optional[int] = None
    if len(parts) == 4:
        match = _STAGE_RE.match(parts[3].strip())
        if not match:
            raise GraphFormatError(f"{where}: expected 'stage_id=<non-negative integer>', found {parts[3]!r}")
        digits = match.group(1)
        if len(digits) > _MAX_STAGE_DIGITS:  # before int(): Python refuses > 4300 digits with a bare ValueError
            raise GraphFormatError(f"{where}: stage_id has {len(digits)} digits; a stage id is a small non-negative "
                                   f"integer (at most {_MAX_STAGE_DIGITS} digits), like stage_id=0")
        stage_id = int(digits)
    try:
        return Node(
            node_id=node_id,
            description=description,
            forward_ms=_number(values[0], where, _FIELDS[0]),
            backward_ms=_number(values[1], where, _FIELDS[1]),
            activation_size=_parse_activation(values[2], where),
            parameter_size=_number(values[3], where, _FIELDS[3]),
            stage_id=stage_id,
        )
    except GraphError as error:  # the node's own rules (a printable id, ...): said with the file and line
        raise GraphFormatError(f"{where}: {error}") from None


def parse_graph_txt(text: str, filename: str = "<string>") -> Graph:
    """Parse graph.txt text. Errors are `GraphFormatError`s naming `filename:line`."""
    nodes: list[Node] = []
    node_lines: dict[str, int] = {}
    edges: list[tuple[str, str]] = []
    edge_lines: list[int] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        where = f"{filename}:{number}"
        if not raw.strip():
            continue
        if raw[0] in " \t":
            parts = raw.strip().split(" -- ")
            if len(parts) != 2 or not all(p.strip() for p in parts):
                raise GraphFormatError(f"{where}: expected an edge '\\t<src_id> -- <dst_id>', found {raw.strip()!r}")
            edges.append((parts[0].strip(), parts[1].strip()))
            edge_lines.append(number)
            if refused := too_many(len(edges), "edges"):
                raise GraphFormatError(f"{where}: {refused}")
            continue
        if edges:
            raise GraphFormatError(f"{where}: node line after edge lines; write all nodes first, then all edges")
        node = _parse_node(raw.rstrip("\r\n"), where)
        if node.node_id in node_lines:
            raise GraphFormatError(
                f"{where}: duplicate node id {node.node_id!r} (first defined on line {node_lines[node.node_id]})"
            )
        node_lines[node.node_id] = number
        nodes.append(node)
        if refused := too_many(len(nodes), "nodes"):
            raise GraphFormatError(f"{where}: {refused}")
    if not nodes:
        raise GraphFormatError(f"{filename}: graph is empty: no node lines found")
    for (src, dst), number in zip(edges, edge_lines):
        for end in (src, dst):
            if end not in node_lines:
                raise GraphFormatError(f"{filename}:{number}: edge {shown_id(src)} -- {shown_id(dst)} names unknown node "
                                       f"{end!r}")
    try:
        return Graph(nodes=tuple(nodes), edges=tuple(edges))
    except GraphError as error:
        cycle_line = ""
        if "cycle" in str(error):
            graph_edges = dict(zip(edges, edge_lines))
            cycle = str(error).split(": ", 1)[1].split(" -> ")
            first = graph_edges.get((cycle[0], cycle[1]))
            cycle_line = f":{first}" if first else ""
        raise GraphFormatError(f"{filename}{cycle_line}: {error}") from None


def read_graph_txt(path: Union[str, "os.PathLike[str]"]) -> Graph:
    path = Path(path)
    text = read_text(path, error=GraphFormatError, what="graph file", max_bytes=MAX_FILE_BYTES)
    return parse_graph_txt(text, str(path))


def _format_number(value: float) -> str:
    # repr gives the shortest text that reads back to the same float: the round trip is exact.
    return repr(float(value))


def format_node(node: Node) -> str:
    if isinstance(node.activation_size, tuple):
        activation = "[" + "; ".join(_format_number(a) for a in node.activation_size) + "]"
    else:
        activation = _format_number(node.activation_size)
    line = (
        f"{node.node_id} -- {node.description} -- "
        f"forward_compute_time={_format_number(node.forward_ms)}, "
        f"backward_compute_time={_format_number(node.backward_ms)}, "
        f"activation_size={activation}, parameter_size={_format_number(node.parameter_size)}"
    )
    if node.stage_id is not None:
        line += f" -- stage_id={node.stage_id}"
    return line


def format_graph_txt(graph: Graph) -> str:
    lines = [format_node(node) for node in graph.nodes]
    lines += [f"\t{src} -- {dst}" for src, dst in graph.edges]
    return "\n".join(lines) + "\n"


def write_graph_txt(graph: Graph, path: Union[str, "os.PathLike[str]"]) -> Path:
    return atomic_write_text(path, format_graph_txt(graph))
