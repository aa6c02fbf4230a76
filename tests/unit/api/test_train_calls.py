"""`PipelineTrainer.train` called again continues where the last call ended (single-process mode; the pipeline's
path: tests/integration/test_train_calls.py): the next minibatches, the lr schedule going on, validation at the
run's own steps. Before, each call started at step 0 again, retraining the first minibatches without a word."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from model_parallel import PipelineTrainer, RunOptions, TrainConfig
from model_parallel.errors import ConfigError
from model_parallel.models.mlp import StackedMLP


def _trainer() -> PipelineTrainer:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 16, generator=gen), torch.randint(0, 4, (48,), generator=gen))
    return PipelineTrainer(StackedMLP(in_features=16, width=32, depth=4, num_classes=4),
                           lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), data,
                           TrainConfig(batch_size=8, num_microbatches=2, lr_schedule="warmup:4"), num_stages=2,
                           single_process=True, eval_data=data, options=RunOptions(eval_every=3, eval_steps=1))


def test_train_twice_equals_train_once_with_the_total() -> None:
    once, twice = _trainer(), _trainer()
    whole = once.train(5)
    first, second = twice.train(2), twice.train(3)
    assert [r.step for r in first] == [0, 1] and [r.step for r in second] == [2, 3, 4]
    assert [r.lr for r in first + second] == [r.lr for r in whole]
    assert [r.loss for r in first + second] == [r.loss for r in whole]
    # validation every 3 steps of the run and after each call's last step
    assert [r.step for r in whole if "val_loss" in r.extra] == [2, 4]
    assert [r.step for r in first + second if "val_loss" in r.extra] == [1, 2, 4]
    a, b = once.state_dict(), twice.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_every_without_eval_data_is_refused() -> None:
    """As `--eval_every` without `--eval_data` is on the command line; the API trained without validating, silently."""
    import pytest

    from model_parallel.errors import ConfigError

    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen))
    with pytest.raises(ConfigError, match=r"RunOptions\(eval_every=2\) validates on eval_data, and none was given"):
        PipelineTrainer(StackedMLP(in_features=16, width=8, depth=2, num_classes=4), lambda p: torch.optim.SGD(p, lr=0.1),
                        data, TrainConfig(batch_size=8, num_microbatches=2), num_stages=2, single_process=True,
                        options=RunOptions(eval_every=2))



def test_an_optimizer_over_other_parameters_than_the_stages_is_refused():
    """Hugging Face's no-decay idiom ported as a factory that groups the original model's named_parameters() instead of
    the `params` it is given: where the stages' parameters are other tensors (each rank of a model built on meta
    materializes its own), before, the run went on with none of them updated (the loss flat, no error). Refused naming
    the fix (here the factory reads another instance, as such a rank's factory does); a frozen one may be left out."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen))
    other = StackedMLP(in_features=16, width=8, depth=2, num_classes=4)

    def by_names(params):
        named = list(other.named_parameters())
        return torch.optim.AdamW([{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.1},
                                  {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}])

    with pytest.raises(ConfigError, match=r"leaves out \d+ of the \d+ parameter\(s\) it was given .*p\.ndim >= 2"):
        PipelineTrainer(StackedMLP(in_features=16, width=8, depth=2, num_classes=4), by_names, data,
                        TrainConfig(batch_size=8, num_microbatches=2), num_stages=2, single_process=True)
    trainable = StackedMLP(in_features=16, width=8, depth=2, num_classes=4)
    name, frozen = next(iter(trainable.named_parameters()))
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    trainer = PipelineTrainer(trainable, lambda params: torch.optim.SGD([p for p in params if p.requires_grad], lr=0.1),
                              data, TrainConfig(batch_size=8, num_microbatches=2), num_stages=2, single_process=True)
    trainer.train(1)
    assert torch.equal(trainer.state_dict(original_names=True)[name], before)
