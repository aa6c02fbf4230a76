"""Validation over a map-style dataset (runtime/step/evaluate.py): past its last full minibatch the source wraps into
its next epoch (another shuffle), so evaluate(val, ceil(len / batch)) counted samples twice into the mean loss and a
top-1 accuracy without a word; it says so, naming the steps that read each sample once."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.data.sources import as_source
from model_parallel.runtime.step.evaluate import single_process_evaluate


def _accuracy(output, target):
    return (output.argmax(-1) == target).float().mean()


def test_evaluating_past_one_epoch_of_a_dataset_warns_naming_the_steps_that_read_it_once(caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    val = TensorDataset(torch.randn(10, 3), torch.arange(10) % 2)
    source = as_source(val, 4, seed=0)  # 2 minibatches of 4; 2 samples left out
    with caplog.at_level(logging.WARNING):
        single_process_evaluate(model, F.cross_entropy, source, 2, steps=2, metric=_accuracy)
    assert not caplog.records  # one epoch: nothing to say
    with caplog.at_level(logging.WARNING):
        single_process_evaluate(model, F.cross_entropy, source, 2, steps=3, metric=_accuracy)
    text = caplog.text
    assert "10 samples, 2 minibatch(es) of 4" in text and "4 sample(s) count twice" in text
    assert "give steps=2" in text and "2 left out" in text
    caplog.clear()
    with Prefetcher(as_source(val, 4, seed=0)) as data, caplog.at_level(logging.WARNING):  # as the trainer's eval_data
        single_process_evaluate(model, F.cross_entropy, data, 2, steps=3)
    assert "10 samples" in caplog.text and "give steps=2" in caplog.text
