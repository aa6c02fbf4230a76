"""`model-parallel schedule 1f1b -p 300 -m 300 | head -1` ended in a BrokenPipeError traceback: a reader that closed
stdout is an ordinary end (exit 141, a shell's code for SIGPIPE, nothing on stderr), while a broken pipe that is
not stdout (a socket) still raises."""
from __future__ import annotations

import io
import os
import sys

import pytest

from model_parallel.cli.common import EXIT_BROKEN_PIPE, run_cli


def _print_a_lot(argv):
    for _ in range(100_000):
        print("0F0 " * 20)
    return 0


def test_a_closed_stdout_ends_quietly(monkeypatch, capfd):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`head`) went away
    pipe = io.TextIOWrapper(io.FileIO(write_end, "w"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", pipe)
    with pytest.raises(SystemExit) as exited:
        run_cli(_print_a_lot, [])
    assert exited.value.code == EXIT_BROKEN_PIPE
    pipe.close()  # stdout was pointed at /dev/null: closing it raises nothing
    assert "Traceback" not in capfd.readouterr().err


def test_a_broken_pipe_elsewhere_still_raises():
    def socket_gone(argv):
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        run_cli(socket_gone, [])
