"""A torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) resumes from the latest committed checkpoint as `resume`
does, and says so; the first attempt behaves as before (resume.prepare, with a stand-in engine)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from model_parallel.errors import ConfigError
from model_parallel.runtime.checkpoint import resume, store
from model_parallel.runtime.config import RunOptions


@dataclass
class Engine:
    """What `resume.prepare` uses of an engine; `load_checkpoint` records that it was called."""

    options: RunOptions
    rank: int = 1  # not rank 0: no pruning of the (fake) directory
    loads: list[int] = field(default_factory=list)
    prefix: str = "[rank 1 stage 1]"

    def load_checkpoint(self) -> int:
        self.loads.append(1)
        return 4


def prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restart: Optional[str], latest: Optional[int],
             resume_flag: bool = False, directory: bool = True) -> tuple[int, Engine]:
    if restart is None:
        monkeypatch.delenv(resume.RESTART_ENV, raising=False)
    else:
        monkeypatch.setenv(resume.RESTART_ENV, restart)
    monkeypatch.setattr(store, "latest_step", lambda _directory: latest)
    engine = Engine(RunOptions(checkpoint_dir=str(tmp_path) if directory else None, resume=resume_flag))
    return resume.prepare(engine, 0), engine


def test_a_restart_resumes_from_the_latest_checkpoint_and_says_so(tmp_path, monkeypatch, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        step, engine = prepared(tmp_path, monkeypatch, "1", latest=3)
    assert (step, engine.loads) == (4, [1])
    assert f"torchelastic restart 1: resumed from the latest committed checkpoint in {tmp_path}, continuing at step 4" \
        in caplog.text


@pytest.mark.parametrize("restart", [None, "0"])
def test_the_first_attempt_without_resume_starts_where_asked(tmp_path, monkeypatch, caplog, restart) -> None:
    with caplog.at_level(logging.WARNING):
        step, engine = prepared(tmp_path, monkeypatch, restart, latest=3)
    assert (step, engine.loads) == (0, [])
    assert "torchelastic" not in caplog.text


def test_the_first_attempt_with_resume_resumes_as_before(tmp_path, monkeypatch, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        step, engine = prepared(tmp_path, monkeypatch, "0", latest=3, resume_flag=True)
    assert (step, engine.loads) == (4, [1])
    assert f"resumed from {tmp_path} at step 4" in caplog.text and "torchelastic" not in caplog.text


def test_a_restart_without_a_committed_checkpoint_says_it_starts_over(tmp_path, monkeypatch, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        step, engine = prepared(tmp_path, monkeypatch, "2", latest=None)
    assert (step, engine.loads) == (0, [])
    assert f"torchelastic restart 2: no committed checkpoint in {tmp_path}, so training starts again from step 0" \
        in caplog.text


def test_a_restart_without_a_checkpoint_directory_says_it_starts_over(tmp_path, monkeypatch, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        step, engine = prepared(tmp_path, monkeypatch, "1", latest=3, directory=False)
    assert (step, engine.loads) == (0, [])
    assert "torchelastic restart 1: no checkpoint directory, so training starts again from step 0" in caplog.text


@pytest.mark.parametrize("text", ["x", "-1", "1.5"])
def test_a_malformed_restart_count_is_refused(monkeypatch, text) -> None:
    monkeypatch.setenv(resume.RESTART_ENV, text)
    with pytest.raises(ConfigError, match=f"TORCHELASTIC_RESTART_COUNT={text!r} is not a restart count"):
        resume.elastic_restart()


@pytest.mark.parametrize("exists, why", [(False, "the directory does not exist"), (True, "has no committed checkpoint")])
def test_resume_without_a_checkpoint_starts_at_0_and_says_why_once(tmp_path, monkeypatch, caplog, exists, why) -> None:
    # Not refused (scripts pass --resume on the first start too), but a misspelled directory is not silent.
    directory = tmp_path / "ck"
    if exists:
        directory.mkdir()
    monkeypatch.delenv(resume.RESTART_ENV, raising=False)
    with caplog.at_level(logging.WARNING):
        for rank in (0, 1):
            engine = Engine(RunOptions(checkpoint_dir=str(directory), resume=True), rank=rank)
            assert (resume.prepare(engine, 0), engine.loads) == (0, [])
    assert caplog.text.count("--resume:") == 1  # rank 0 only
    assert f"--resume: no checkpoint in {directory} ({why}); starting from step 0" in caplog.text
