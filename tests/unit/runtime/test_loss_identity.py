"""The loss a checkpoint records (loss_identity.py): named by where it is defined and the settings that change it."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from model_parallel.errors import ConfigError
from model_parallel.runtime.checkpoint.loss_identity import describe_loss
from model_parallel.runtime.checkpoint.training_record import advice, check_resume, training_record
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.data.batches import SyntheticData


def _smoothed(amount: float):
    def loss(output, target):
        return F.cross_entropy(output, target, label_smoothing=amount)
    return loss


class _Mixed(nn.Module):
    def __init__(self, smoothing: float, inner: nn.Module = None) -> None:
        super().__init__()
        self.inner = inner or nn.CrossEntropyLoss(label_smoothing=smoothing)

    def forward(self, output, target):
        return self.inner(output, target)


def test_library_losses_are_named_by_where_they_are_defined():
    from model_parallel.models.gpt import lm_loss

    assert describe_loss(F.cross_entropy) == "torch.nn.functional.cross_entropy"
    assert describe_loss(lm_loss) == "model_parallel.models.gpt.lm_loss"
    assert describe_loss(nn.CrossEntropyLoss()) == \
        "torch.nn.modules.loss.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.0, reduction='mean')"
    assert describe_loss(functools.partial(F.cross_entropy, label_smoothing=0.1)) == \
        "functools.partial(torch.nn.functional.cross_entropy, label_smoothing=0.1)"


def test_every_setting_that_changes_the_loss_changes_its_description():
    described = [
        describe_loss(nn.CrossEntropyLoss()),
        describe_loss(nn.CrossEntropyLoss(label_smoothing=0.1)),
        describe_loss(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]))),  # class weights: by their bytes
        describe_loss(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]))),
        describe_loss(nn.CrossEntropyLoss(reduction="sum")),
        describe_loss(functools.partial(F.cross_entropy, label_smoothing=0.2)),
        describe_loss(_smoothed(0.1)),  # a closure: its code and the scalar it captured
        describe_loss(_smoothed(0.2)),
        describe_loss(lambda output, target: F.cross_entropy(output, target)),  # a lambda: its code
        describe_loss(lambda output, target: F.cross_entropy(output, target, label_smoothing=0.3)),
        describe_loss(nn.MSELoss().forward),
        describe_loss(_Mixed(0.1)),  # a loss module holding another: the inner one's settings too
        describe_loss(_Mixed(0.2)),
        describe_loss(_Mixed(0.1, inner=nn.MultiMarginLoss())),
    ]
    assert len(set(described)) == len(described), described


def test_the_same_loss_built_again_reads_the_same():
    # What a resume compares: a second process builds its criterion anew (no address may enter the description).
    class Focal:
        def __init__(self, gamma: float) -> None:
            self.gamma, self.model = gamma, nn.Linear(2, 2)  # an object setting is left out, not printed

        def __call__(self, output, target):
            return F.cross_entropy(output, target)

    for build in (lambda: _smoothed(0.1), lambda: Focal(2.0), lambda: nn.CrossEntropyLoss(weight=torch.ones(3)),
                  lambda: functools.partial(F.cross_entropy, label_smoothing=0.1)):
        first, second = describe_loss(build()), describe_loss(build())
        assert first == second and "0x" not in first, first
    assert describe_loss(Focal(2.0)).endswith(".Focal(gamma=2.0)")
    assert describe_loss(Focal(2.0)) != describe_loss(Focal(3.0))


def test_a_resume_with_another_loss_is_refused_with_the_flag_that_restores_it():
    from model_parallel.models.gpt import lm_loss

    config, data = TrainConfig(batch_size=8, num_microbatches=2), SyntheticData(8, (4,))
    stored = training_record(config, data, 3, criterion=F.cross_entropy)
    assert stored["loss"] == "torch.nn.functional.cross_entropy"
    assert check_resume(stored, training_record(config, data, 3, criterion=F.cross_entropy), False, "ck") == []
    with pytest.raises(ConfigError, match=r"different loss: loss 'torch.nn.functional.cross_entropy' -> "
                                          r"'model_parallel.models.gpt.lm_loss'.*\(e.g. --loss cross_entropy\)"):
        check_resume(stored, training_record(config, data, 3, criterion=lm_loss), False, "ck")
    smoothed = training_record(config, data, 3, criterion=nn.CrossEntropyLoss(label_smoothing=0.1))
    with pytest.raises(ConfigError, match=r"different loss.*label_smoothing=0.1"):
        check_resume(stored, smoothed, False, "ck")
    assert check_resume(stored, smoothed, True, "ck")  # accepted when allowed, named in the log
    # A checkpoint written before the loss was recorded: not compared.
    assert check_resume({k: v for k, v in stored.items() if k != "loss"}, smoothed, False, "ck") == []
    assert advice("loss", "model_parallel.models.gpt.lm_loss") == "--loss lm"
    assert advice("loss", "x.y(alpha=1)") == "the criterion the run trained with (x.y(alpha=1))"
