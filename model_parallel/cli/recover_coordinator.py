"""`--recover --coordinator`: what a re-formed world tells the coordinator (its generation, who is in it, the plan
version every survivor runs), agreed over the new world's store before anyone builds its engine."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from model_parallel.errors import PeerError

logger = logging.getLogger(__name__)

_FLOOR = "plan_floor/{}"


@dataclass(frozen=True)
class Recovered:
    """A re-formed world as the coordinator hears of it (the register message's `generation`/`membership`)."""

    generation: int
    members: tuple[int, ...]  # original ranks; new rank = index
    lost: tuple[int, ...]  # original ranks of the previous world not in this one
    from_step: int  # the first step this world runs (the restored checkpoint's next)
    plan_version: int  # the even split's version: above every version a survivor knew of

    def membership(self) -> dict[str, Any]:
        return {"members": list(self.members), "lost": list(self.lost), "from_step": self.from_step}


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
