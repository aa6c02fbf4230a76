"""`--join HOST:PORT`: a worker started later is admitted into a running `--recover` job at a step boundary; every
rank commits a checkpoint there, the world re-forms with one more member, re-plans with the even split and
resumes from that checkpoint: the final parameters and every step's loss equal uninterrupted single-process
training (the oracle of tests/integration/test_recovery.py). Refusals end the joiner with exit 2 before the job
notices anything. The test hook `MP_TEST_JOIN_AT_STEP` keeps rank 0 from admitting before a given step (the
joiner starts with the job), so the admission lands mid-run whatever the machine's speed."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import LocalWorld, free_port, join_command, worker_commands
from model_parallel.runtime.observe.metrics_read import read_events, read_metrics
from support.mlp import assert_params_close, reference_losses, reference_params

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
STEPS = 10
TIMEOUT = 10  # --timeout; the joiner starts with the job and must be ready by the admission step
JOIN_AT = 4


def job_args(tmp_path: Path, recover: bool = True, checkpoints: bool = True, lr: str = "0.01") -> list[str]:
    out = ["--model", "mlp", "--steps", str(STEPS), "--batch_size", "8", "--num_microbatches", "4", "--lr", lr,
           "--timeout", str(TIMEOUT), "--metrics", str(tmp_path / "metrics" / "rank{rank}.jsonl")]
    if checkpoints:
        out += ["--checkpoint_dir", str(tmp_path / "ck"), "--checkpoint_every", "3"]
    return out + (["--recover"] if recover else [])


def joiner(port: int, args: list[str]) -> list[str]:
    return join_command(f"127.0.0.1:{port}", args)


def losses(tmp_path: Path, rank: int) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(tmp_path / "metrics" / f"rank{rank}.jsonl")}


def test_a_worker_joins_a_running_job_and_training_stays_exact(tmp_path: Path) -> None:
    port = free_port()
    args = job_args(tmp_path)
    commands = worker_commands(args, 2, port=port) + [joiner(port, args)]
    with LocalWorld(commands, env={"MP_TEST_JOIN_AT_STEP": str(JOIN_AT)}) as world:
        result = world.wait(timeout=240)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, 0, 0], result.summary()
    [event] = read_events(tmp_path / "metrics" / "rank0.jsonl", "join")
    at = event["checkpoint_step"]
    assert at >= JOIN_AT and event["continued_at"] == at + 1, event
    assert (event["joined"], event["world"]) == (2, [0, 1, 2]), event
    for rank in range(3):
        output = result.output(rank)
        assert (f"admission 1: original rank 2 joined from 127.0.0.1; new world of 3 (original ranks [0, 1, 2], "
                f"met at 127.0.0.1:{port}); checkpoint step {at} (continued at step {at + 1}, 0 steps lost)"
                in output), output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(STEPS), "run with a join")
    want = reference_losses(STEPS)
    for rank, steps in ((0, range(STEPS)), (1, range(STEPS)), (2, range(at + 1, STEPS))):
        got = losses(tmp_path, rank)
        assert sorted(got) == list(steps), f"original rank {rank} ran steps {sorted(got)}"
        for step in steps:
            assert abs(got[step] - want[step]) <= 1e-5, f"rank {rank} step {step}: {got[step]} vs {want[step]}"


def run_refused(tmp_path: Path, job: list[str], joining: list[str]) -> tuple[str, list[int]]:
    port = free_port()
    commands = worker_commands(job, 2, port=port) + [joiner(port, joining)]
    with LocalWorld(commands) as world:
        result = world.wait(timeout=200)
    assert not result.timed_out, result.summary()
    return result.output(2), [w.returncode for w in result.workers]


def test_a_joiner_with_other_flags_is_refused_and_the_job_runs_on(tmp_path: Path) -> None:
    output, codes = run_refused(tmp_path, job_args(tmp_path), job_args(tmp_path, lr="0.02"))
    assert codes == [0, 0, 2], output[-3000:]
    assert "this worker's flags differ from the running job's: --lr 0.01 (job) vs 0.02 (this worker)" in output, output


def test_a_job_without_recover_refuses_a_joiner(tmp_path: Path) -> None:
    output, codes = run_refused(tmp_path, job_args(tmp_path, recover=False), job_args(tmp_path))
    assert codes == [0, 0, 2], output[-3000:]
    assert "runs without --recover: it cannot admit a worker" in output, output


def test_join_without_a_checkpoint_dir_is_refused_up_front(tmp_path: Path) -> None:
    with LocalWorld([joiner(free_port(), job_args(tmp_path, checkpoints=False))]) as world:
        result = world.wait(timeout=60)  # no job runs there: refused before contacting it
    assert [w.returncode for w in result.workers] == [2], result.summary()
    assert "--join needs --checkpoint_dir" in result.output(0), result.output(0)


def test_a_join_then_a_kill9_membership_changes_twice(tmp_path: Path) -> None:
    port = free_port()
    args = job_args(tmp_path)
    commands = worker_commands(args, 2, port=port) + [joiner(port, args)]
    env = {"MP_TEST_JOIN_AT_STEP": str(JOIN_AT), "MP_TEST_SIGNAL_AT_STEP": "1:8:KILL"}
    with LocalWorld(commands, env=env) as world:
        result = world.wait(timeout=240)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, 0], result.summary()
    for rank in (0, 2):
        output = result.output(rank)
        assert "admission 1: original rank 2 joined" in output, output[-3000:]
        assert "recovery 2: lost original rank(s) [1]; new world of 2 (original ranks [0, 2]" in output, output[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(STEPS), "join then kill")
    want = reference_losses(STEPS)
    got = losses(tmp_path, 0)
    assert sorted(got) == list(range(STEPS))
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)


def test_after_the_store_host_is_lost_a_worker_joins_at_the_new_store(tmp_path: Path) -> None:
    """kill -9 of rank 0 (the store host): original rank 1 hosts generation 1's store at --dist_port + 1 (the
    recovery rule), publishes the job's flags there, and admits a worker that joins at that address."""
    port = free_port()
    args = job_args(tmp_path)
    commands = worker_commands(args, 3, port=port) + [joiner(port + 1, args)]
    env = {"MP_TEST_JOIN_AT_STEP": "6", "MP_TEST_SIGNAL_AT_STEP": "0:3:KILL"}
    with LocalWorld(commands, env=env) as world:
        result = world.wait(timeout=240)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [-signal.SIGKILL, 0, 0, 0], result.summary()
    for rank in (1, 2, 3):
        output = result.output(rank)
        assert (f"admission 2: original rank 3 joined from 127.0.0.1; new world of 3 (original ranks [1, 2, 3], "
                f"met at 127.0.0.1:{port + 1})" in output), output[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(STEPS), "kill then join")
    want = reference_losses(STEPS)
    got = losses(tmp_path, 3)
    assert got and all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)


