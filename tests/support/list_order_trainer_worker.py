"""One rank of tests/integration/test_list_order_trainer.py: PipelineTrainer under zbh1 from a graph whose timings
differ on every rank (as when each rank profiles on its own); rank-stamped result to DIR.

    python tests/support/list_order_trainer_worker.py RANK WORLD PORT DIR
"""
from __future__ import annotations

import datetime
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from model_parallel import PipelineTrainer, RunOptions, TrainConfig
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.step.auto import run_order_times


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    graph, _ = trace_model(model, (torch.randn(2, 16),), (nn.Linear,), route="fx")
    scale = 1.0 + 0.3 * rank  # this rank's own "profile": every rank's differs
    graph = graph.replace_nodes(replace(n, forward_ms=scale * (k + 1), backward_ms=2 * scale * (k + 1))
                                for k, n in enumerate(graph.nodes))
    data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randn(32, 16))
    trainer = PipelineTrainer(graph, lambda params: torch.optim.SGD(params, lr=0.1), data,
                              TrainConfig(batch_size=8, num_microbatches=4, schedule="zbh1"),
                              options=RunOptions(timeout=60, progress=False), criterion=nn.MSELoss())
    times = run_order_times(trainer.graph, trainer.plan, trainer.config)
    trainer.train(2)
    trainer.close()
    (out / f"rank{rank}.json").write_text(json.dumps({"times": [list(map(float, (t.forward_ms, t.input_ms, t.weight_ms)))
                                                               for t in times or ()]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
