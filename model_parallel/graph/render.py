"""Draw a graph (and a plan's stages, as colours) with graphviz."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from model_parallel.errors import RenderError
from model_parallel.graph.core import Graph, Node

if TYPE_CHECKING:  # optional at run time: to_dot imports it when called and says how to install it
    import graphviz

_PALETTE = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#1f78b4", "#33a02c",
            "#e31a1c", "#ff7f00", "#6a3d9a", "#b15928")


def dot_available() -> bool:
    return shutil.which("dot") is not None


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def node_label(node: Node) -> str:
    description = node.description if len(node.description) <= 60 else node.description[:57] + "..."
    return (
        f"{node.node_id}\n{description}\n"
        f"fwd {node.forward_ms:.3f} ms, bwd {node.backward_ms:.3f} ms\n"
        f"act {_human_bytes(node.activation_bytes)}, params {_human_bytes(node.parameter_size)}"
    )


def to_dot(graph: Graph, title: Optional[str] = None) -> graphviz.Digraph:
    """A graphviz.Digraph of the graph; nodes of a partitioned graph are clustered and coloured by stage."""
    try:
        import graphviz
    except ImportError:
        raise RenderError("the Python package 'graphviz' is not installed, so no picture was drawn "
                          "(pip install graphviz)") from None

    dot = graphviz.Digraph(name=title or "graph", graph_attr={"rankdir": "TB", "label": title or ""},
                           node_attr={"shape": "box", "style": "rounded,filled", "fontsize": "10", "fillcolor": "white"})
    stages: list[Optional[int]] = [*sorted({n.stage_id for n in graph.nodes if n.stage_id is not None})]
    for stage in stages or [None]:
        members = [n for n in graph.nodes if n.stage_id == stage]
        color = _PALETTE[stage % len(_PALETTE)] if stage is not None else "white"
        if stage is None:
            for node in members:
                dot.node(node.node_id, node_label(node))
            continue
        with dot.subgraph(name=f"cluster_stage{stage}") as cluster:
            cluster.attr(label=f"stage {stage}", style="dashed")
            for node in members:
                cluster.node(node.node_id, node_label(node), fillcolor=color)
    for src, dst in graph.edges:
        dot.edge(src, dst)
    return dot


def render_graph(graph: Graph, path: Union[str, "os.PathLike[str]"], title: Optional[str] = None) -> Path:
    """Render to `path`; its suffix picks the format (.svg, .png, .pdf). Writes the .dot source beside it."""
    path = Path(path)
    fmt = path.suffix.lstrip(".") or "svg"
    dot = to_dot(graph, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".dot").write_text(dot.source, encoding="utf-8")
    if not dot_available():
        raise RenderError(
            "graphviz 'dot' is not installed, so no picture was drawn "
            f"(the source is in {path.with_suffix('.dot')}); install it with 'apt-get install graphviz'"
        )
    import graphviz

    try:
        data = dot.pipe(format=fmt)
    except graphviz.backend.ExecutableNotFound as error:
        raise RenderError(f"graphviz 'dot' could not run: {error}; install it with 'apt-get install graphviz'") from None
    except graphviz.backend.CalledProcessError as error:
        raise RenderError(f"graphviz failed to render {path}: {error}") from None
    from model_parallel.fileio import atomic_write

    atomic_write(path, lambda f: f.write(data), binary=True)
    return path
