"""A one-rank gloo world in the test's own process (no process started: the unit tier may use it) and an
engine of the built-in MLP on it: the real training loop (`PipelineEngine.train`) with every file it writes."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from model_parallel.runtime.config import RunOptions, TrainConfig


@contextmanager
def one_rank_world(tmp_path: Path) -> Iterator[None]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def mlp_engine(options: RunOptions, num_microbatches: int = 2):
    """The MLP of `--model mlp` as one stage on rank 0 of the current one-rank world."""
    from model_parallel.profiler.trace import trace_model
    from model_parallel.runtime.build.stages import even_plan
    from model_parallel.runtime.build.zoo import recipe
    from model_parallel.runtime.engine import PipelineEngine

    r = recipe("mlp")
    model = r.model(0)
    graph, _ = trace_model(model, r.example(2))
    return PipelineEngine(graph=graph, plan=even_plan(graph, 1), model=model, criterion=r.criterion,
                          optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01), dataset=r.data(8, 0),
                          config=TrainConfig(batch_size=8, num_microbatches=num_microbatches), options=options)
