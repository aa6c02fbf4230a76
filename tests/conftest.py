"""Shared pytest fixtures: where the reference profiles live, a per-test run directory, one torch thread."""
from __future__ import annotations

from pathlib import Path

import pytest

# /work/main/tests/conftest.py -> /work/shared/reference_profiles (the PipeDream profiles every step reads).
REFERENCE_PROFILES = Path(__file__).resolve().parents[2] / "shared" / "reference_profiles"


@pytest.fixture(scope="session")
def reference_profiles() -> Path:
    """Directory holding vgg16/resnet50/gnmt/toy_dag graph.txt files; skips when the checkout lacks it."""
    if not REFERENCE_PROFILES.is_dir():
        pytest.skip(f"reference profiles not found at {REFERENCE_PROFILES}")
    return REFERENCE_PROFILES


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A fresh, empty directory for one test's outputs (graphs, plans, checkpoints, logs)."""
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> None:
    # The CI machine has 2 cores shared by everything: one intra-op thread per test process.
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return
    torch.set_num_threads(1)


# ---- the built-in MLP job the multi-host and fault tests run with the seed's command lines ----------
def mlp_job(directory: Path, num_stages: int, batch: int = 8, micro: int = 4, name: str = "plan.json") -> tuple[Path, Path]:
    """graph.json of the workers' built-in `--model mlp`, traced exactly as they trace it, and an even plan."""
    from model_parallel.graph.io import save_graph
    from model_parallel.graph.plan import write_plan
    from model_parallel.profiler.trace import trace_model
    from model_parallel.runtime.stages import even_plan
    from model_parallel.runtime.zoo import recipe

    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(batch // micro))
    save_graph(graph, directory / "graph.json")
    write_plan(even_plan(graph, num_stages), directory / name)
    return directory / "graph.json", directory / name


def reference_params(steps: int, batch: int = 8, micro: int = 4, lr: float = 0.01) -> dict:
    """Parameters after single-process training of `--model mlp` (SGD, momentum 0.9): the oracle."""
    import torch

    from model_parallel.codegen.naming import state_key
    from model_parallel.runtime.engine import TrainConfig
    from model_parallel.runtime.trainer import single_process_reference
    from model_parallel.runtime.zoo import recipe

    r = recipe("mlp")
    model = r.model(0)
    config = TrainConfig(batch_size=batch, num_microbatches=micro, progress=False)
    single_process_reference(model, r.criterion, lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9), r.data(batch, 0), config, steps)
    return {state_key(k): v.detach() for k, v in model.named_parameters()}


def assert_params_close(got: dict, want: dict, what: str = "pipeline run") -> None:
    import torch

    assert sorted(got) == sorted(want), f"{what}: parameter names differ"
    for key, value in want.items():
        assert torch.allclose(got[key], value, rtol=1e-5, atol=1e-6), f"{what}: {key} differs from single-process training"
