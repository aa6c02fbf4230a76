"""The last line after a failure names a command the user can run again: the way this worker was really launched
(`python -m`, a script, the console script; torchrun with its process count), not a `python worker.py` that is not there."""
from __future__ import annotations

import os
import sys

import pytest

from model_parallel.cli.worker_exit import launch_command, resume_hint

PY = os.path.basename(sys.executable)
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2"}


def _as_plain_script(monkeypatch) -> None:
    """This process as `python test_parallel_0.py`, not under torchrun or `python -m`."""
    for name in ("TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    monkeypatch.setattr(sys, "argv", ["/x/test_parallel_0.py"])


@pytest.mark.parametrize("env, module, argv0, want, note", [
    ({}, "model_parallel.cli.worker", "/x/model_parallel/cli/worker.py", [PY, "-m", "model_parallel.cli.worker"], ""),
    ({}, "", "/x/test_parallel_0.py", [PY, "test_parallel_0.py"], ""),
    # QA: `python -m model_parallel.cli.main worker ...` was told to rerun `python -m model_parallel.cli.main --rank ...`.
    ({}, "model_parallel.cli.main", "/x/model_parallel/cli/main.py", [PY, "-m", "model_parallel.cli.main", "worker"], ""),
    ({}, "", "/venv/bin/model-parallel", ["model-parallel", "worker"], ""),
    (TORCHRUN, "model_parallel.cli.worker", "/x/worker.py",
     ["torchrun", "--nproc_per_node=2", "-m", "model_parallel.cli.worker"], ""),
    ({**TORCHRUN, "GROUP_WORLD_SIZE": "3"}, "", "test_parallel_0.py",
     ["torchrun", "--nnodes=3", "--nproc_per_node=2", "test_parallel_0.py"], " (on every node, with the same rendezvous flags)"),
])
def test_the_launch_command_is_how_the_worker_was_started(env, module, argv0, want, note):
    assert launch_command(env, module, argv0) == (want, note)


def test_the_resume_hint_adds_resume_to_the_real_command(tmp_path, monkeypatch):
    _as_plain_script(monkeypatch)
    hint = resume_hint(str(tmp_path), ["--model", "mlp", "--checkpoint_dir", str(tmp_path)], 1)
    assert hint == (f"[rank 1] no checkpoint was committed in {tmp_path}; rerun to start over: "
                    f"{PY} test_parallel_0.py --model mlp --checkpoint_dir {tmp_path} --resume")


def test_after_a_usage_error_the_resume_hint_says_to_fix_it_first(tmp_path, monkeypatch):
    # QA: a resume refused for a changed --batch_size was told to resume with the same command, --batch_size included.
    _as_plain_script(monkeypatch)
    (tmp_path / "step_3").mkdir()
    (tmp_path / "latest").write_text("step_3\n")
    argv = ["--model", "mlp", "--checkpoint_dir", str(tmp_path), "--resume", "--batch_size", "32"]
    plain, first = resume_hint(str(tmp_path), argv, 0), resume_hint(str(tmp_path), argv, 0, fix_first=True)
    assert plain == f"[rank 0] latest committed checkpoint: {tmp_path / 'step_3'}; resume every rank with: {PY} " \
                    f"test_parallel_0.py {' '.join(argv)}"
    assert first == plain.replace("; resume", "; once the error above is fixed (where it names a flag: in this command "
                                              "too), resume")


def test_a_joiner_is_told_to_join_again_not_to_resume_the_job_with_its_command(tmp_path, monkeypatch):
    # QA: a joiner whose admission failed was told "resume every rank with: python ... --join HOST:PORT ... --resume".
    _as_plain_script(monkeypatch)
    (tmp_path / "step_16").mkdir()
    (tmp_path / "latest").write_text("step_16\n")
    hint = resume_hint(str(tmp_path), ["--join", "h:29500", "--model", "mlp", "--checkpoint_dir", str(tmp_path)], 2)
    assert hint == (f"[rank 2] latest committed checkpoint: {tmp_path / 'step_16'}; this worker joined with "
                    "--join: resume the job with its ranks' own commands (each one's last line), then join it again "
                    f"with: {PY} test_parallel_0.py --join h:29500 --model mlp --checkpoint_dir {tmp_path}")


def test_a_joiner_that_came_after_the_job_finished_is_told_so(tmp_path, monkeypatch):
    # QA: a joiner the job never admitted (it ended first, or the joiner stood still through it) was told to
    # "resume the job with its ranks' own commands, then join it again": the job had run every step.
    _as_plain_script(monkeypatch)
    (tmp_path / "step_9").mkdir()
    (tmp_path / "latest").write_text("step_9\n")
    for steps in (["--steps", "10"], ["--steps=10"]):
        hint = resume_hint(str(tmp_path), ["--join", "h:1", "--model", "mlp", *steps, "--checkpoint_dir", str(tmp_path)], 0)
        assert hint == (f"[rank 0] the job finished: its latest committed checkpoint {tmp_path / 'step_9'} holds all 10 "
                        "requested step(s); there is nothing left to join")
    hint = resume_hint(str(tmp_path), ["--join", "h:1", "--steps", "11", "--checkpoint_dir", str(tmp_path)], 0)
    assert "join it again" in hint  # a step left: the job may still run
