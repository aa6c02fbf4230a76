"""Gloo's event-loop threads at a low CPU priority, so they never take a core from a training thread.

Why (measured, docs/runtime.md "Fixed cost per step"): gloo's TCP transport reads every incoming
message on one loop thread per process group ("gloo_tcp_loop"). The loop handles a socket only if it
gets the pair's lock at once (`Pair::handleEvents`, a try-lock: the training thread holds that lock
while it posts a send or a receive); otherwise it returns to a level-triggered epoll, which wakes it
again at once: it spins. Where a machine has fewer cores than busy threads (2 ranks on 2 cores are
4 threads), a woken loop thread also preempts a training thread, often the very one that holds the
lock, and spins out its time slice. perf on the tiny row (2 stages, m = 4, 2 cores): ~2000 epoll_wait
calls per step on each rank, the loop thread as busy as the training thread, a step 5.4 ms against
torch's 2.9 ms.

At nice 19 a loop thread still runs at once on an idle core and whenever its own training thread
waits (which is when it needs a message read), but it no longer preempts a training thread that can
run. Same world, both runtimes in the same processes (so torch's side gets the same threads): our
1F1B step 4.7-5.4 -> 2.3-2.8 ms, torch's 2.7-3.4 -> 2.9-3.3; the compute-bound rows (mlp, resnet50, gpt2) within
noise (nice 19 / gloo's default in one world: 0.95-1.04).
Raising a thread's nice value needs no privilege; 0 leaves the threads as gloo made them.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

LOOP_THREAD_NAME = "gloo_tcp_loop"  # gloo names its loop threads so (gloo/transport/tcp/loop.cc)
TASKS = "/proc/self/task"  # Linux: one entry per thread of this process; elsewhere nothing is changed


def lower_loop_threads(nice: int) -> list[int]:
    """Give every gloo loop thread of this process a nice value of at least `nice` (0: none changed).
    Idempotent: call it after creating process groups (each has its own loop thread). Returns the ids of
    the threads it changed."""
    if nice <= 0 or not os.path.isdir(TASKS):
        return []
    changed = []
    for entry in os.listdir(TASKS):
        try:
            with open(os.path.join(TASKS, entry, "comm")) as name:
                if name.read().strip() != LOOP_THREAD_NAME:
                    continue
            tid = int(entry)  # /proc/self/task lists thread ids only
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)  # on Linux a thread id names that one thread
                changed.append(tid)
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile: nothing to lower
            continue
        except OSError as error:  # the system refused (a sandbox): training is unchanged, only slower where it spins
            log.warning("could not lower gloo's loop thread %s to nice %d (%s); it keeps gloo's priority "
                        "(pass --gloo_loop_nice 0 to skip this)", entry, nice, error)
    if changed:
        log.debug("gloo loop threads %s at nice %d", changed, nice)
    return changed
