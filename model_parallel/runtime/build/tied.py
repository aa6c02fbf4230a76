"""Tied parameters split across stages: one logical parameter on every rank that holds a copy.

GPT-2's token embedding (stage 0) is also its output layer's weight (the last stage). Each rank
holding a user of such a tie holds a copy (every rank builds the same seed model, so the copies
start identical, which `check_identical` verifies). Per step, as Megatron and DeepSpeed do for
embeddings:

    backward (each copy gets the gradient of its own uses, on each replica its own microbatches)
    tie all-reduce: sum the copies' raw gradients over every rank holding one   <- this module
    replica all-reduce of the stage's other parameters (replicas.py; the tied ones are summed already)
    clip by the global norm (a tied parameter counted once) and step: identical grads, identical values

So each copy's gradient is the single-process gradient (the sum over both uses and all microbatches)
at the cost of one all-reduce of the tied tensor per step. Checkpoints store a tie once, under its
first user's key (`stored_keys`), and restore it into every copy; a plan switch moves a copy with
its optimizer state (`expand_state`). The asynchronous pipedream schedule updates each stage after
every microbatch at different times, so the copies cannot stay identical: `check_schedule` refuses it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from model_parallel.codegen.naming import find_ties
from model_parallel.codegen.ties import check_ties, split_ties
from model_parallel.errors import TiedParameterError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.runtime.wire import comm

PIPEDREAM_REASON = ("the pipedream schedule updates each stage after every microbatch, at different times, so copies on "
                    "different stages cannot stay one parameter; use the 1f1b or gpipe schedule")


@dataclass(frozen=True)
class SplitTie:
    """One tie whose users a plan puts on several stages."""

    names: tuple[str, ...]  # the tensor's original names
    paths: tuple[tuple[int, str], ...]  # (stage, the attribute path of its copy in that stage's module)
    ranks: tuple[int, ...]  # every rank holding a copy (all replicas of those stages), sorted

    def describe(self) -> str:
        return f"tie ({', '.join(self.names)}) on stages {sorted({s for s, _ in self.paths})}, ranks {list(self.ranks)}"


def plan_ties(graph: Graph, plan: Plan) -> tuple[SplitTie, ...]:
    """Every tie `plan` splits across stages, in `find_ties` order (the same on every rank)."""
    found = []
    for tie, stages in split_ties(graph, plan.stage_of):
        paths: dict[int, str] = {}
        for node_id, path in tie.users:  # the first path in a stage is the tensor its other paths point at
            paths.setdefault(stages[node_id], path)
        ranks = sorted({r for s in paths for r in plan.stages[s].ranks})
        found.append(SplitTie(tie.names, tuple(sorted(paths.items())), tuple(ranks)))
    return tuple(found)


def check_trainable(ties: tuple[SplitTie, ...], modules: Mapping[str, Any]) -> None:
    """Refuse a split tie of a buffer (a module may update it in forward, on one stage only), on every
    rank alike: `modules` is the whole model's layer objects (runtime.build.stages.layer_modules)."""
    for tie in ties:
        stage, path = tie.paths[0]
        layer, _, rest = path.partition(".")
        held: Any = modules.get(layer)
        for part in rest.split(".") if rest else ():
            held = getattr(held, part, None)
        if not isinstance(held, nn.Parameter):
            raise TiedParameterError(
                f"the {tie.describe()} is a buffer ({path!r} of stage {stage}), not a Parameter: a module may update "
                "a buffer in forward, on one stage only, so copies cannot be kept identical. Put its users in one stage")


def check_schedule(graph: Graph, plan: Plan, schedule: str) -> None:
    """Refuse a split tie under a schedule that cannot keep its copies identical (pipedream). Every flush schedule
    (the zero-bubble ones too: after the rank's last W) sums the copies' gradients before the one update."""
    if schedule == "pipedream":
        check_ties(graph, plan.stage_of, PIPEDREAM_REASON)


# ---- checkpoints and migration: a tie is one value under one key --------------------------------------
def stored_keys(graph: Graph) -> dict[str, str]:
    """Stage state key of a tie's other attributes -> the key it is stored under (its first user's).

    `lm_head.weight -> wte.weight` for GPT-2: a checkpoint holds the tensor once, as `wte.weight`,
    whichever stages hold copies; a stage holding only `lm_head` restores it from `wte.weight`."""
    keys: dict[str, str] = {}
    for tie in find_ties(graph):
        paths = list(dict.fromkeys(path for _, path in tie.users))
        keys.update({path: paths[0] for path in paths[1:]})
    return keys


def without_aliases(values: Mapping[str, Any], graph: Graph) -> dict[str, Any]:
    """`values` (by stage key) without the keys `stored_keys` maps to another: what a shard stores."""
    aliases = stored_keys(graph)
    return {key: value for key, value in values.items() if key not in aliases}


def expand_state(graph: Graph, state: Mapping[str, Any]) -> dict[str, Any]:
    """Optimizer state by parameter name with every key of a tie present (a stage names a tied Parameter
    once, by whichever attribute comes first; the stage it moves to may hold it under another)."""
    out = dict(state)
    for tie in find_ties(graph):
        paths = list(dict.fromkeys(path for _, path in tie.users))
        entry = next((state[p] for p in paths if p in state), None)
        if entry is not None:
            out.update({p: entry for p in paths if p not in out})
    return out


