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
    world_size: int = 2
    control_group: object = None
    timeout: float = 1.0

    def diagnose(self, error: Exception) -> Exception:
        return error

    def load_checkpoint(self) -> int:
        self.loads.append(1)
        return 4


def prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restart: Optional[str], latest: Optional[int],
             resume_flag: bool = False, directory: bool = True, rank: int = 1) -> tuple[int, Engine]:
    if restart is None:
        monkeypatch.delenv(resume.RESTART_ENV, raising=False)
    else:
        monkeypatch.setenv(resume.RESTART_ENV, restart)
    monkeypatch.setattr(store, "latest_step", lambda _directory: latest)
    monkeypatch.setattr(resume, "agree", lambda _engine, error: None if error is None else f"rank 0: {error}")
    engine = Engine(RunOptions(checkpoint_dir=str(tmp_path) if directory else None, resume=resume_flag),
                    rank=rank)
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
        step, engine = prepared(tmp_path, monkeypatch, restart, latest=None, rank=0)
    assert (step, engine.loads) == (0, [])
    assert "torchelastic" not in caplog.text


def test_a_fresh_run_into_a_directory_of_committed_checkpoints_is_refused(tmp_path, monkeypatch) -> None:
    # Before, it trained from step 0 and its first commit deleted the old steps (past the new `latest`) as
    # "never committed": a forgotten --resume lost the previous run's checkpoints. Rank 0 decides, every rank raises.
    with pytest.raises(ConfigError, match=rf"checkpoint_dir {tmp_path} holds committed checkpoints \(latest: step 3\) "
                                          r"and this run starts at step 0 without --resume.*pass --resume"):
        prepared(tmp_path, monkeypatch, None, latest=3, rank=0)
    # A peer hears rank 0's refusal through the agreement.
    monkeypatch.setattr(resume, "agree", lambda _engine, _error: "rank 0: checkpoint_dir X holds committed checkpoints")
    with pytest.raises(ConfigError, match="^checkpoint_dir X holds committed checkpoints$"):
        resume.prepare(Engine(RunOptions(checkpoint_dir=str(tmp_path)), rank=1), 0)


def test_a_later_call_of_the_same_run_is_not_refused(tmp_path, monkeypatch) -> None:
    # PipelineTrainer.train called again continues at its next step in the directory it wrote: no refusal.
    monkeypatch.setattr(store, "latest_step", lambda _directory: 3)
    engine = Engine(RunOptions(checkpoint_dir=str(tmp_path)), rank=0)
    assert resume.prepare(engine, 4) == 4 and engine.loads == []


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
