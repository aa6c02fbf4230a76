"""The worker's optimizer flags reach the optimizer it builds: `--eps` for AdamW (before, there was none, and Adam's
1e-8 amplified last-bit differences of near-zero gradients so far that a pipeline could not be checked against one
process within 1e-5), refused outside its range, and recorded by checkpoints like the other optimizer settings."""
from __future__ import annotations

import pytest
import torch

from model_parallel.cli.worker import build_parser
from model_parallel.cli.worker_inputs import check_numbers
from model_parallel.cli.worker_job import make_optimizer_factory
from model_parallel.errors import ConfigError
from model_parallel.runtime.checkpoint.training_record import OPTIMIZER_FIELDS, describe_groups


def _optimizer(*flags: str) -> torch.optim.Optimizer:
    args = build_parser().parse_args(["--model", "mlp", *flags])
    check_numbers(args)
    return make_optimizer_factory(args)([torch.nn.Parameter(torch.zeros(2))])


def test_eps_reaches_adamw_and_defaults_to_torchs() -> None:
    adamw = _optimizer("--optimizer", "adamw", "--eps", "1e-6", "--weight_decay", "0.01", "--lr", "0.003")
    assert isinstance(adamw, torch.optim.AdamW)
    assert (adamw.defaults["eps"], adamw.defaults["weight_decay"], adamw.defaults["lr"]) == (1e-6, 0.01, 0.003)
    assert _optimizer("--optimizer", "adamw").defaults["eps"] == torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults["eps"]
    assert "eps" in OPTIMIZER_FIELDS  # a resume with another --eps is named as an optimizer change


@pytest.mark.parametrize("value", ["-1e-06", "nan", "2.0"])
def test_an_eps_outside_its_range_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=rf"--eps {value}: the AdamW eps must be a finite number in 0\.\.1"):
        _optimizer("--optimizer", "adamw", f"--eps={value}")


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_no_decay_vectors_leaves_biases_and_norm_weights_undecayed_and_is_recorded(kind: str) -> None:
    args = build_parser().parse_args(["--model", "mlp", "--optimizer", kind, "--weight_decay", "0.1", "--no_decay_vectors"])
    check_numbers(args)
    matrix, vector = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = make_optimizer_factory(args)([matrix, vector])
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert decay == {id(matrix): 0.1, id(vector): 0.0}
    # A stage holding only matrices (or only vectors) gets one group: torch refuses none, and an empty one means nothing.
    assert len(make_optimizer_factory(args)([matrix]).param_groups) == 1
    # The checkpoint's record tells it from a run without the flag, so a resume that drops it is refused.
    plain = build_parser().parse_args(["--model", "mlp", "--optimizer", kind, "--weight_decay", "0.1"])
    check_numbers(plain)
    assert describe_groups(make_optimizer_factory(args)) != describe_groups(make_optimizer_factory(plain))
