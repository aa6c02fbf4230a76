"""The built-in MLP job that the multi-host, fault and worker-input tests run with the seed's command
lines, and its oracle: single-process training of the same model."""
from __future__ import annotations

from pathlib import Path

import torch

from model_parallel.codegen.naming import state_key
from model_parallel.graph.io import save_graph
from model_parallel.graph.plan import write_plan
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.trainer import single_process_reference


def mlp_job(directory: Path, num_stages: int, batch: int = 8, micro: int = 4, name: str = "plan.json") -> tuple[Path, Path]:
    """graph.json of the workers' built-in `--model mlp`, traced exactly as they trace it, and an even plan."""
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(batch // micro))
    save_graph(graph, directory / "graph.json")
    write_plan(even_plan(graph, num_stages), directory / name)
    return directory / "graph.json", directory / name


def reference_params(steps: int, batch: int = 8, micro: int = 4, lr: float = 0.01) -> dict:
    """Parameters after single-process training of `--model mlp` (SGD, momentum 0.9): the oracle."""
    return reference_run(steps, batch, micro, lr)[0]


def reference_losses(steps: int, batch: int = 8, micro: int = 4, lr: float = 0.01) -> list[float]:
    """The loss of each step of the same single-process training."""
    return reference_run(steps, batch, micro, lr)[1]


def reference_run(steps: int, batch: int = 8, micro: int = 4, lr: float = 0.01) -> tuple[dict, list[float]]:
    r = recipe("mlp")
    model = r.model(0)
    config = TrainConfig(batch_size=batch, num_microbatches=micro)
    losses = single_process_reference(model, r.criterion, lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
                                      r.data(batch, 0), config, steps)
    return {state_key(k): v.detach() for k, v in model.named_parameters()}, losses


def assert_params_close(got: dict, want: dict, what: str = "pipeline run") -> None:
    assert sorted(got) == sorted(want), f"{what}: parameter names differ"
    for key, value in want.items():
        assert torch.allclose(got[key], value, rtol=1e-5, atol=1e-6), f"{what}: {key} differs from single-process training"