# ---- one rank's copies ---------------------------------------------------------------------------
class TiedCopies:
    """The copies of split ties this rank holds, and the collectives over the ranks holding each.

    A rank holding several stages (interleaved, loop placement) may hold several users of one tie: its
    layers are one model, so they share one Parameter (materialize: "ties stay ties"), counted once here;
    distinct objects (none are built today) would be summed on the rank before the all-reduce.
    `group(ranks)` returns the process group of those ranks; creating groups is collective, so the
    constructor creates every tie's group on every rank (spares included), in the same order."""

    def __init__(self, ties: tuple[SplitTie, ...], rank: int, stage_ids: tuple[int, ...], stage: Optional[nn.Module],
                 group: Callable[[tuple[int, ...]], Any]) -> None:
        self.ties = ties
        self._groups = {tie.ranks: group(tie.ranks) for tie in ties}
        # One stage's module, or a rank's multi_stage.StageGroup: both name each layer's members alike.
        named = dict(stage.named_parameters(remove_duplicate=False)) if stage is not None else {}
        self.local: list[tuple[SplitTie, list[nn.Parameter]]] = []
        for tie in ties:
            copies: dict[int, nn.Parameter] = {}
            for stage_id, path in tie.paths:
                if stage_id not in stage_ids:
                    continue
                param = named.get(path)
                assert param is not None, f"rank {rank} stage {stage_id}: {path!r} is not a Parameter (check_trainable)"
                copies.setdefault(id(param), param)
            if copies:
                self.local.append((tie, list(copies.values())))

    @property
    def param_ids(self) -> set[int]:
        """ids of this rank's tied copies (left out of the replica all-reduce: summed here already)."""
        return {id(p) for _, params in self.local for p in params}

    def _by_group(self, trainable: bool = False) -> dict[tuple[int, ...], list[list[nn.Parameter]]]:
        grouped: dict[tuple[int, ...], list[list[nn.Parameter]]] = {}
        for tie, params in self.local:
            if not trainable or params[0].requires_grad:  # a frozen tie keeps no gradient (and gets no update)
                grouped.setdefault(tie.ranks, []).append(params)
        return dict(sorted(grouped.items()))

    def all_reduce_grads(self, timeout: float) -> None:
        """Sum every copy's raw gradient over the ranks holding one (one flat all-reduce per rank set)."""
        for ranks, ties in self._by_group(trainable=True).items():
            grads = [_local_grad(params) for params in ties]
            flat = torch.cat([g.reshape(-1) for g in grads])
            work = dist.all_reduce(flat, group=self._groups[ranks], async_op=True)
            comm.wait_work(work, timeout, -1, f"tied-parameter all-reduce over ranks {list(ranks)}")
            offset = 0
            for params, g in zip(ties, grads):
                for p in params:
                    p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
                offset += g.numel()

    def squared_norm(self) -> float:
        """This rank's share of the tied gradients' squared norm: each tie counted once over its holders."""
        total = 0.0
        for tie, params in self.local:
            if params[0].grad is not None:
                total += float(params[0].grad.detach().double().pow(2).sum()) / len(tie.ranks)
        return total

    def check_identical(self, timeout: float, when: str) -> None:
        """Raise `TiedParameterError` unless every holder's copy has the same checksum (collective over
        each tie's ranks). Copies that start from the same seed and get the same updates are bitwise equal."""
        for ranks, ties in self._by_group().items():
            sums = torch.cat([_checksum(params[0]) for params in ties])
            # One MAX all-reduce gives every entry's maximum and minimum, and whether any holder's values are not
            # finite (NaN never equals NaN: a diverged run, not copies built from different seeds).
            bad = (~torch.isfinite(sums)).double()
            sums = torch.nan_to_num(sums)
            both = torch.cat([sums, -sums, bad])
            work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._groups[ranks], async_op=True)
            comm.wait_work(work, timeout, -1, f"tied-parameter check over ranks {list(ranks)}")
            high, low, bad = both[:len(sums)], -both[len(sums):2 * len(sums)], both[2 * len(sums):]
            for index, (tie, params) in enumerate(t for t in self.local if t[0].ranks == ranks):
                if bool(bad[2 * index:2 * index + 2].any()):
                    raise TiedParameterError(
                        f"the {tie.describe()} holds non-finite values (NaN or inf) {when}: the training diverged; "
                        "lower the learning rate (--lr), clip gradients (--clip_grad), or look for bad data")
                same_here = all(torch.equal(params[0], p) for p in params[1:])
                if not same_here or not torch.equal(high[2 * index:2 * index + 2], low[2 * index:2 * index + 2]):
                    raise TiedParameterError(
                        f"the copies of the {tie.describe()} differ {when}; every rank must build the model from the "
                        "same seed (same --seed, same model code) so tied copies start identical")


def _local_grad(params: list[nn.Parameter]) -> torch.Tensor:
    """The sum of this rank's copies' gradients of one tie (one copy: its gradient, or zeros without one)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros_like(params[0])
    return grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)


CHECKSUM_CHUNK = 1 << 20  # elements summed at a time: 16 MB of float64 copy and weights, whatever the parameter's size


def _checksum(param: torch.Tensor) -> torch.Tensor:
    """Two float64 numbers that differ when the values do (a plain sum and one weighted by position, 1 to 2).
    Chunked: a whole float64 copy and its weights were 4x the parameter at once, at every checkpoint (a capped rank
    holding a GPT-2's tied 24 MB embedding ran out of memory there, having trained under the same cap). Every holder
    sums in the same order, so equal values give equal checksums."""
    flat = param.detach().reshape(-1)
    count = flat.numel()
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, count, CHECKSUM_CHUNK):
        piece = flat[start:start + CHECKSUM_CHUNK].double()
        weights = torch.arange(start, start + piece.numel(), dtype=torch.float64, device=flat.device) / max(count - 1, 1) + 1
        total += piece.sum()
        weighted += torch.dot(piece, weights)
    return torch.stack([total, weighted])
