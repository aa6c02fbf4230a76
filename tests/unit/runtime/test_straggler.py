"""Straggler injection: a wrapper around measured compute, installed only while a rank is slowed down."""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.config import RunOptions, StragglerInjection, TrainConfig
from model_parallel.runtime.launch import free_port
from model_parallel.runtime.observe.metrics import MetricsRecorder
from model_parallel.runtime.observe.straggler import measured, slowed


def _work(spent: list[float]) -> float:
    start = time.perf_counter()
    time.sleep(0.01)
    spent.append(time.perf_counter() - start)
    return 42.0


def test_slowed_compute_sleeps_inside_the_measurement():
    metrics = MetricsRecorder(0)
    metrics.begin_step(0)
    spent: list[float] = []
    compute = measured(metrics)
    assert compute("forward", 0, lambda: _work(spent)) == 42.0
    assert slowed(compute, 3.0)("backward", 0, lambda: _work(spent)) == 42.0
    record = metrics.end_step(samples=1)
    assert record.forward_ms >= spent[0] * 1e3
    # 3x: the work, then twice its time asleep; all of it counted as compute (backward).
    assert record.backward_ms >= 3 * spent[1] * 1e3
    assert record.compute_ms >= record.forward_ms + 3 * spent[1] * 1e3


def test_the_engine_installs_the_wrapper_from_the_injection_step_and_a_command_removes_it():
    from model_parallel.profiler.trace import trace_model
    from model_parallel.runtime.build.stages import even_plan
    from model_parallel.runtime.engine import PipelineEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        r = recipe("mlp")
        model = r.model(0)
        graph, _ = trace_model(model, r.example(2))
        options = RunOptions(progress=False, straggler=StragglerInjection(2.0, rank=0, after_step=2))
        engine = PipelineEngine(graph=graph, plan=even_plan(graph, 1), model=model, criterion=r.criterion,
                                optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01), dataset=r.data(8, 0),
                                config=TrainConfig(batch_size=8, num_microbatches=2), options=options)
        plain = engine.straggler.compute
        for step in range(2):
            engine.train_step(step)
            assert engine.slowdown == 1.0 and engine.straggler.compute is plain
        engine.train_step(2)
        assert engine.slowdown == 2.0 and engine.straggler.compute is not plain
        engine.slowdown = 1.0  # what a `slowdown` command with factor 1 does (apply())
        engine.train_step(3)
        assert engine.slowdown == 1.0 and engine.straggler.compute is plain  # the injection started once, and is over
        engine.metrics.close()
    finally:
        dist.destroy_process_group()
