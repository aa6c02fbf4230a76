"""TrainConfig / RunOptions / StragglerInjection checks: a ConfigError (also a ValueError) naming the field."""
from __future__ import annotations

import pytest

from model_parallel.errors import ConfigError, ModelParallelError
from model_parallel.runtime.config import RunOptions, StragglerInjection, TrainConfig
from model_parallel.cli.worker import build_parser
from model_parallel.cli.worker_job import make_config


@pytest.mark.parametrize("build, message", [
    (lambda: TrainConfig(batch_size=0), r"batch_size and num_microbatches must be >= 1, got 0 and 4"),
    (lambda: TrainConfig(batch_size=2, num_microbatches=4), r"batch size 2 < 4 microbatches.*raise batch_size"),
    # Unequal microbatches would each weigh 1/m: not the minibatch's mean loss (a user's QA found it trained silently).
    (lambda: TrainConfig(batch_size=10, num_microbatches=4),
     r"batch size 10 is not a multiple of 4 microbatches: they would hold 3, 3, 2, 2 samples.*\(8, 12\).*\(2, 5, 10\)"),
    (lambda: TrainConfig(schedule="zb"), r"unknown schedule 'zb'; choose 1f1b, gpipe, pipedream, interleaved, zbh1, zbinterleaved, zbv or auto"),
    (lambda: TrainConfig(clip_grad=-1.0), r"clip_grad must be > 0, got -1.0"),
    (lambda: TrainConfig(lr_schedule="cosine"), r"bad --lr_schedule 'cosine'"),
    (lambda: RunOptions(timeout=0), r"timeout must be > 0 seconds, got 0"),
    (lambda: RunOptions(checkpoint_every=-2), r"checkpoint_every must be >= 0 steps .* got -2"),
    (lambda: RunOptions(keep_checkpoints=0), r"keep_checkpoints must be >= 1"),
    (lambda: RunOptions(resume=True), r"resume needs checkpoint_dir"),  # the API trained from step 0, unsaid
    (lambda: StragglerInjection(0.5, 1), r"slowdown factor must be >= 1 \(1 = off\), got 0.5"),
    (lambda: StragglerInjection(2.0, -1), r"slowdown_rank must be a rank >= 0, got -1"),
    (lambda: StragglerInjection(2.0, 0, after_step=-1), r"slowdown_after_step must be >= 0, got -1"),
])
def test_a_bad_setting_is_a_config_error_naming_it(build, message):
    with pytest.raises(ConfigError, match=message) as caught:
        build()
    # `except ValueError` (what a user catches for a bad value) catches it too.
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ModelParallelError)


def test_training_settings_and_run_options_are_separate():
    config, options = make_config(build_parser().parse_args([
        "--batch_size", "6", "--num_microbatches", "3", "--timeout", "9", "--checkpoint_dir", "ck", "--resume",
        "--slowdown", "2", "--slowdown_rank", "1", "--slowdown_after_step", "4"]))
    assert config == TrainConfig(batch_size=6, num_microbatches=3)
    assert options == RunOptions(timeout=9.0, checkpoint_dir="ck", resume=True, progress=True,
                                 straggler=StragglerInjection(2.0, 1, 4))
    assert make_config(build_parser().parse_args([]))[1].straggler is None


def test_a_slowdown_without_a_rank_is_refused():
    with pytest.raises(ConfigError, match=r"--slowdown 3.0 needs --slowdown_rank R"):
        make_config(build_parser().parse_args(["--slowdown", "3"]))
