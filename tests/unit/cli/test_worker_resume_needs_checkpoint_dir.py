"""`--resume` without `--checkpoint_dir` is refused at argument checking, exit 2, before any rank joins a world:
it was ignored (training started at step 0 and exited 0 with no word). A coordinator never serves either flag
(coordinator.jobfiles.SERVED_FLAGS), so a served job is the worker's own command line, checked the same way."""
from __future__ import annotations

import json
import re

import pytest

from model_parallel.cli.common import run_cli
from model_parallel.cli.worker import build_parser, main
from model_parallel.cli.worker_inputs import check_inputs, read_jobs
from model_parallel.coordinator.jobfiles import SERVED_FLAGS
from model_parallel.errors import ConfigError, PlanError

MESSAGE = "--resume needs --checkpoint_dir DIR (the directory the run wrote its checkpoints to)"


def test_resume_without_a_checkpoint_dir_is_refused():
    with pytest.raises(ConfigError, match=f"^{re.escape(MESSAGE)}$"):
        check_inputs(build_parser().parse_args(["--model", "mlp", "--resume"]))
    check_inputs(build_parser().parse_args(["--model", "mlp", "--resume", "--checkpoint_dir", "ck"]))  # accepted


def test_the_command_line_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_cli(main, ["--model", "mlp", "--steps", "1", "--resume", "--timeout", "5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"error: {MESSAGE}") and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


def test_a_job_of_a_jobs_file_is_refused_by_number(tmp_path):
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([["--model", "mlp", "--checkpoint_dir", "ck"], ["--model", "mlp", "--resume"]]))
    with pytest.raises(ConfigError, match=r"jobs\.json: job \[1\]: --resume needs --checkpoint_dir DIR"):
        read_jobs(str(jobs), build_parser)


def test_a_coordinator_serves_neither_flag():
    assert "resume" not in SERVED_FLAGS and "checkpoint_dir" not in SERVED_FLAGS


@pytest.mark.parametrize("job", [["--help"], ["--model", "mlp", "-h"], ["--he"]])
def test_a_job_asking_for_help_is_refused_by_number(tmp_path, capsys, job):
    """argparse's help action printed the worker's usage and exited 0 from inside the jobs file: nothing ran."""
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([["--model", "mlp"], job]))
    with pytest.raises(PlanError, match=r"jobs\.json: job \[1\] asks for the help text \(-h/--help\), which is no job"):
        read_jobs(str(jobs), build_parser)
    assert capsys.readouterr().out == ""
