"""userfile: every reader of a path the user gave refuses a FIFO, a device or an oversized file with its own typed
error naming the path (a FIFO used to hang the reader forever, /dev/zero to grow it to a MemoryError)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from model_parallel.errors import GraphFormatError, LogFormatError, PlanError, ProtocolError, ScheduleError
from model_parallel.userfile import read_bytes, read_text


def _fifo(tmp_path: Path, name: str = "fifo") -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path):
    fifo = _fifo(tmp_path)
    with pytest.raises(PlanError, match=r"fifo: not a regular file \(a FIFO, possibly behind a symlink\); it was not "
                                         r"read; give the plan itself"):
        read_bytes(fifo, error=PlanError, what="plan", max_bytes=100)


def test_devices_directories_and_oversized_files_are_refused(tmp_path: Path):
    with pytest.raises(PlanError, match=r"/dev/zero: not a regular file \(a device"):
        read_bytes("/dev/zero", error=PlanError, what="plan", max_bytes=100)
    with pytest.raises(PlanError, match=r"not a regular file \(a directory"):
        read_bytes(tmp_path, error=PlanError, what="plan", max_bytes=100)
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(PlanError, match=r"big: 11 bytes is more than the 10 bytes accepted for a plan"):
        read_bytes(tmp_path / "big", error=PlanError, what="plan", max_bytes=10)
    assert read_bytes(tmp_path / "big", error=PlanError, what="plan", max_bytes=11) == b"x" * 11


def test_a_file_whose_size_stat_does_not_tell_is_still_capped():
    # /proc files are regular and report size 0: the cap holds on the bytes read, not on stat's size.
    with pytest.raises(PlanError, match=r"is more than the 8 bytes accepted"):
        read_bytes("/proc/self/status", error=PlanError, what="plan", max_bytes=8)


def test_bad_utf8_names_the_line(tmp_path: Path):
    (tmp_path / "t.txt").write_bytes(b"ok\nok\n\xff\n")
    with pytest.raises(ScheduleError, match=r"t\.txt:3: not a text file \(the schedule CSV is not UTF-8"):
        read_text(tmp_path / "t.txt", error=ScheduleError, what="schedule CSV", max_bytes=100)


def _devnull(tmp_path: Path, name: str) -> Path:
    """A symlink named like the file a reader expects, to a device that would read as empty (not a hang: a test
    of the old code fails instead of waiting)."""
    link = tmp_path / name
    link.symlink_to("/dev/null")
    return link


def test_each_reader_of_a_user_path_refuses_a_device_with_its_own_error(tmp_path: Path):
    from model_parallel.coordinator.protocol import read_token
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import read_plan
    from model_parallel.runtime.observe.metrics_read import read_metrics
    from model_parallel.runtime.observe.tracing import read_trace
    from model_parallel.runtime.step.schedule_csv import read_torch_csv

    readers = [
        (GraphFormatError, lambda: load_graph(_devnull(tmp_path, "graph.txt"))),
        (GraphFormatError, lambda: load_graph(_devnull(tmp_path, "graph.json"))),
        (PlanError, lambda: read_plan(_devnull(tmp_path, "plan.json"))),
        (ProtocolError, lambda: read_token(token_file=str(_devnull(tmp_path, "token")))),
        (LogFormatError, lambda: read_metrics(_devnull(tmp_path, "m.jsonl"))),
        (LogFormatError, lambda: read_trace(_devnull(tmp_path, "trace.json"))),
        (ScheduleError, lambda: read_torch_csv(_devnull(tmp_path, "s.csv"))),
    ]
    for error, read in readers:
        with pytest.raises(error, match=r"not a regular file \(a device"):
            read()


def test_each_reader_refuses_a_fifo(tmp_path: Path):
    from model_parallel.coordinator.protocol import read_token
    from model_parallel.graph.io import load_graph
    from model_parallel.runtime.observe.metrics_read import read_metrics

    with pytest.raises(GraphFormatError, match=r"graph\.txt: not a regular file \(a FIFO"):
        load_graph(_fifo(tmp_path, "graph.txt"))
    with pytest.raises(ProtocolError, match=r"token: not a regular file \(a FIFO"):
        read_token(token_file=str(_fifo(tmp_path, "token")))
    with pytest.raises(LogFormatError, match=r"m\.jsonl: not a regular file \(a FIFO"):
        read_metrics(_fifo(tmp_path, "m.jsonl"))
