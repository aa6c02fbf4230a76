"""A job over the served-job message limit is not served: the coordinator says so at start, and a worker that asks
gets the reason at once (it used to start, drop every job request in its log only, and the worker blamed the token)."""
from __future__ import annotations

from types import SimpleNamespace

from model_parallel.cli.coordinator import _servable
from model_parallel.coordinator import protocol
from model_parallel.coordinator.workers import WorkerLink


def _job(description: str) -> dict:
    return {"graph": {"nodes": [{"description": description}]}, "plan": {}, "plan_version": 0, "train": {}}


def test_a_job_over_the_limit_is_not_served_and_says_what_to_do(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_JOB_FRAME_BYTES", 1000)
    job, reason = _servable(_job("x" * 2000), "g.json + p.json")
    assert job is None
    assert "the job of g.json + p.json is not served to workers" in reason
    assert "exceeds the 1000-byte frame limit" in reason and "start every worker with --graph and --plan" in reason
    small = _job("x")
    assert _servable(small, "g.json") == (small, "")


def test_a_worker_asking_for_an_unserved_job_is_told_why():
    sent = []
    session = SimpleNamespace(send=lambda kind, **fields: sent.append((kind, fields)))
    link = SimpleNamespace(job=None, no_job_reason="the job of g.json is not served to workers (too big)")
    WorkerLink._send_job(link, session, {"rank": 0}, "127.0.0.1:1")
    assert sent == [("reply", {"ok": False, "error": "the job of g.json is not served to workers (too big)"})]
