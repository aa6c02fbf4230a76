"""torchrun elastic restarts resume by themselves: a worker that crashes on the first attempt makes torchrun
restart the world, which continues from the latest committed checkpoint with no flag changed and ends with
the parameters of uninterrupted single-process training."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

from model_parallel.runtime.checkpoint.store import latest_step, load_checkpoint
from model_parallel.runtime.launch import launch_workers
from support.mlp import assert_params_close, mlp_job, reference_params

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
STEPS = 6  # --checkpoint_every 2: checkpoints of steps 1, 3, 5


API_SCRIPT = '''\
"""PipelineTrainer under torchrun with a checkpoint directory (written by test_elastic_restart.py)."""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from model_parallel import PipelineTrainer, RunOptions, TrainConfig
from model_parallel.models import StackedMLP
from model_parallel.runtime.run import Rendezvous, join_world

torch.set_num_threads(1)
# join_world, not dist.init_process_group: a restart gets a store key space of its own (docs/reliability.md).
join_world(Rendezvous(backend="gloo", timeout=10))
torch.manual_seed(0)
model = StackedMLP(in_features=16, width=32, depth=4, num_classes=4)
x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
data = TensorDataset(x, (x.sum(dim=1) > 0).long() + 2 * (x[:, 0] > 0).long())
trainer = PipelineTrainer(model, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), data,
                          TrainConfig(batch_size=8, num_microbatches=4), criterion=F.cross_entropy,
                          options=RunOptions(checkpoint_dir=sys.argv[1], checkpoint_every=2, progress=False, timeout=10))
results = trainer.train(6)
print(f"rank {dist.get_rank()} trained steps {[r.step for r in results]}", flush=True)
trainer.close()
dist.destroy_process_group()
'''


def torchrun(tmp_path: Path, *worker_args: str, env: dict[str, str], timeout: float = 150,
             program: tuple[str, ...] = ("-m", "model_parallel.cli.worker")) -> tuple[int, str]:
    """`torchrun --standalone --nproc_per_node=2 --max-restarts=1` of the worker: (exit code, all output)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
               "--monitor-interval=0.2", *program, *worker_args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "TORCH_CPP_LOG_LEVEL": "ERROR", **env}
    full_env.pop("TORCHELASTIC_RESTART_COUNT", None)  # torchrun's agent sets it for its workers
    process = subprocess.Popen(command, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and the workers it started
        output, _ = process.communicate(timeout=30)
        pytest.fail(f"torchrun did not end within {timeout:.0f} s:\n{output[-4000:]}")
    return process.returncode, output


def test_restart_after_a_crash_resumes_from_the_latest_checkpoint_exactly(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 2)
    checkpoints = tmp_path / "ck"
    # Rank 1 dies when checkpoint 3 begins on the first attempt: steps 2 and 3 are lost, the restart redoes them.
    code, output = torchrun(tmp_path, "--model", "mlp", "--plan", str(plan), "--steps", str(STEPS), "--batch_size", "8",
                            "--num_microbatches", "4", "--lr", "0.01", "--checkpoint_dir", str(checkpoints),
                            "--checkpoint_every", "2", "--timeout", "10",
                            env={"MP_TEST_CRASH_AT_CHECKPOINT": "1:3"})
    assert code == 0, output[-6000:]
    assert "test hook MP_TEST_CRASH_AT_CHECKPOINT: exiting at checkpoint step 3" in output, output[-6000:]
    resumed = [line for line in output.splitlines() if "torchelastic restart 1: resumed from the latest committed" in line]
    assert len(resumed) == 2, f"each rank names the restart it resumed on:\n{output[-6000:]}"
    assert all(f"in {checkpoints}, continuing at step 2" in line for line in resumed), resumed
    assert latest_step(checkpoints) == STEPS - 1
    assert_params_close(load_checkpoint(checkpoints).params(), reference_params(STEPS), "restarted run")


def test_restart_without_a_committed_checkpoint_says_it_starts_over(tmp_path: Path) -> None:
    _, plan = mlp_job(tmp_path, 2)
    checkpoints = tmp_path / "ck"
    # Rank 1 dies at the first checkpoint (step 1), before anything was committed.
    code, output = torchrun(tmp_path, "--model", "mlp", "--plan", str(plan), "--steps", "4", "--batch_size", "8",
                            "--num_microbatches", "4", "--lr", "0.01", "--checkpoint_dir", str(checkpoints),
                            "--checkpoint_every", "2", "--timeout", "10",
                            env={"MP_TEST_CRASH_AT_CHECKPOINT": "1:1"})
    assert code == 0, output[-6000:]
    assert f"torchelastic restart 1: no committed checkpoint in {checkpoints}, so training starts again from step 0" \
        in output, output[-6000:]
    assert_params_close(load_checkpoint(checkpoints).params(), reference_params(4), "restarted-from-scratch run")


def test_a_restart_on_a_new_world_size_plans_for_it_and_resumes_exactly(tmp_path: Path) -> None:
    # torchrun --nnodes=MIN:MAX restarts with the same flags on however many workers came back: without --plan
    # each attempt plans for its own world. (The restart is what TORCHELASTIC_RESTART_COUNT says; the workers
    # join with their own store here, as torchrun's agent store is covered above.)
    checkpoints = tmp_path / "ck"
    flags = ["--model", "mlp", "--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01", "--checkpoint_dir",
             str(checkpoints), "--checkpoint_every", "2", "--timeout", "10"]
    first = launch_workers([*flags, "--steps", "4"], 2, timeout=120)  # as if the job died after step 3 committed
    assert first.ok, first.summary()
    again = launch_workers([*flags, "--steps", str(STEPS)], 3, timeout=120, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert again.ok, again.summary()
    output = again.output(0)
    assert f"torchelastic restart 1: resumed from the latest committed checkpoint in {checkpoints}, continuing at " \
           f"step 4" in output, again.summary()
    final = load_checkpoint(checkpoints)
    assert (final.step, final.world["world_size"], len(final.world["plan"]["stages"])) == (STEPS - 1, 3, 3)
    assert_params_close(final.params(), reference_params(STEPS), "restart on 3 workers")


def test_pipeline_trainer_restarted_by_torchrun_resumes_exactly(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(API_SCRIPT)
    code, output = torchrun(tmp_path, str(tmp_path / "uninterrupted"), env={}, program=(str(script),))
    assert code == 0 and "torchelastic" not in output, output[-6000:]
    code, output = torchrun(tmp_path, str(tmp_path / "ck"), env={"MP_TEST_CRASH_AT_CHECKPOINT": "1:3"},
                            program=(str(script),))
    assert code == 0, output[-6000:]
    assert output.count(f"torchelastic restart 1: resumed from the latest committed checkpoint in {tmp_path / 'ck'}, "
                        f"continuing at step 2") == 2, output[-6000:]
    assert "rank 0 trained steps [2, 3, 4, 5]" in output, output[-6000:]
    want = load_checkpoint(tmp_path / "uninterrupted")
    got = load_checkpoint(tmp_path / "ck")
    assert got.step == want.step == 5
    assert_params_close(got.params(), want.params(), "PipelineTrainer restarted by torchrun")