def test_a_joiner_lost_after_being_taken_the_job_trains_on_without_it(tmp_path: Path) -> None:
    """The joiner dies between rank 0 taking its request and the meeting: the members close the new world without
    it after 3 T and train on, from the checkpoint of the admission step, exactly."""
    port = free_port()
    args = job_args(tmp_path)
    commands = worker_commands(args, 2, port=port) + [joiner(port, args)]
    env = {"MP_TEST_JOIN_AT_STEP": str(JOIN_AT), "MP_TEST_JOINER_DIES": "1"}
    with LocalWorld(commands, env=env) as world:
        result = world.wait(timeout=240)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, 0, -signal.SIGKILL], result.summary()
    for rank in (0, 1):
        output = result.output(rank)
        assert "original rank 2 did not come to generation 1 within 30 s: training on without it" in output, output[-3000:]
        assert "admission 1" not in output, output[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(STEPS), "a lost joiner")
    want, got = reference_losses(STEPS), losses(tmp_path, 0)
    assert sorted(got) == list(range(STEPS)) and all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)


def test_two_joiners_are_admitted_one_after_the_other(tmp_path: Path) -> None:
    """The request slot holds one joiner: the second waits for it and is admitted at a later boundary (2 -> 3 -> 4)."""
    port = free_port()
    args = job_args(tmp_path)
    commands = worker_commands(args, 2, port=port) + [joiner(port, args), joiner(port, args)]
    with LocalWorld(commands, env={"MP_TEST_JOIN_AT_STEP": "3,6"}) as world:
        result = world.wait(timeout=240)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, 0, 0, 0], result.summary()
    events = read_events(tmp_path / "metrics" / "rank0.jsonl", "join")
    assert [(e["joined"], e["world"]) for e in events] == [(2, [0, 1, 2]), (3, [0, 1, 2, 3])], events
    assert "admitted 2 joining worker(s)" in result.output(0), result.output(0)[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(STEPS), "two joins")
    want, got = reference_losses(STEPS), losses(tmp_path, 0)
    assert sorted(got) == list(range(STEPS)) and all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)
