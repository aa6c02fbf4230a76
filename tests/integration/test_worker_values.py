"""Numeric command-line values of the worker: out of range, NaN or infinite is one line and exit 2 before any
rank joins (never a traceback, never a run that trains to NaN or does nothing and exits 0)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from model_parallel.cli.worker import build_parser, check_inputs
from model_parallel.cli.worker_job import make_config
from model_parallel.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def checked(*flags: str) -> None:
    args = build_parser().parse_args(["--model", "mlp", *flags])
    check_inputs(args)
    make_config(args)


@pytest.mark.parametrize("flags, message", [
    (["--threads", "0"], r"--threads 0: the torch threads per worker must be a finite number in 1\.\.4096"),
    (["--lr", "-1"], r"--lr -1\.0: the learning rate must be a finite number in 0\.\."),
    (["--lr", "nan"], r"--lr nan: the learning rate must be a finite number"),
    (["--momentum", "nan"], r"--momentum nan: the SGD momentum must be"),
    (["--weight_decay", "inf"], r"--weight_decay inf"),
    (["--timeout", "inf"], r"--timeout inf: the seconds must be a finite number"),
    (["--timeout", "0"], r"--timeout 0\.0"),
    (["--steps", "-5"], r"--steps -5: the steps to train must be a finite number in 1\.\."),
    (["--steps", "0"], r"--steps 0"),
    (["--gloo_loop_nice", "20"], r"--gloo_loop_nice 20: the nice value of gloo's message threads must be a finite number in 0\.\.19"),
    (["--lr_schedule", "warmup:-1"], r"bad --lr_schedule 'warmup:-1'.*counts >= 1"),
    (["--lr_schedule", "cosine:-5"], r"bad --lr_schedule 'cosine:-5'"),
    (["--lr_schedule", "step:2:nan"], r"bad --lr_schedule 'step:2:nan'"),
    (["--lr_schedule", "step:-1:0.5"], r"bad --lr_schedule 'step:-1:0\.5'"),
])
def test_a_bad_number_is_one_config_error(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        checked(*flags)


def test_good_numbers_pass() -> None:
    checked("--threads", "2", "--lr", "0", "--momentum", "0.9", "--timeout", "30", "--steps", "1",
            "--lr_schedule", "warmup:3")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--threads", "0"], ["--timeout", "inf"], ["--lr", "nan"], ["--steps", "-5"],
                                   ["--lr_schedule", "warmup:-1"]])
def test_the_command_line_exits_2_with_one_line(flags: list[str]) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "test_parallel_0.py"), "--model", "mlp", "--rank", "0",
                           "--world_size", "2", *flags], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and flags[0] in done.stderr and "Traceback" not in done.stderr
