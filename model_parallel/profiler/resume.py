"""What an interrupted profile keeps: timed steps and per-node timings in `<dir>/.partial.json`.

Profiling a large model on a CPU takes many minutes; a stop (Ctrl-C, a closed laptop lid, a killed
job) used to lose all of it. The profiler records each measurement here as it goes, and the same
command run again reuses them and times only what is missing. The file is only reused when every
setting that changes a timing is the same (`key`: model, batch, image size, device, threads, torch
version, replay counts, ...) and the traced graph has the same nodes (`graph_fingerprint`);
otherwise profiling starts fresh and says why. It is plain JSON: nothing in it is executed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from model_parallel import jsonbound
from model_parallel.errors import ProfileError
from model_parallel.fileio import atomic_write_json
from model_parallel.graph.core import Graph
from model_parallel.profiler.timing import NodeTiming

logger = logging.getLogger(__name__)

PARTIAL_NAME = ".partial.json"
SCHEMA = "model_parallel.partial_profile"
VERSION = 1
# Writing (with fsync) after every node would cost more than timing a small node: at most once a
# second, plus once when the run stops for any reason.
FLUSH_INTERVAL_S = 1.0


def graph_fingerprint(graph: Graph) -> str:
    """A digest of the traced graph's structure: node ids, operators, output shapes and edges."""
    nodes = [
        [n.node_id, n.layer.op if n.layer else "", str(n.layer.target) if n.layer else "",
         [list(o.shape) for o in n.layer.outputs] if n.layer else []]
        for n in graph.nodes
    ]
    text = json.dumps({"nodes": nodes, "edges": [list(e) for e in graph.edges]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_timed(node: Any) -> bool:
    """Whether profiling replays this node (operators with tensor outputs; not inputs or attributes)."""
    return node.layer is not None and bool(node.layer.outputs) and node.layer.op not in ("placeholder", "get_attr")


def _is_time(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


class RoundStore:
    """The node timings of one profiling round (a `model_parallel.profiler.api.TimingStore`)."""

    def __init__(self, partial: "PartialProfile", record: dict[str, Any]) -> None:
        self.partial = partial
        self.data = record

    def begin(self, graph: Graph) -> dict[str, NodeTiming]:
        fingerprint = graph_fingerprint(graph)
        nodes = self.data.setdefault("nodes", {})
        if self.data.get("fingerprint") not in (None, fingerprint):
            self.partial.say(f"the saved node timings in {self.partial.path} are for a different graph "
                             "(the model's code changed?); timing every node again")
            nodes.clear()
        self.data["fingerprint"] = fingerprint
        known = {i: NodeTiming(*nodes[i]) for i in (n.node_id for n in graph.nodes) if i in nodes}
        timed = sum(1 for n in graph.nodes if is_timed(n))
        if known:
            self.partial.say(f"resuming: {len(known)} of {timed} nodes already timed")
        self.partial.resumed_nodes += len(known)
        return known

    def record(self, node_id: str, timing: NodeTiming) -> None:
        self.data.setdefault("nodes", {})[node_id] = [timing.forward_ms, timing.backward_ms]
        self.partial.flush()


class PartialProfile:
    """Measurements of one profiling job so far; `path=None` keeps them in memory only."""

    def __init__(self, path: Optional[Path], key: Mapping[str, Any], say: Any = logger.info) -> None:
        self.path = Path(path) if path is not None else None
        self.key = dict(key)
        self.say = say
        self.step_chunks: list[list[float]] = []
        self.rounds: list[dict[str, Any]] = []
        self.resumed_nodes = 0
        self._flushed_at = time.monotonic()
        self._dirty = False

    @classmethod
    def open(cls, path: Optional[Path], key: Mapping[str, Any], say: Any = logger.info) -> "PartialProfile":
        """Load the saved measurements at `path` when they were made with the same `key`, else start empty."""
        partial = cls(path, key, say)
        if path is None or not Path(path).exists():
            return partial
        try:  # bounded: a corrupt file (deep nesting, a huge integer) starts fresh, not a RecursionError
            data = jsonbound.load_file(path, error=ProfileError, what="partial profile", allow_nan=True)
        except ProfileError as error:
            say(f"{path}: unreadable ({error}); starting fresh")
            return partial
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("version") != VERSION:
            say(f"{path}: not a partial profile of this version; starting fresh")
            return partial
        if data.get("key") != partial.key:
            saved = data.get("key") if isinstance(data.get("key"), dict) else {}
            changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in partial.key.items() if saved.get(k) != v]
            say(f"{path} was made with other settings ({', '.join(changed) or 'different keys'}); starting fresh")
            return partial
        chunks, rounds = data.get("step_chunks"), data.get("rounds")
        valid = (
            isinstance(chunks, list) and all(isinstance(c, list) and all(_is_time(t) for t in c) for c in chunks)
            and isinstance(rounds, list) and all(_valid_round(r) for r in rounds)
        )
        if not valid:
            say(f"{path}: malformed measurements; starting fresh")
            return partial
        partial.step_chunks, partial.rounds = chunks, rounds
        return partial

    def steps(self, index: int) -> list[float]:
        """The step times of chunk `index` measured so far (by this run or an interrupted one)."""
        return list(self.step_chunks[index]) if index < len(self.step_chunks) else []

    def add_step(self, index: int, milliseconds: float) -> None:
        if index > len(self.step_chunks):
            raise ValueError(f"step chunk {index} recorded before chunk {len(self.step_chunks)}")
        if index == len(self.step_chunks):
            self.step_chunks.append([])
        self.step_chunks[index].append(milliseconds)
        self.flush(force=True)  # a step of a large model takes up to minutes: always worth keeping

    def round(self, index: int) -> RoundStore:
        while len(self.rounds) <= index:
            self.rounds.append({"fingerprint": None, "nodes": {}})
        return RoundStore(self, self.rounds[index])

    def flush(self, force: bool = False) -> None:
        """Write the file (atomically) if something changed and a second has passed, or when `force`d."""
        self._dirty = True
        if self.path is None or (not force and time.monotonic() - self._flushed_at < FLUSH_INTERVAL_S):
            return
        data = {"schema": SCHEMA, "version": VERSION, "key": self.key, "step_chunks": self.step_chunks, "rounds": self.rounds}
        atomic_write_json(self.path, data)
        self._flushed_at = time.monotonic()
        self._dirty = False

    def save(self) -> None:
        """Write whatever is not on disk yet (called when the run stops, interrupted or not)."""
        if self._dirty:
            self.flush(force=True)

    def remove(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    @property
    def num_timed_nodes(self) -> int:
        return sum(len(r.get("nodes", {})) for r in self.rounds)


def _valid_round(value: Any) -> bool:
    if not isinstance(value, dict) or not isinstance(value.get("nodes"), dict):
        return False
    if value.get("fingerprint") is not None and not isinstance(value.get("fingerprint"), str):
        return False
    return all(isinstance(t, list) and len(t) == 2 and all(_is_time(x) for x in t) for t in value["nodes"].values())
