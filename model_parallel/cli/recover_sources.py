"""Where `--recover` restores the lost rank's stage from: a live replica on a survivor, else the latest committed
checkpoint (docs/reliability.md, "Recovery sources").

Before its failed engine is dropped, each survivor takes its stage state at the last step boundary
(runtime/checkpoint/live.py). In the new world, over its store (JSON, never pickled; every wait bounded):

1. each member posts what it holds: `sources/post/<original rank>` = the step its state belongs to, its stages,
   its plan version (or why it holds no usable state);
2. each waits up to --timeout for every member's post and decides (`decide`, the same pure rule everywhere);
   the first decision written (`compare_set` on `sources/decision`) is the one all follow, so a late post
   cannot split the world;
3. a live decision: every stage of the old plan has a surviving holder and every survivor stands at the same
   step k. The lowest surviving original rank holding each stage writes its shard of checkpoint k, the first
   of them commits it (manifest, then `latest`) and reports `sources/commit`; the run then resumes from it as
   from any checkpoint (re-planned for the survivors, each rank reading only its layers). So only the step in
   progress is redone. When checkpoint k is already committed, nothing is written.
4. otherwise (a stage with no surviving copy, survivors at different steps, a plan switch under way, a write
   that failed): the latest committed checkpoint, as before, and the reason goes into the recovery line.
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
    """What the new world restores: kind "replica" (live copies, committed as checkpoint `step`) or "checkpoint"."""

    kind: str
    step: Optional[int]  # the checkpoint step restored (None: no committed checkpoint exists)
    text: str  # "the replica of stage 0 on original rank 0", "checkpoint step 3"
    why: str = ""  # why no live copy was used ("" when one was, or when none was needed)


def post_of(state: Any, why: str) -> dict[str, Any]:
    """What this survivor tells the others about its live state (a live.StageState or None)."""
    return {"ok": True, **state.summary()} if state is not None else {"ok": False, "why": why}


def decide(posts: dict[int, Optional[dict[str, Any]]], old_members: tuple[int, ...], lost: tuple[int, ...],
           latest: Optional[int]) -> dict[str, Any]:
    """The source every survivor applies alike, from every member's post (None: it posted nothing in time).

    `old_members`: original ranks of the failed world (its rank r is old_members[r]); `lost`: those not in the
    new one; `latest`: the latest committed checkpoint step (None: none)."""
    for original, post in sorted(posts.items()):
        if post is None:
            return _checkpoint(f"original rank {original} posted no live state in time")
        if not post["ok"]:
            return _checkpoint(f"original rank {original} holds no live state: {post['why']}")
    steps = {o: p["step"] for o, p in posts.items()}
    if len(set(steps.values())) > 1:
        return _checkpoint(f"the survivors stand at different steps {dict(sorted(steps.items()))} (a failure during "
                           f"an update)")
    if len({p["version"] for p in posts.values()}) > 1 or len({json.dumps(p["stage_ranks"]) for p in posts.values()}) > 1:
        return _checkpoint("the survivors ran different plans (a plan switch was under way)")
    step = next(iter(steps.values()))
    stage_ranks = next(iter(posts.values()))["stage_ranks"]
    holder: dict[int, int] = {}  # stage -> the lowest surviving original rank that holds it
    for original, post in sorted(posts.items()):
        for stage in post["stages"]:
            holder.setdefault(stage, original)
    missing = [k for k in range(len(stage_ranks)) if k not in holder]
    if missing:
        return _checkpoint(f"stage(s) {missing} had no copy outside the lost original rank(s) {list(lost)} (no replica)")
    lost_ranks = {old_members.index(o) for o in lost if o in old_members}
    lost_stages = [k for k, ranks in enumerate(stage_ranks) if lost_ranks & set(ranks)]
    text = ("; ".join(f"the replica of stage {k} on original rank {holder[k]}" for k in lost_stages)
            or "the survivors' live stages (the lost rank held no stage)")
    if latest is not None and latest >= step:
        why = "" if latest == step else f"the committed checkpoint (step {latest}) is newer than the live state (step {step})"
        return {"kind": "checkpoint", "step": latest, "text": f"checkpoint step {latest}", "why": why, "writers": {}}
    writers = {str(o): posts[o]["rank"] for o in sorted(set(holder.values()))}
    return {"kind": "replica", "step": step, "text": text, "why": "", "writers": writers}


def _checkpoint(why: str) -> dict[str, Any]:
    return {"kind": "checkpoint", "step": None, "text": "", "why": why, "writers": {}}


def agree_source(store: Any, me: int, members: tuple[int, ...], old_members: tuple[int, ...], lost: tuple[int, ...],
                 state: Any, why: str, directory: str, timeout: float) -> Source:
    """Collective over the new world's `store` (every member calls it once, right after re-forming): decide the
    source, write and commit the live copies if that is the decision, and return it. PeerError: the world did not
    finish the commit in time, or its store failed (a second failure)."""
    try:
        return _agree(store, me, members, old_members, lost, state, why, directory, timeout)
    except PeerError:
        raise
    except Exception as error:  # noqa: BLE001 - the store's host gone or its own timeout: a second failure
        raise PeerError(f"original rank {me}: agreeing on the recovery source over the new world's store failed: "
                        f"{str(error).splitlines()[0][:200] if str(error) else type(error).__name__}") from None


def _agree(store: Any, me: int, members: tuple[int, ...], old_members: tuple[int, ...], lost: tuple[int, ...],
           state: Any, why: str, directory: str, timeout: float) -> Source:
    from model_parallel.runtime.checkpoint.layout import latest_step

    store.set(_POST.format(me), json.dumps(post_of(state, why)))
    posts: dict[int, Optional[dict[str, Any]]] = {}
    try:
        store.wait([_POST.format(m) for m in members], timedelta(seconds=timeout))
    except Exception as error:  # noqa: BLE001 - the store's own timeout: decide with what was posted
        logger.warning("original rank %d: not every survivor posted its live state within %g s (%s)", me, timeout,
                       str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
    for m in members:
        posts[m] = json.loads(store.get(_POST.format(m)).decode()) if store.check([_POST.format(m)]) else None
    mine = json.dumps(decide(posts, old_members, lost, latest_step(directory)))
    decision = json.loads(store.compare_set(_DECISION, "", mine).decode())
    if decision["kind"] != "replica":
        step = decision["step"] if decision["step"] is not None else latest_step(directory)
        return Source("checkpoint", step, decision["text"] or f"checkpoint step {step}", decision["why"])
    writers = {int(o): int(r) for o, r in decision["writers"].items()}
    if me in writers:
        store.set(_WRITTEN.format(me), _attempt(lambda: _write(directory, state, decision["step"])))
    committer = min(writers)
    if me == committer:
        store.set(_COMMIT, _commit(store, directory, state, writers, timeout))
    try:
        store.wait([_COMMIT], timedelta(seconds=(WRITE_TIMEOUTS + 1) * timeout))
        outcome = store.get(_COMMIT).decode()
    except Exception as error:  # noqa: BLE001 - the committer is gone: this world is broken, recover again
        raise PeerError(f"original rank {me}: original rank {committer} did not commit the live copies within "
                        f"{(WRITE_TIMEOUTS + 1) * timeout:g} s: {str(error).splitlines()[0][:200]}") from None
    if outcome:
        step = latest_step(directory)  # read after the committer reported: the same on every member
        return Source("checkpoint", step, f"checkpoint step {step}", f"writing the live copies failed: {outcome}")
    return Source("replica", int(decision["step"]), decision["text"])


def _write(directory: str, state: Any, step: int) -> None:
    from model_parallel.runtime.checkpoint.live import write_shard

    assert state is not None and state.step == step, "a writer holds the decided step's state"
    write_shard(directory, state)


def _commit(store: Any, directory: str, state: Any, writers: dict[int, int], timeout: float) -> str:
    """The committer: wait for every writer's report, then commit; "" or what failed."""
    from model_parallel.runtime.checkpoint.live import commit

    keys = [_WRITTEN.format(o) for o in sorted(writers)]
    try:
        store.wait(keys, timedelta(seconds=WRITE_TIMEOUTS * timeout))
    except Exception:  # noqa: BLE001 - the store's own timeout
        late = [o for o in sorted(writers) if not store.check([_WRITTEN.format(o)])]
        return f"original rank(s) {late} did not report their shard within {WRITE_TIMEOUTS * timeout:g} s"
    failed = [(o, store.get(_WRITTEN.format(o)).decode()) for o in sorted(writers)]
    failed = [(o, text) for o, text in failed if text]
    if failed:
        return "; ".join(f"original rank {o}: {text}" for o, text in failed)
    return _attempt(lambda: commit(directory, state, sorted(writers.values())))


def _attempt(action: Any) -> str:
    """Run `action`; "" when it worked, else one line saying what failed."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - whatever it is, every member must hear of it
        text = str(error).splitlines()[0][:300] if str(error) else ""
        return text if isinstance(error, OSError) else f"{type(error).__name__}: {text}"
    return ""
