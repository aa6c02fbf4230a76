"""`--join` from a host with another version of the code: the joiner's flags equal the job's (`--model mlp`), but
its mlp has a Tanh where the job's has a ReLU. QA found it was caught only by the new world's agreement, after the
members had stopped for it, and that ended every member of the running job with exit 2. Rank 0 now publishes its
training record (its graph's structure, its data's fingerprint) and the joiner is refused alone, before it posts
its request, even before the job committed a checkpoint; the job trains on."""
from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest

from model_parallel.runtime.launch import REPO_ROOT, LocalWorld, free_port, join_command, worker_commands

pytestmark = [pytest.mark.timeout(200), pytest.mark.slow]


def test_a_joiner_running_other_code_is_refused_alone(tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(Path(REPO_ROOT) / "model_parallel", other / "model_parallel",
                    ignore=shutil.ignore_patterns("__pycache__"))
    mlp = other / "model_parallel" / "models" / "mlp.py"
    mlp.write_text(mlp.read_text().replace("nn.ReLU()]", "nn.Tanh()]"))
    args = ["--model", "mlp", "--steps", "12", "--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01",
            "--timeout", "5", "--checkpoint_dir", str(tmp_path / "ck"), "--checkpoint_every", "3", "--recover"]
    port = free_port()
    joiner = join_command(f"127.0.0.1:{port}", args)
    # `python -m` puts its working directory first on sys.path: the joiner runs in the copy, importing the copy
    command = ["sh", "-c", f"cd {shlex.quote(str(other))} && exec env PYTHONPATH=. {shlex.join(joiner)}"]
    with LocalWorld(worker_commands(args, 2, port=port) + [command], env={"MP_TEST_JOIN_AT_STEP": "6"}) as world:
        result = world.wait(timeout=150)
    assert not result.timed_out, result.summary()
    assert [w.returncode for w in result.workers] == [0, 0, 2], result.summary()
    output = result.output(2)
    assert ("--model mlp traces on this host to another model than the running job's" in output
            and "published by the job's rank 0" in output), output[-3000:]
    for rank in (0, 1):
        assert "admission" not in result.output(rank) and "another graph" not in result.output(rank), result.summary()


def test_a_joiner_that_reaches_no_job_calls_itself_the_joiner_not_rank_0(tmp_path: Path) -> None:
    # QA: "[rank 0] error: --join ...: no job's store answers there" and "[rank 0] no checkpoint was committed ...":
    # a joiner has no rank before it is admitted, and "rank 0" read as the job's rank 0 failing.
    args = ["--model", "mlp", "--steps", "4", "--timeout", "1", "--checkpoint_dir", str(tmp_path / "ck")]
    with LocalWorld([join_command(f"127.0.0.1:{free_port()}", args)]) as world:
        result = world.wait(timeout=60)
    assert [w.returncode for w in result.workers] == [3], result.summary()
    lines = result.output(0).strip().splitlines()
    assert lines[-2].startswith("[joiner] error: --join 127.0.0.1:") and "no job's store answers there" in lines[-2], lines
    assert lines[-1].startswith("[joiner] no checkpoint was committed"), lines
