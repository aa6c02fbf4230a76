"""A stop asked for by a signal ends the run at a step boundary, after a checkpoint, instead of mid-step.

SIGTERM is what a scheduler sends before it preempts a machine (SLURM, Kubernetes, spot instances) and what
torchrun sends its workers when it stops a job; SIGINT is Ctrl-C. Without this a rank died where it stood: the
steps since the last `--checkpoint_every` were lost, and its peers ended with "rank N stopped responding".

    stop_signals.install()       # the worker command line does this; a Python script may too (main thread)

Only while a training loop runs (`armed`, around runtime/step/loop.run_loop) is a signal deferred: before it
(joining the world, loading weights) and after it, the handler that was there before acts at once. In a loop
the first signal only sets a flag (`requested`). Each rank's part of the step's one reduction carries it
(wire/step_totals.py: the number of ranks asked to stop), so every rank learns at the same step that some rank
was, whichever got the signal (on a preempted machine, only its ranks do). That step ends as usual (its update
applied); then the loop commits a checkpoint of it (with a checkpoint directory) and stops: the worker exits with
EXIT_STOPPED (4), naming the signal and the command that resumes, and `PipelineTrainer.train` raises
`TrainingStopped`. A second signal is not caught: the handler that was there before (the default: end at once;
Ctrl-C's KeyboardInterrupt) is back, for a user who will not wait for the step.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

__all__ = ["install", "armed", "requested", "clear", "SIGNALS"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_requested: Optional[str] = None  # the name of the first signal caught ("SIGTERM"), until `clear`
_previous: dict[int, Any] = {}  # each installed signal's handler before ours: restored once ours has fired
_armed = 0  # training loops running in this process (nested: a recovery's loop inside a worker's)


def install(signals: Sequence[int] = SIGNALS) -> bool:
    """Catch `signals` (a first one sets the flag, a second one gets the earlier handler). Python lets only the
    main thread set handlers: elsewhere (a worker thread of the caller's) nothing is installed and False returned."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for number in signals:
        if number not in _previous:
            _previous[number] = signal.getsignal(number)
        signal.signal(number, _on_signal)
    return True


@contextmanager
def armed() -> Iterator[None]:
    """While a training loop runs: a signal is a request to stop at the next step boundary."""
    global _armed
    _armed += 1
    try:
        yield
    finally:
        _armed -= 1


def requested() -> Optional[str]:
    """The signal that asked this process to stop ("SIGTERM"), or None."""
    return _requested


def clear() -> None:
    """Forget a request and put the earlier handlers back (tests; a process that trains again after a stop)."""
    global _requested
    _requested = None
    for number, handler in _previous.items():
        signal.signal(number, handler)
    _previous.clear()


def _on_signal(number: int, frame: Any) -> None:
    global _requested
    # The next one is the earlier handler's: a second Ctrl-C interrupts, a second SIGTERM ends the process.
    signal.signal(number, _previous.get(number, signal.SIG_DFL))
    if not _armed:  # no step boundary to wait for: this one is the earlier handler's already
        signal.raise_signal(number)
    elif _requested is None:
        _requested = signal.Signals(number).name
