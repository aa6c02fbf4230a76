"""The `--recover` worlds of the recovery tests: the zoo MLP's command line, one launch with the signal hook, and
the checks that a recovered run equals uninterrupted single-process training."""
from __future__ import annotations

from pathlib import Path

from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import WorldResult, launch_workers
from model_parallel.runtime.observe.metrics_read import read_events, read_metrics
from support.mlp import assert_params_close, reference_losses, reference_params

STEPS = 10
TIMEOUT = 5  # --timeout: how long a blocking call waits for a peer


def args(checkpoints: Path, tmp_path: Path, every: int = 2, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--model", "mlp", "--steps", str(STEPS), "--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01",
            "--checkpoint_dir", str(checkpoints), "--checkpoint_every", str(every), "--timeout", str(TIMEOUT),
            "--metrics", str(tmp_path / "metrics" / "rank{rank}.jsonl"), "--recover", *extra]


def run(tmp_path: Path, hook: str, world_size: int = 3, every: int = 2, port: int = 0,
        extra: tuple[str, ...] = ()) -> WorldResult:
    result = launch_workers(args(tmp_path / "ck", tmp_path, every, extra), world_size, timeout=150, port=port or None,
                            env={"MP_TEST_SIGNAL_AT_STEP": hook})
    assert not result.timed_out, result.summary()
    return result


def assert_exact(tmp_path: Path, survivors: list[int], batch: int = 8, micro: int = 4) -> None:
    """Final parameters and every step's loss after the recovery equal uninterrupted single-process training
    (`batch`, `micro`: the run's --batch_size and --num_microbatches, when `extra` changed them)."""
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(STEPS, batch, micro), "recovered run")
    want = reference_losses(STEPS, batch, micro)
    for rank in survivors:
        records = read_metrics(tmp_path / "metrics" / f"rank{rank}.jsonl")
        last = {r["step"]: r["loss"] for r in records}  # a recomputed step: its last record
        assert sorted(last) == list(range(STEPS)), f"original rank {rank} ran steps {sorted(last)}"
        for step, loss in last.items():
            assert abs(loss - want[step]) <= 1e-5, f"step {step}: loss {loss} vs {want[step]} single-process"


def recoveries(tmp_path: Path, rank: int) -> list[dict]:
    return read_events(tmp_path / "metrics" / f"rank{rank}.jsonl", "recovery")
