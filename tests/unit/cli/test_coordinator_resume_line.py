"""After a failed run the coordinator's last line names the workers' latest committed checkpoint and how to
resume (issue 33 item 10); the directories come from the workers' registrations."""
from __future__ import annotations

from pathlib import Path

from model_parallel.cli.coordinator import resume_line
from model_parallel.coordinator.client import CoordinatorChannel
from support.coordinators import live_coordinator

TOKEN = b"resume-line-token"


def _committed(root: Path, step: int) -> None:
    (root / f"step_{step}").mkdir(parents=True)
    (root / "latest").write_text(f"step_{step}")


def test_it_names_the_latest_committed_step(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _committed(root, 3)
    line = resume_line([str(root)])
    assert f"latest committed checkpoint '{root / 'step_3'}'" in line and "--resume" in line


def test_without_checkpoints_it_says_there_is_nothing_to_resume(tmp_path: Path) -> None:
    assert "no --checkpoint_dir" in resume_line([]) and "nothing to resume from" in resume_line([])
    (tmp_path / "empty").mkdir()
    assert f"no checkpoint committed in '{tmp_path / 'empty'}'" in resume_line([str(tmp_path / "empty")])
    assert "on the workers' machines" in resume_line([str(tmp_path / "elsewhere")])


def test_a_job_refused_before_its_first_step_is_not_told_to_start_over_as_it_was() -> None:
    # QA: `--schedule interleaved` on a one-stage-per-rank package; every worker refused it at start, and the
    # coordinator said "nothing to resume from; start over with <the same command>", which fails the same way.
    line = resume_line([], trained=False)
    assert "stopped before their first step" in line and "fix what it names" in line
    assert "nothing to resume from" not in line


def test_the_coordinator_learns_the_directory_from_the_workers_registration(tmp_path: Path) -> None:
    with live_coordinator(TOKEN, policy="manual", heartbeat_timeout=30) as coordinator:
        channel = CoordinatorChannel(coordinator.address, TOKEN, rank=0, world_size=2, checkpoint_dir=str(tmp_path))
        try:
            assert coordinator.status()["checkpoint_dirs"] == [str(tmp_path)]
        finally:
            channel.close()


def test_the_resume_line_restarts_the_coordinator_as_it_was_started(monkeypatch) -> None:
    # QA: `model-parallel coordinator ...` was told to start again with `python model-parallel coordinator ...`.
    import importlib.machinery
    import sys

    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/model-parallel", "coordinator", "--port", "29600"])
    assert "start over with model-parallel coordinator --port 29600 and" in resume_line([])
    monkeypatch.setattr(sys, "argv", ["/x/test_socket.py", "--port", "29600"])
    assert " test_socket.py --port 29600 and" in resume_line([])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", importlib.machinery.ModuleSpec("model_parallel.cli.main", None))
    monkeypatch.setattr(sys, "argv", ["/x/model_parallel/cli/main.py", "coordinator", "--port", "29600"])
    assert " -m model_parallel.cli.main coordinator --port 29600 and" in resume_line([])
