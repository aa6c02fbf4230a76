"""The fixtures every test gets (tests/conftest.py, tests/unit/conftest.py): a home of its own, no
leftover logging handlers, and in the unit tier no process."""
from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

PROBE = "model_parallel.tests.isolation_probe"
_added: list[logging.Handler] = []


def test_home_and_cache_are_a_temporary_folder():
    home = Path(os.environ["HOME"])
    assert home.is_relative_to(tempfile.gettempdir()) or "pytest" in str(home), home
    assert Path(os.environ["XDG_CACHE_HOME"]).is_relative_to(home)
    assert Path("~").expanduser() == home  # what the converter's last-job record resolves


def test_a_unit_test_cannot_start_a_process():
    with pytest.raises(AssertionError, match="started a process.*tests/integration"):
        subprocess.run([sys.executable, "-c", "pass"], timeout=30)
    with pytest.raises(AssertionError, match="started a process"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_handler_added_here_is_removed_after_the_test():
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger(PROBE).addHandler(handler)
    _added.append(handler)


def test_the_handler_of_the_previous_test_is_gone():
    if not _added:
        pytest.skip("runs after test_a_handler_added_here_is_removed_after_the_test")
    assert _added[0] not in logging.getLogger(PROBE).handlers
