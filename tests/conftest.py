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
