"""gloo's event-loop threads at a low CPU priority (runtime/wire/loop_priority.py): which threads, when, and the option."""
from __future__ import annotations

import ctypes
import os
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from model_parallel.cli.worker import build_parser
from model_parallel.cli.worker_job import make_config
from model_parallel.errors import ConfigError
from model_parallel.runtime.config import RunOptions, TrainConfig
from model_parallel.runtime.launch import free_port
from model_parallel.runtime.wire.loop_priority import LOOP_THREAD_NAME, lower_loop_threads
from support import wait_for

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and per-thread nice are Linux's")


class NamedThread:
    """A thread that names itself (as gloo names its loop) and waits until it is told to end."""

    def __init__(self, name: str) -> None:
        self.name, self.ready, self.done = name, threading.Event(), threading.Event()
        self.tid = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        ctypes.CDLL(None).prctl(15, self.name.encode(), 0, 0, 0)  # PR_SET_NAME: what /proc/self/task/N/comm shows
        self.tid = threading.get_native_id()
        self.ready.set()
        self.done.wait(30)

    def nice(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, self.tid)

    def end(self) -> None:
        self.done.set()
        self.thread.join(10)


def _loop_threads() -> dict[int, int]:
    """This process's gloo loop threads: id -> nice."""
    found = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/comm") as name:
                if name.read().strip() == LOOP_THREAD_NAME:
                    found[int(entry)] = os.getpriority(os.PRIO_PROCESS, int(entry))
        except OSError:
            continue
    return found


# New threads start at their creator's nice value: the tests below need room above it.
BASE = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0
room = pytest.mark.skipif(BASE > 10, reason=f"this process already runs at nice {BASE}: no room to lower a thread")


@linux
@room
def test_only_the_loop_threads_are_lowered_once_and_zero_changes_nothing():
    loop, other = NamedThread(LOOP_THREAD_NAME), NamedThread("pt_gloo_runloop")
    try:
        assert lower_loop_threads(0) == [] and loop.nice() == BASE
        assert lower_loop_threads(19) == [loop.tid]
        assert loop.nice() == 19 and other.nice() == BASE and os.getpriority(os.PRIO_PROCESS, 0) == BASE
        assert lower_loop_threads(19) == []  # already there: nothing to change
        assert lower_loop_threads(10) == [] and loop.nice() == 19  # never raises a thread's priority back
    finally:
        loop.end()
        other.end()


@linux
@room
def test_the_engine_lowers_the_loop_threads_of_its_process_groups():
    from model_parallel.profiler.trace import trace_model
    from model_parallel.runtime.build.stages import even_plan
    from model_parallel.runtime.build.zoo import recipe
    from model_parallel.runtime.engine import PipelineEngine

    torch.set_num_threads(1)
    before = set(_loop_threads())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        # gloo names its loop thread from inside the thread: it may still be nameless when init returns
        made = wait_for(lambda: {tid: nice for tid, nice in _loop_threads().items() if tid not in before},
                        what="the default group's loop thread named")
        assert set(made.values()) == {BASE}  # as gloo starts it
        r = recipe("mlp")
        model = r.model(0)
        graph, _ = trace_model(model, r.example(2))
        engine = PipelineEngine(graph=graph, plan=even_plan(graph, 1), model=model, criterion=r.criterion,
                                optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01), dataset=r.data(8, 0),
                                config=TrainConfig(batch_size=8, num_microbatches=2),
                                options=RunOptions(progress=False, gloo_loop_nice=17))
        engine.train(1)  # after its first step the engine lowers every loop thread again: named by then
        made = {tid: nice for tid, nice in _loop_threads().items() if tid not in before}
        assert len(made) >= 2 and set(made.values()) == {17}  # the default group's loop and the engine's control group's
    finally:
        dist.destroy_process_group()


def test_the_option_is_checked_and_the_flag_reaches_it():
    with pytest.raises(ConfigError, match="gloo_loop_nice"):
        RunOptions(gloo_loop_nice=20)
    with pytest.raises(ConfigError, match="gloo_loop_nice"):
        RunOptions(gloo_loop_nice=-1)
    assert RunOptions().gloo_loop_nice == 19
    args = build_parser().parse_args(["--model", "mlp", "--gloo_loop_nice", "0"])
    assert make_config(args)[1].gloo_loop_nice == 0
