"""Every rank runs the same job (checked when a plan is activated), hears rank 0's word (`broadcast_json`) and
agrees on what each tried alone (`agree`).

Each rank builds its stage from its own copy of the graph, the plan and the training config. If two
ranks hold different ones (each profiled and partitioned on its own, a stale plan file on one
machine, another `--batch_size`), the messages between them may still match in shape and the run
would train some other model without a word. So `check_same_job` all-gathers three short digests over
the control group and refuses any difference, naming the ranks and what differs.

- graph: the structure only (node ids, edges, each node's layer). Timings may differ between ranks'
  copies (a profile per machine) without changing what runs.
- plan: each stage's node ids and ranks, and the plan version.
- config: every `TrainConfig` field (batch size, microbatches, schedule, seed, precision, ...).

The digests travel as int64 tensors (nothing is pickled).

`agree` is the other agreement: after a step every rank tried alone (each rank's part of a live plan
switch, migration.py), one all-gather of a flag and a short cause per rank, so every rank reaches the
same verdict - go on, or undo - and knows which rank failed and why.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.wire.comm import wait_work

_CONTENTS = ("its contents: a token file's size and sampled blocks, a Dataset's samples 0, n/2 and n-1, an iterable's or "
             "a batch(step) object's first minibatch")
PARTS = ("graph", "plan", "config", "stage times (the profile's or the plan's stage_times; zero bubble's order is built from them)",
         f"data ({_CONTENTS})", f"validation data ({_CONTENTS})")
_DATA_PARTS = 2  # the last ones: compared only among the ranks that could read them
_DEVICE_INDEX = re.compile(r"cuda:\d+")


def _digest(value: Any) -> int:
    # A device index is per rank (each GPU rank traces on its own cuda:N), not part of the job.
    text = _DEVICE_INDEX.sub("cuda", json.dumps(value, sort_keys=True, default=repr, separators=(",", ":")))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def graph_digest(graph: Graph, shapes: bool = True) -> int:
    """The graph's structure: node ids, edges and layers (not its timings or sizes). `shapes=False` leaves out the
    layers' output shapes: a resume's graph may have been profiled at another batch size (graph_identity.py)."""
    return _digest([[n.node_id, layer_fields(n, shapes)] for n in graph.nodes] + [list(edge) for edge in graph.edges])


def layer_fields(node: Any, shapes: bool = True) -> Optional[dict[str, Any]]:
    """A node's layer as the digest sees it (None for a node without one)."""
    if node.layer is None:
        return None
    fields = dataclasses.asdict(node.layer)
    if not shapes:
        fields.pop("outputs", None)
    return fields


def plan_digest(plan: Plan) -> int:
    return _digest([plan.version] + [[list(s.node_ids), list(s.ranks)] for s in plan.stages])


def config_digest(config: TrainConfig) -> int:
    return _digest(dataclasses.asdict(config))


def data_digest(content: Optional[Mapping[str, Any]]) -> int:
    """The data's contents as checkpoint/data_identity.data_content reads them; 0 where it reads none (a source
    without a fingerprint, or one unreadable on this rank): `check_same_job` then compares the others."""
    return _digest(content) if content is not None else 0


def check_same_job(graph_hash: int, plan: Plan, config: TrainConfig, group: Any, timeout: float,
                   order_times: Any = None, data_hash: int = 0, eval_data_hash: int = 0) -> None:
    """Collective over `group` (every rank calls it together): raise PlanError unless all ranks hold
    the same graph structure, plan and config, the same stage times `order_times` (runtime/step/auto.py
    `run_order_times`: what a zero-bubble order is list-built from; None where the fixed order runs) and the same
    data (`data_hash`: stage 0 reads a minibatch's inputs and the last stage its targets, each from its own copy, so
    two copies that differ pair inputs with other samples' targets, silently; `eval_data_hash` the same for the
    validation data, whose loss would be reported from such pairs)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    times = None if order_times is None else [dataclasses.astuple(t) for t in order_times]
    mine = torch.tensor([graph_hash, plan_digest(plan), config_digest(config), _digest(times), data_hash,
                         eval_data_hash], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    wait_work(dist.all_gather(gathered, mine, group=group, async_op=True), timeout, -1,
              "the check that every rank runs the same job")
    differing = [(part, [rank for rank, row in enumerate(gathered) if int(row[index]) != int(gathered[0][index])])
                 for index, part in enumerate(PARTS[:-_DATA_PARTS])]
    # The data only where a rank could read it (0: none given, or unreadable there, as an intermediate stage's copy
    # may be: it reads nothing), against the lowest such rank's.
    reference = {}
    for index in range(len(PARTS) - _DATA_PARTS, len(PARTS)):
        known = [(rank, int(row[index])) for rank, row in enumerate(gathered) if int(row[index]) != 0]
        differing.append((PARTS[index], [rank for rank, value in known if value != known[0][1]]))
        reference[PARTS[index]] = f"rank {known[0][0]}" if known else ""
    differing = [(part, ranks) for part, ranks in differing if ranks]
    if differing:
        what = "; ".join(f"rank(s) {ranks} hold another {part} than {reference.get(part, 'rank 0')}"
                         for part, ranks in differing)
        raise PlanError(f"the ranks do not run the same job: {what}. Every rank must load the same graph, plan, "
                        "training options and data (partition once and copy the files to every machine, the data "
                        "files too; do not profile or partition on each rank separately)")


def broadcast_json(data: Optional[str], src: int, group: Any, timeout: float) -> str:
    """Broadcast a JSON string from `src` to every rank of `group` (length, then bytes)."""
    is_src = dist.get_rank() == src
    payload = (data or "").encode() if is_src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    wait_work(dist.broadcast(length, src, group=group, async_op=True), timeout, src, "control broadcast")
    return broadcast_bytes(payload, int(length.item()), src, group, timeout).decode()


def broadcast_bytes(payload: bytes, length: int, src: int, group: Any, timeout: float) -> bytes:
    """`src`'s `payload` of `length` bytes (a length every rank already knows) on every rank of `group`."""
    if not length:
        return b""
    is_src = dist.get_rank() == src
    assert not is_src or len(payload) == length, (len(payload), length)  # the length was agreed first
    buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_src else torch.empty(length, dtype=torch.uint8)
    wait_work(dist.broadcast(buffer, src, group=group, async_op=True), timeout, src, "control broadcast")
    return payload if is_src else buffer.numpy().tobytes()


CAUSE_BYTES = 240  # a failure's one-line cause, as it travels (longer ones are cut)


def agree(failure: Optional[str], group: Any, timeout: float, what: str) -> dict[int, str]:
    """Collective over `group`: every rank's failure (None where it succeeded), so that all ranks reach one
    verdict on a step they each tried alone (a plan switch: migration.py). Returns {rank: cause} of the
    ranks that failed; a dead peer is a PeerError after `timeout`. Causes travel as bytes (nothing pickled)."""
    row = torch.zeros(1 + CAUSE_BYTES, dtype=torch.uint8)
    if failure is not None:
        data = failure.encode("utf-8", "replace")[:CAUSE_BYTES]
        row[0] = 1
        if data:
            row[1:1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [row]
    if dist.get_world_size(group) > 1:
        gathered = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
        wait_work(dist.all_gather(gathered, row, group=group, async_op=True), timeout, -1, what)
    return {rank: bytes(r[1:].tolist()).rstrip(b"\0").decode("utf-8", "replace") or "no cause given"
            for rank, r in enumerate(gathered) if int(r[0])}
