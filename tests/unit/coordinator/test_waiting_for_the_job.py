"""A worker started with only `--rank` and `--dist_addr` waits for the coordinator's job: the wait says so at once
(it was silent until --timeout, and a coordinator started on another port looked like a hang), and the coordinator's
printed worker lines say how to reach it when it listens where the workers do not look."""
from __future__ import annotations

import logging
import socket

import pytest

from model_parallel.cli.coordinator import join_instructions
from model_parallel.coordinator.connect import fetch_job
from model_parallel.coordinator.jobfiles import COORDINATOR_ENV, DEFAULT_COORDINATOR_PORT
from model_parallel.errors import ProtocolError
from model_parallel.graph.plan import Plan, StagePlan


def test_waiting_for_the_job_is_logged_once_before_the_timeout(caplog) -> None:
    with socket.socket() as bound:  # bound, never listening: every connection is refused
        bound.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{bound.getsockname()[1]}"
        with caplog.at_level(logging.WARNING), pytest.raises(ProtocolError, match="could not get the job"):
            fetch_job(address, lambda: b"token", rank=2, timeout=0.6)
    waits = [r.getMessage() for r in caplog.records if "no job from the coordinator" in r.getMessage()]
    assert len(waits) == 1 and f"rank 2: no job from the coordinator at {address} yet" in waits[0]
    assert "--coordinator HOST:PORT" in waits[0]


def _plan() -> Plan:
    return Plan((StagePlan(0, ("a",), ranks=(0,)), StagePlan(1, ("b",), ranks=(1,))))


def test_worker_lines_name_a_port_the_workers_would_not_look_on(monkeypatch) -> None:
    monkeypatch.delenv(COORDINATOR_ENV, raising=False)
    other = join_instructions(_plan(), 29611, "token.txt")
    assert "export MODEL_PARALLEL_COORDINATOR=<this host>:29611" in other and "this machine's too" in other
    assert f"workers look on {DEFAULT_COORDINATOR_PORT}" in other
    default = join_instructions(_plan(), DEFAULT_COORDINATOR_PORT, "token.txt")
    assert "this machine's too" not in default and "not on rank 0's machine" in default
    monkeypatch.setenv(COORDINATOR_ENV, "127.0.0.1:29611")  # the workers read the same variable: nothing to add
    assert "this machine's too" not in join_instructions(_plan(), 29611, "token.txt")
