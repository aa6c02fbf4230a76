"""`--join` while the world re-forms: the admission meets in the next generation through the shared
`recovery.reform`, so a member lost after it registered for the admission's generation (test hook
`MP_TEST_SIGNAL_AT_STEP=K:reform:KILL`) leaves that process group unformed; the others and the joiner meet again one
generation later without it and train on, exactly (parameters and every step's loss against single-process
training). The hooks place each fault: `MP_TEST_JOIN_AT_STEP` the admission, `reform` the loss inside it."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import LocalWorld, free_port, join_command, worker_commands
from model_parallel.runtime.observe.metrics_read import read_events, read_metrics
from support.mlp import assert_params_close, reference_losses, reference_params

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
STEPS = 10
TIMEOUT = 5
JOIN_AT = 4


def job_args(tmp_path: Path) -> list[str]:
    return ["--model", "mlp", "--steps", str(STEPS), "--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01",
            "--timeout", str(TIMEOUT), "--metrics", str(tmp_path / "metrics" / "rank{rank}.jsonl"),
            "--checkpoint_dir", str(tmp_path / "ck"), "--checkpoint_every", "3", "--recover"]


def world_with_a_joiner(tmp_path: Path, members: int, hook: str) -> tuple[int, LocalWorld]:
    """`members` workers and a joiner admitted at JOIN_AT, the signal hook `hook` armed: (the job's port, the world)."""
    port = free_port()
    args = job_args(tmp_path)
    commands = worker_commands(args, members, port=port) + [join_command(f"127.0.0.1:{port}", args)]
    return port, LocalWorld(commands, env={"MP_TEST_JOIN_AT_STEP": str(JOIN_AT), "MP_TEST_SIGNAL_AT_STEP": hook})


def test_a_member_killed_as_the_admission_forms_the_others_and_the_joiner_meet_again(tmp_path: Path) -> None:
    # 3 workers; the joiner is taken at step 4's boundary; original rank 1 registers in generation 1 (the admission's)
    # and dies before its process group forms. Ranks 0, 2 and the joiner meet again at rank 0's store as generation 2.
    port, launched = world_with_a_joiner(tmp_path, 3, "1:reform:KILL")
    with launched as world:
        result = world.wait(timeout=200)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, -signal.SIGKILL, 0, 0], result.summary()
    for rank in (0, 2, 3):  # the members left and the joiner (original rank 3) alike
        output = result.output(rank)
        assert "process group of generation 1 (original ranks [0, 1, 2, 3]) did not form" in output, output[-3000:]
        assert "meeting again as generation 2" in output, output[-3000:]
        line = (f"admission 2: original rank 3 joined from 127.0.0.1; lost original rank(s) [1] while the world "
                f"re-formed; new world of 3 (original ranks [0, 2, 3], met at 127.0.0.1:{port})")
        assert line in output, output[-3000:]  # the loss was named nowhere but in the retry's warning
        assert "survived 1 failure(s)" in output.strip().splitlines()[-1], output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        [event] = read_events(tmp_path / "metrics" / f"rank{rank}.jsonl", "join")
        assert (event["joined"], event["world"], event["lost"], event["generation"]) == (3, [0, 2, 3], [1], 2), event
    at = event["checkpoint_step"]
    assert at >= JOIN_AT - 1 and event["continued_at"] == at + 1, event
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(STEPS), "a join that lost a member")
    want = reference_losses(STEPS)
    for rank, steps in ((0, range(STEPS)), (2, range(STEPS)), (3, range(at + 1, STEPS))):
        got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "metrics" / f"rank{rank}.jsonl")}
        assert sorted(got) == list(steps), f"original rank {rank} ran steps {sorted(got)}"
        for step in steps:
            assert abs(got[step] - want[step]) <= 1e-5, f"rank {rank} step {step}: {got[step]} vs {want[step]}"


def test_a_joiner_stopped_as_its_admission_forms_and_continued_after_the_job_ended_is_replaced(tmp_path: Path) -> None:
    # One member and a joiner stopped (SIGSTOP) once the admission's membership closed with it; the member meets again
    # without it and finishes. Continued, the joiner found the member's store gone, counted the member lost, formed a
    # world of its own ("admission 2: ... lost original rank(s) [0]; new world of 1") and exited 0; it stood still
    # since its meeting began: it is replaced (exit 6), as a continued member is.
    _, launched = world_with_a_joiner(tmp_path, 1, "1:reform:STOP")
    with launched as world:
        world.procs[0].wait(timeout=150)  # the member trained on without the joiner and ended, its store with it
        world.kill(1, signal.SIGCONT)
        result = world.wait(timeout=60)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, 6], result.summary()
    assert "original rank 1 did not come to generation 2" in result.output(0), result.output(0)[-3000:]
    output = result.output(1)
    assert ("[joiner] error: original rank 1 was replaced: it stood still for" in output and "it does not rejoin" in output
            and "admission" not in output and "Traceback" not in output), output[-3000:]
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(STEPS), "a joiner left behind")
