"""The worker command line with a token file (`--data tokens:PATH`), validation flags and a truthful resume:
a run checkpointed mid-epoch and resumed equals the uninterrupted run; a resume with another batch size and lr is
refused on every rank (exit 2, the fields named); the last line says what this run executed."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from model_parallel.cli.worker import build_parser, check_inputs
from model_parallel.errors import ConfigError, PlanError
from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.config import RunOptions
from model_parallel.runtime.launch import launch_workers
from model_parallel.runtime.observe.metrics_read import read_metrics



@pytest.mark.parametrize("argv, message", [
    (["--eval_every", "5"], r"--eval_every 5: needs --eval_data"),
    (["--seq_len", "0"], r"--seq_len 0: a window is at least 1 token; leave the flag out"),  # was the model's length
    (["--data", "tokens:/nonexistent/train.bin"], r"--data tokens:/nonexistent/train.bin: no such file"),
    (["--eval_data", "/nonexistent"], r"--eval_data /nonexistent: not a directory; give 'synthetic', tokens:PATH"),
])
def test_bad_data_flags_are_one_line_errors(argv, message):
    with pytest.raises(PlanError, match=message):
        check_inputs(build_parser().parse_args(["--model", "mlp", *argv]))


def test_bad_eval_options_are_refused():
    with pytest.raises(ConfigError, match=r"eval_every must be >= 0.*and eval_steps >= 1, got 1 and 0"):
        RunOptions(eval_every=1, eval_steps=0)


def _common(tokens, directory, steps):
    return ["--model", "gpt", "--data", f"tokens:{tokens}", "--batch_size", "8", "--num_microbatches", "2",
            "--steps", str(steps), "--checkpoint_dir", str(directory), "--lr", "0.05"]


@pytest.mark.slow
def test_token_file_resume_mid_epoch_equals_uninterrupted_and_a_changed_batch_size_is_refused(tmp_path):
    # TinyGPT reads 16 ids of a vocabulary of 128: 40 windows = 5 steps per epoch of 8.
    tokens = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 128, 40 * 16 + 1, dtype=np.uint16).tofile(tokens)
    whole, part = tmp_path / "whole", tmp_path / "part"
    metrics = tmp_path / "metrics.{rank}.jsonl"
    jobs = [
        _common(tokens, whole, 9) + ["--eval_data", f"tokens:{tokens}", "--eval_every", "4", "--eval_steps", "2",
                                     "--metrics", str(metrics)],
        _common(tokens, part, 7),  # its checkpoint: next step 7 = epoch 1, minibatch 2
        _common(tokens, part, 9) + ["--resume"],
        _common(tokens, part, 12) + ["--resume", "--batch_size", "4", "--lr", "0.5"],  # refused
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    result = launch_workers(["--jobs", str(tmp_path / "jobs.json"), "--timeout", "60"], 2, timeout=400,
                            env={"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path)})
    assert [w.returncode for w in result.workers] == [2, 2], result.summary()
    output = result.output(0)
    assert re.search(r"--resume from .*part \(step 8\): the run was trained with a different batch_size: batch_size 8 -> 4; "
                     r"lr 0.05 -> 0.5 \(checkpoint -> this run\).*--allow_config_change", output), result.summary()
    assert "this run executed steps 7..8 and reached step 9 of 9" in output, result.summary()
    assert re.search(r"done: 2 step\(s\)", output)

    want, got = load_checkpoint(whole), load_checkpoint(part)
    assert got.step == want.step == 8
    assert got.extra["training"]["data_position"] == {"next_step": 9, "epoch": 1, "batch": 4}
    assert got.extra["training"]["batch_size"] == 8 and got.extra["training"]["data"].startswith("tokens:")
    for name, value in want.params().items():
        assert torch.allclose(got.params()[name], value, atol=1e-5), f"{name}: resumed run differs from the uninterrupted one"

    records = read_metrics(tmp_path / "metrics.0.jsonl")
    validated = [r["step"] for r in records if "val_loss" in r]
    assert validated == [3, 7, 8], validated  # every 4 steps and after the last
    assert all(np.isfinite(r["val_loss"]) and r["val_loss"] > 0 for r in records if "val_loss" in r)
