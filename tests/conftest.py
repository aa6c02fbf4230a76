"""Shared pytest fixtures: reference profiles, a per-test run directory, one torch thread, and for every
test an isolated home cache and the logging handlers it added removed."""
from __future__ import annotations

import logging
from collections.abc import Iterator
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


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The converter records the last job in ~/.cache/model_parallel/last_job.json: a test that wrote the
    # user's real one made a later `python test_socket.py` serve a deleted pytest folder. The environment
    # is what child processes inherit, so workers a test starts are isolated too.
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    return home


def _handlers() -> dict[logging.Logger, list[logging.Handler]]:
    loggers = [logging.getLogger()] + [v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)]
    return {logger: list(logger.handlers) for logger in loggers}


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    # A handler a test (or the CLI it called) attached outlived it and wrote to a closed stream ("I/O
    # operation on closed file") in a later test: remove and close what the test added. pytest's own
    # capture handlers come and go with each phase; they are left to pytest.
    before = _handlers()
    yield
    for logger, handlers in _handlers().items():
        for handler in handlers:
            if handler in before.get(logger, ()) or type(handler).__module__.startswith("_pytest"):
                continue
            logger.removeHandler(handler)
            handler.close()
