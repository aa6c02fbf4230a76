"""Plain helpers shared by test modules (pytest fixtures live in tests/conftest.py).

Test modules never import each other or conftest.py: whatever two of them share lives here, so each
test module can be run, moved or deleted on its own. `tests/` is on sys.path while pytest collects
(rootdir-relative "prepend" import mode), so a test writes `from support.mlp import mlp_job`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
# PipeDream's published graph.txt profiles (vgg16, resnet50, gnmt, toy_dag, a partitioned vgg16): see its README.md.
REFERENCE_PROFILES = FIXTURES / "reference_profiles"


def first_fast(num_blocks: int) -> list:
    """`range(num_blocks)` as test parameters of which only block 0 runs in the fast lane: an exhaustive
    check split into blocks of seeds keeps one block in `make test-fast` and all of them in `make test`."""
    return [0] + [pytest.param(block, marks=pytest.mark.slow) for block in range(1, num_blocks)]


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something true (returned), failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def assert_relatively_close(value: Any, want: Any, tol: float, what: str) -> None:
    """||value - want|| <= tol * ||want|| (in float64; the oracle's relative tolerance), naming `what`."""
    import torch

    diff = torch.linalg.vector_norm(value.double() - want.double()).item()
    scale = max(torch.linalg.vector_norm(want.double()).item(), 1e-12)
    assert diff <= tol * scale, f"{what} differs by {diff:.3g} (relative {diff / scale:.3g})"
