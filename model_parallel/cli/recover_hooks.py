"""Test hooks of the worker (tests, bench/recovery.py): a rank signals itself (SIGKILL, SIGSTOP) at a known step,
as a recovery begins, as the world re-forms (between registering in the new generation and forming its process
group), or in the middle of a live plan switch, as `MP_TEST_SIGNAL_AT_STEP` (`SIGNAL_ENV`) names.

So a test kills a rank where it means to whatever the machine's speed, without sleeps; unset, nothing is armed.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


SIGNAL_ENV = "MP_TEST_SIGNAL_AT_STEP"  # "<original rank>:<step>:<KILL|STOP>[,...]": tests kill a rank at a known step
AT_RECOVERY = -1  # the step `recovery` of SIGNAL_ENV: as the rank begins re-forming the world (a failure during recovery)
AT_SWITCH = -2  # the step `switch`: in a live plan switch, its layers moved, as it builds the new stage (a kill mid-migration)
AT_REFORM = -3  # the step `reform`: registered in a new generation whose membership closed with it, before its group forms
_NAMED = {"recovery": AT_RECOVERY, "switch": AT_SWITCH, "reform": AT_REFORM}
_FIRED: set[int] = set()  # the one-shot steps (`reform`) this process already signalled itself at


def signal_hook(original_rank: int) -> dict[int, int]:
    """The steps at which the test hook signals this process ({step: signal number})."""
    out = {}
    for item in filter(None, os.environ.get(SIGNAL_ENV, "").split(",")):
        who, step, name = item.split(":")
        if int(who) == original_rank:
            out[_NAMED[step] if step in _NAMED else int(step)] = int(getattr(signal, f"SIG{name}"))
    return out


def arm_signal_hook(engine: Any, original_rank: int, rank: int, flush: Optional[Callable[[float], bool]] = None) -> None:
    """The test hook: this process signals itself (SIGKILL, SIGSTOP) as the steps `SIGNAL_ENV` names begin (under
    --redundancy, once its buddy holds its newest snapshot: `flush`, bounded, so the test knows what was copied),
    or (`switch`) in the middle of a live plan switch: after the layers moved, before the new stage is live."""
    signals = signal_hook(original_rank)
    signals.pop(AT_RECOVERY, None)  # signal_at_recovery's (Survivor._recover calls it)
    signals.pop(AT_REFORM, None)  # signal_at_reform's (runtime/wire/recovery.reform calls it)
    if AT_SWITCH in signals:
        number, prepare, apply = signals.pop(AT_SWITCH), engine.prepare, engine.apply

        def preparing(*args: Any, **kwargs: Any) -> Any:
            logger.error("[rank %d] test hook %s: signal %s in a plan switch, its layers moved", rank, SIGNAL_ENV, number)
            os.kill(os.getpid(), number)
            return prepare(*args, **kwargs)

        def applying(command: Any) -> Any:
            if command.kind != "switch":
                return apply(command)
            engine.prepare = preparing  # only inside the switch (activate() builds the first stage with it too)
            try:
                return apply(command)
            finally:
                engine.prepare = prepare

        engine.apply = applying
    if not signals:
        return
    original = engine.train_step

    def hooked(step: int) -> Any:
        if step in signals:
            if flush is not None and not flush(30.0):
                logger.warning("[rank %d] test hook: the buddy did not acknowledge the newest snapshot in 30 s", rank)
            logger.error("[rank %d] test hook %s: signal %s at step %d", rank, SIGNAL_ENV, signals[step], step)
            os.kill(os.getpid(), signals.pop(step))
        return original(step)

    engine.train_step = hooked


def signal_at_recovery(original_rank: int, rank: int) -> None:
    """The `recovery` step of the hook: this process signals itself as it begins re-forming the world (a second
    failure, during a recovery: `Survivor._recover`)."""
    number = signal_hook(original_rank).get(AT_RECOVERY)
    if number is not None:
        logger.error("[rank %d] test hook %s: signal %s as the recovery begins", rank, SIGNAL_ENV, number)
        os.kill(os.getpid(), number)


def signal_at_reform(original_rank: int, rank: int) -> Optional[Callable[[int], None]]:
    """The `reform` step of the hook, as the `on_closed` callback of runtime/wire/recovery.reform (None where this
    process has no such step: reform then waits for nobody): this process signals itself once the membership of a
    new generation closed with it in it and every member read it, before its process group forms (a member lost
    while the world re-forms). Once per process: a stopped one that continues and meets again must not stop again."""
    number = signal_hook(original_rank).get(AT_REFORM)
    if number is None:
        return None

    def closed(generation: int) -> None:
        if AT_REFORM not in _FIRED:
            _FIRED.add(AT_REFORM)
            logger.error("[rank %d] test hook %s: signal %s in generation %d's membership, before its process group "
                         "forms", rank, SIGNAL_ENV, number, generation)
            os.kill(os.getpid(), number)

    return closed


def worker_hook(rank: int) -> Optional[Callable[[Any], None]]:
    """What a worker without --recover arms on each engine it runs (its rank is its original rank), or None unset."""
    return (lambda engine: arm_signal_hook(engine, rank, rank)) if os.environ.get(SIGNAL_ENV) else None
