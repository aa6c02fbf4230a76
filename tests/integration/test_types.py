"""The type check (issue 34): mypy, configured by [tool.mypy] in pyproject.toml, finds nothing in graph/ and runtime/."""
from __future__ import annotations

import tomllib

import pytest

from support import REPO

pytestmark = pytest.mark.slow  # a cold mypy run (torch's stubs included): about 10-20 s on 2 busy cores


def test_mypy_is_clean_on_graph_and_runtime(tmp_path, monkeypatch):
    from mypy import api  # requirements.txt pins it (`make test` installs it): missing is a failure, not a skip
    config = REPO / "pyproject.toml"
    # What CI checks is the config's file list; a shrunken list would pass vacuously.
    assert tomllib.loads(config.read_text())["tool"]["mypy"]["files"] == ["model_parallel/graph", "model_parallel/runtime"]
    monkeypatch.chdir(REPO)  # the config's paths are relative to the repository root
    stdout, stderr, status = api.run(["--config-file", str(config), "--cache-dir", str(tmp_path / "mypy_cache")])
    report = f"mypy exit status {status}\n{stdout}{stderr}"
    assert status == 0, report
    assert "Success: no issues found" in stdout, report
