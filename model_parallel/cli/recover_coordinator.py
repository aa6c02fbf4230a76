"""`--recover --coordinator`: what a re-formed world tells the coordinator (its generation, who is in it, the plan
version every survivor runs, and after an admission the plan it keeps running), agreed over the new world's store
before anyone builds its engine."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from model_parallel.errors import PeerError, ProtocolError

logger = logging.getLogger(__name__)

_FLOOR = "plan_floor/{}"
_LIVE_PLAN = "live_plan"


@dataclass(frozen=True)
class Recovered:
    """A re-formed world as the coordinator hears of it (the register message's `generation`/`membership`)."""

    generation: int
    members: tuple[int, ...]  # original ranks; new rank = index
    lost: tuple[int, ...]  # original ranks of the previous world not in this one
    from_step: int  # the first step this world runs (the restored checkpoint's next)
    plan_version: int  # the version of the plan it runs: above every version a member knew of
    joined: tuple[int, ...] = ()  # original ranks admitted into this world (cli/worker_join.py), spares in `plan`
    plan: Any = None  # the graph.plan.Plan it runs (an admission: the admitting world's); None: the even split

    def membership(self) -> dict[str, Any]:
        out = {"members": list(self.members), "lost": list(self.lost), "from_step": self.from_step}
        return {**out, "joined": list(self.joined)} if self.joined else out


def known_version(engine: Any) -> int:
    """The newest plan version this process knew of when its world failed: the plan it ran, a switch its channel
    admitted, the newest the coordinator said it had spent."""
    if engine is None:
        return 0
    channel = getattr(engine, "channel", None)
    channel = getattr(channel, "inner", channel)  # a static-plan wrapper (runtime/build/pipedream.py)
    return max(int(engine.plan.version), int(getattr(channel, "plan_floor", 0) or 0), int(getattr(channel, "issued", 0) or 0))


def agree_plan_version(store: Any, me: int, members: tuple[int, ...], known: int, timeout: float) -> int:
    """Every member publishes the newest version it knew of; all take the maximum + 1 (collective over `store`,
    the new world's: every member calls it once, right after the world re-formed)."""
    store.set(_FLOOR.format(me), str(int(known)))
    keys = [_FLOOR.format(m) for m in members]
    try:
        store.wait(keys, timedelta(seconds=timeout))
        return max(int(store.get(k).decode()) for k in keys) + 1
    except Exception as error:  # noqa: BLE001 - the store's own timeout, or its host gone: a second failure
        raise PeerError(f"original rank {me}: the survivors did not agree on the recovered plan's version within "
                        f"{timeout:g} s: {str(error).splitlines()[0][:200] if str(error) else type(error).__name__}") from None


def agree_live_plan(store: Any, rank: int, plan: Optional[Any], timeout: float) -> Any:
    """After an admission under a coordinator: the plan the admitting world ran, as its rank 0 knew it, for every
    member (the joiner knows none): the world keeps it and the joiner is a spare until the coordinator gives it a
    share (collective over the new world's `store`; rank 0 passes its plan, the others None)."""
    from model_parallel import jsonbound
    from model_parallel.graph.plan import Plan

    if rank == 0:
        assert plan is not None
        store.set(_LIVE_PLAN, json.dumps(plan.to_dict()))
    try:
        store.wait([_LIVE_PLAN], timedelta(seconds=timeout))
        text = store.get(_LIVE_PLAN).decode()
    except Exception as error:  # noqa: BLE001 - the store's own timeout, or its host gone: a second failure
        raise PeerError(f"rank {rank}: the admitting world's plan did not arrive within {timeout:g} s: "
                        f"{str(error).splitlines()[0][:200] if str(error) else type(error).__name__}") from None
    return Plan.from_dict(jsonbound.loads(text, where="the admitting world's plan", error=ProtocolError),
                          "the admitting world's plan")
