"""Shared pytest fixtures: where the reference profiles live, a per-test run directory, one torch thread."""
from __future__ import annotations

from pathlib import Path

import pytest

from support import REFERENCE_PROFILES


@pytest.fixture(scope="session")
def reference_profiles() -> Path:
    """Directory holding vgg16/resnet50/gnmt/toy_dag graph.txt files (checked in under tests/fixtures/)."""
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
