"""Where `--recover` restores the lost rank's stage from, in this order: a live replica on a survivor, a survivor's
`--redundancy` copy of the lost rank's stage, the latest committed checkpoint (docs/reliability.md, "Recovery sources").

Before its failed engine is dropped, each survivor takes its stage state at the last step boundary
(runtime/checkpoint/live.py); under `--redundancy 1` it also holds its own snapshots of the last two snapshot steps
and its copy of another rank's (cli/redundancy.py). In the new world, over its store (JSON, never pickled; every
wait bounded):

1. each member posts what it holds: `sources/post/<original rank>` = for each state, whose it is, the step it
   belongs to, its stages and plan (and why it holds no live state, when it does not);
2. each waits up to --timeout for every member's post and decides (`decide`, the same pure rule everywhere);
   the first decision written (`compare_set` on `sources/decision`) is the one all follow, so a late post
   cannot split the world;
3. the newest step k newer than the latest committed checkpoint for which every stage of the plan has a state
   on some survivor: for each stage the holder of a live replica, else of a redundancy copy (the lowest original
   rank first) writes its shard of checkpoint k, the lowest writer commits it (manifest, then `latest`) and reports
   `sources/commit`; the run then resumes from it as from any checkpoint (re-planned for the survivors, each rank
   reading only its layers). With states of the last completed step, only the step in progress is redone.
4. otherwise (a stage with no surviving copy, a plan switch under way, a write that failed): the latest committed
   checkpoint, as before, and the reason goes into the recovery line.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from model_parallel.errors import PeerError

logger = logging.getLogger(__name__)

_POST = "sources/post/{}"
_WRITTEN = "sources/written/{}"
_DECISION = "sources/decision"
_COMMIT = "sources/commit"
WRITE_TIMEOUTS = 3.0  # of --timeout: how long the committer waits for the shards (a disk write, not a heartbeat)


@dataclass(frozen=True)
class Source:
    """What the new world restores: kind "replica" or "redundancy" (live states, committed as checkpoint `step`), or
    "checkpoint"."""

    kind: str
    step: Optional[int]  # the checkpoint step restored (None: no committed checkpoint exists)
    text: str  # "the replica of stage 0 on original rank 0", "checkpoint step 3"
    why: str = ""  # why no live state was used ("" when one was, or when none was newer than the checkpoint)


def post_of(holdings: list[tuple[int, Any]], why: str, can_commit: bool) -> dict[str, Any]:
    """What this survivor tells the others: its states ((original rank whose it is, live.StageState)), why it has
    no live one (""), whether it can commit (it holds the model files' graph)."""
    return {"holdings": [{"of": of, **state.summary()} for of, state in holdings], "why": why, "commit": can_commit}


def decide(posts: dict[int, Optional[dict[str, Any]]], old_members: tuple[int, ...], lost: tuple[int, ...],
           latest: Optional[int]) -> dict[str, Any]:
    """The source every survivor applies alike, from every member's post (None: it posted nothing in time).

    `old_members`: original ranks of the failed world (its rank r is old_members[r]); `lost`: those not in the
    new one; `latest`: the latest committed checkpoint step (None: none)."""
    entries = [(holder, h) for holder, post in sorted(posts.items()) if post is not None for h in post["holdings"]]
    notes = [f"original rank {o} posted no live state in time" if p is None else f"original rank {o}: {p['why']}"
             for o, p in sorted(posts.items()) if p is None or p["why"]]
    lost_ranks = {old_members.index(o) for o in lost if o in old_members}
    why = ""
    for step in sorted({h["step"] for _, h in entries}, reverse=True):
        if latest is not None and step <= latest:
            break
        at = [(o, h) for o, h in entries if h["step"] == step]
        if len({(h["version"], json.dumps(h["stage_ranks"])) for _, h in at}) > 1:
            why = why or f"the states of step {step} belong to different plans (a plan switch was under way)"
            continue
        stage_ranks = at[0][1]["stage_ranks"]
        chosen: dict[int, tuple[int, dict[str, Any]]] = {}  # stage -> (holder, state): a live replica before a copy
        for holder, h in sorted(at, key=lambda e: (e[1]["of"] != e[0], e[0])):
            for stage in h["stages"]:
                chosen.setdefault(stage, (holder, h))
        missing = [k for k in range(len(stage_ranks)) if k not in chosen]
        committers = sorted(o for o, _ in chosen.values() if (posts[o] or {}).get("commit"))
        if missing or not committers:
            why = why or (f"stage(s) {missing} had no state of step {step} outside the lost original rank(s) "
                          f"{list(lost)} (no replica, no --redundancy copy)" if missing else
                          f"no survivor holding a state of step {step} can commit it")
            continue
        lost_stages = [k for k, ranks in enumerate(stage_ranks) if lost_ranks & set(ranks)]
        copies = [k for k in lost_stages if chosen[k][1]["of"] != chosen[k][0]]
        text = ("; ".join(_describe(k, *chosen[k]) for k in lost_stages)
                or "the survivors' live stages (the lost rank held no stage)")
        writers = sorted({(o, h["of"], h["rank"]) for o, h in chosen.values()})
        return {"kind": "redundancy" if copies else "replica", "step": step, "text": text, "why": "",
                "writers": [list(w) for w in writers], "committer": committers[0]}
    why = why or "; ".join(notes) or ("no survivor held a live state" if latest is None else "")
    return {"kind": "checkpoint", "step": latest, "text": "" if latest is None else f"checkpoint step {latest}",
            "why": why, "writers": [], "committer": None}


def _describe(stage: int, holder: int, state: dict[str, Any]) -> str:
    if state["of"] == holder:
        return f"the replica of stage {stage} on original rank {holder}"
    return f"the redundancy copy of original rank {state['of']}'s stage {stage} on original rank {holder}"


def agree_source(store: Any, me: int, members: tuple[int, ...], old_members: tuple[int, ...], lost: tuple[int, ...],
                 holdings: list[tuple[int, Any]], why: str, model_files: Optional[tuple[Any, Any]], directory: str,
                 timeout: float) -> Source:
    """Collective over the new world's `store` (every member calls it once, right after re-forming): decide the
    source, write and commit the live states if that is the decision, and return it. `model_files`: (graph, model)
    of this survivor's failed engine, for the checkpoint's model files (None: it had none). PeerError: the world
    did not finish the commit in time, or its store failed (a second failure)."""
    try:
        return _agree(store, me, members, old_members, lost, holdings, why, model_files, directory, timeout)
    except PeerError:
        raise
    except Exception as error:  # noqa: BLE001 - the store's host gone or its own timeout: a second failure
        raise PeerError(f"original rank {me}: agreeing on the recovery source over the new world's store failed: "
                        f"{str(error).splitlines()[0][:200] if str(error) else type(error).__name__}") from None


def _agree(store: Any, me: int, members: tuple[int, ...], old_members: tuple[int, ...], lost: tuple[int, ...],
           holdings: list[tuple[int, Any]], why: str, model_files: Optional[tuple[Any, Any]], directory: str,
           timeout: float) -> Source:
    from model_parallel.runtime.checkpoint.layout import latest_step

    store.set(_POST.format(me), json.dumps(post_of(holdings, why, model_files is not None)))
    try:
        store.wait([_POST.format(m) for m in members], timedelta(seconds=timeout))
    except Exception as error:  # noqa: BLE001 - the store's own timeout: decide with what was posted
        logger.warning("original rank %d: not every survivor posted its live state within %g s (%s)", me, timeout,
                       str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
    posts = {m: json.loads(store.get(_POST.format(m)).decode()) if store.check([_POST.format(m)]) else None
             for m in members}
    mine = json.dumps(decide(posts, old_members, lost, latest_step(directory)))
    decision = json.loads(store.compare_set(_DECISION, "", mine).decode())
    if decision["kind"] == "checkpoint":
        return Source("checkpoint", decision["step"], decision["text"], decision["why"])
    step, writers, committer = int(decision["step"]), [tuple(w) for w in decision["writers"]], int(decision["committer"])
    mine_held = {(of, state.step): state for of, state in holdings}
    if me in {holder for holder, _, _ in writers}:
        store.set(_WRITTEN.format(me), _attempt(lambda: _write(directory, mine_held, writers, me, step)))
    if me == committer:
        state = mine_held.get((me, step)) or next((s for (_, k), s in mine_held.items() if k == step), None)
        store.set(_COMMIT, _commit(store, directory, state, writers, model_files, timeout) if state and model_files
                  else f"the committer, original rank {me}, holds no state of step {step} or no model files")
    try:
        store.wait([_COMMIT], timedelta(seconds=(WRITE_TIMEOUTS + 1) * timeout))
        outcome = store.get(_COMMIT).decode()
    except Exception as error:  # noqa: BLE001 - the committer is gone: this world is broken, recover again
        raise PeerError(f"original rank {me}: original rank {committer} did not commit the live states within "
                        f"{(WRITE_TIMEOUTS + 1) * timeout:g} s: {str(error).splitlines()[0][:200]}") from None
    if outcome:
        latest = latest_step(directory)  # read after the committer reported: the same on every member
        return Source("checkpoint", latest, f"checkpoint step {latest}", f"writing the live states failed: {outcome}")
    return Source(decision["kind"], step, decision["text"])


def _write(directory: str, held: dict[tuple[int, int], Any], writers: list[tuple[int, int, int]], me: int,
           step: int) -> None:
    from model_parallel.runtime.checkpoint.live import write_shard

    for holder, of, _ in writers:
        if holder == me:
            write_shard(directory, held[(of, step)])


def _commit(store: Any, directory: str, state: Any, writers: list[tuple[int, int, int]], model_files: tuple[Any, Any],
            timeout: float) -> str:
    """The committer: wait for every writer's report, then commit; "" or what failed."""
    from model_parallel.runtime.checkpoint.live import commit

    holders = sorted({holder for holder, _, _ in writers})
    keys = [_WRITTEN.format(o) for o in holders]
    try:
        store.wait(keys, timedelta(seconds=WRITE_TIMEOUTS * timeout))
    except Exception:  # noqa: BLE001 - the store's own timeout
        late = [o for o in holders if not store.check([_WRITTEN.format(o)])]
        return f"original rank(s) {late} did not report their shards within {WRITE_TIMEOUTS * timeout:g} s"
    failed = [(o, store.get(_WRITTEN.format(o)).decode()) for o in holders]
    failed = [(o, text) for o, text in failed if text]
    if failed:
        return "; ".join(f"original rank {o}: {text}" for o, text in failed)
    return _attempt(lambda: commit(directory, state, sorted({rank for _, _, rank in writers}), *model_files))


def _attempt(action: Any) -> str:
    """Run `action`; "" when it worked, else one line saying what failed."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - whatever it is, every member must hear of it
        text = str(error).splitlines()[0][:300] if str(error) else ""
        return text if isinstance(error, OSError) else f"{type(error).__name__}: {text}"
    return ""
