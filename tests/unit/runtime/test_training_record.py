"""What a checkpoint records of its run's training configuration, and the resume that changes it refused."""
from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from model_parallel import PipelineTrainer, RunOptions, TrainConfig
from model_parallel.errors import ConfigError
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.resume import optimizer_state_fits
from model_parallel.runtime.checkpoint.training_record import (advice, check_resume, describe_data, describe_groups,
                                                               training_record)
from model_parallel.runtime.data.batches import SyntheticData
from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.data.sources import MapData

CONFIG = TrainConfig(batch_size=8, num_microbatches=2, lr_schedule="cosine:100")


def test_the_record_holds_the_configuration_and_the_data_position():
    data = MapData(TensorDataset(torch.zeros(40, 2), torch.zeros(40)), 8, name="TensorDataset")
    record = training_record(CONFIG, Prefetcher(data), 7)
    assert record == {"batch_size": 8, "num_microbatches": 2, "schedule": "1f1b", "schedule_running": "1f1b", "seed": 0, "lr_schedule": "cosine:100",
                      "precision": "float32", "clip_grad": None, "data": "TensorDataset (40 samples)",
                      "data_content": {"kind": "dataset", "samples": 40, "sha256 of samples 0, 20, 39": "f25635e956d10560"},
                      "data_position": {"next_step": 7, "epoch": 1, "batch": 2}}
    assert describe_data(SyntheticData(8, (4,))) == "synthetic dense"
    assert training_record(CONFIG, SyntheticData(8, (4,)), 3)["data_position"] == {"next_step": 3, "step": 3}


def test_a_changed_field_is_refused_by_name_and_accepted_when_allowed(caplog):
    stored = training_record(CONFIG, SyntheticData(8, (4,)), 3)
    current = dict(stored, batch_size=32, precision="bf16", data_position={"next_step": 3, "step": 3})
    with pytest.raises(ConfigError, match=r"different batch_size: batch_size 8 -> 32; precision 'float32' -> 'bf16'.*"
                                          r"--batch_size 8.*--allow_config_change"):
        check_resume(stored, current, allow=False, where="ck (step 2)")
    with caplog.at_level(logging.WARNING):
        assert check_resume(stored, current, allow=True, where="ck") == ["batch_size 8 -> 32", "precision 'float32' -> 'bf16'"]
    assert "--allow_config_change: resuming from ck with batch_size 8 -> 32" in caplog.text
    assert check_resume(stored, dict(stored, data_position={"next_step": 9}), allow=False, where="ck") == []


def test_a_flush_schedule_for_another_is_accepted_and_pipedream_is_refused(caplog):
    # Flush schedules train the same parameters (bitwise: 1f1b, gpipe, interleaved, zbh1, zbv resumed from one
    # checkpoint end equal), so a resume under another one continues the run; before, it was refused as a change.
    # PipeDream's asynchronous updates train something else either way.
    stored = training_record(CONFIG, SyntheticData(8, (4,)), 3)
    for schedule in ("gpipe", "interleaved", "zbh1", "zbinterleaved", "zbv", "auto"):
        with caplog.at_level(logging.INFO):
            assert check_resume(stored, dict(stored, schedule=schedule), allow=False, where="ck") == []
        assert f"ck was trained with schedule '1f1b', this run with '{schedule}': flush schedules train" in caplog.text
    with pytest.raises(ConfigError, match=r"different schedule: schedule '1f1b' -> 'pipedream'"):
        check_resume(stored, dict(stored, schedule="pipedream"), allow=False, where="ck")
    with pytest.raises(ConfigError, match=r"different schedule: schedule 'pipedream' -> 'auto'"):
        check_resume(dict(stored, schedule="pipedream"), dict(stored, schedule="auto"), allow=False, where="ck")


def test_a_checkpoint_without_a_record_resumes_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert check_resume(None, training_record(CONFIG, SyntheticData(8, (4,)), 0), allow=False, where="old") == []
    assert "old records no training configuration" in caplog.text


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


def test_the_record_holds_the_optimizer_kind_and_its_defaults():
    record = training_record(CONFIG, SyntheticData(8, (4,)), 0, torch.optim.AdamW(_params(), lr=3e-3))
    assert {k: record[k] for k in ("optimizer", "lr", "weight_decay", "betas", "eps")} == \
        {"optimizer": "adamw", "lr": 0.003, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-08}
    sgd = training_record(CONFIG, SyntheticData(8, (4,)), 0, torch.optim.SGD(_params(), lr=0.1, momentum=0.9))
    assert {k: sgd[k] for k in ("optimizer", "lr", "momentum", "weight_decay")} == \
        {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0} and "betas" not in sgd


def test_a_changed_optimizer_or_lr_is_refused_by_name_and_accepted_when_allowed(caplog):
    def record(optimizer):
        return training_record(CONFIG, SyntheticData(8, (4,)), 3, optimizer)

    stored = record(torch.optim.AdamW(_params(), lr=3e-3))
    with pytest.raises(ConfigError, match=r"different lr: lr 0.003 -> 0.1 \(checkpoint -> this run\).*\(e.g. --lr 0.003\)"
                                          r".*--allow_config_change"):
        check_resume(stored, record(torch.optim.AdamW(_params(), lr=0.1)), allow=False, where="ck")
    # Another kind: named as such; the settings only one of them has (SGD's momentum, Adam's betas) are not.
    with pytest.raises(ConfigError, match=r"different optimizer: optimizer 'adamw' -> 'sgd'; weight_decay 0.01 -> 0.0 "
                                          r"\(checkpoint -> this run\).*\(e.g. --optimizer adamw\)"):
        check_resume(stored, record(torch.optim.SGD(_params(), lr=3e-3, momentum=0.9)), allow=False, where="ck")
    with caplog.at_level(logging.WARNING):
        assert check_resume(stored, record(torch.optim.AdamW(_params(), lr=0.1)), allow=True, where="ck") == ["lr 0.003 -> 0.1"]
    assert "--allow_config_change: resuming from ck with lr 0.003 -> 0.1" in caplog.text
    # A checkpoint written before the optimizer was recorded: unknown, not refused.
    old = {k: v for k, v in stored.items() if k not in ("optimizer", "lr", "weight_decay", "betas", "eps")}
    assert check_resume(old, record(torch.optim.SGD(_params(), lr=1.0)), allow=False, where="ck") == []


def _decay_matrices(matrix_decay: float = 0.1, vector_decay: float = 0.0, vector_lr: float = 1e-3):
    """The usual factory: weight decay on matrices only (it gets tensors, not names: a rule on ndim)."""
    def factory(params):
        params = list(params)
        return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": matrix_decay},
                                  {"params": [p for p in params if p.ndim < 2], "weight_decay": vector_decay,
                                   "lr": vector_lr}], lr=1e-3)
    return factory


def test_parameter_groups_are_recorded_and_a_changed_group_is_refused():
    def record(factory):
        return training_record(CONFIG, SyntheticData(8, (4,)), 3, factory(_params()), describe_groups(factory))

    stored = record(_decay_matrices())
    # What the groups set beyond the defaults (AdamW's weight_decay default is 0.01).
    assert stored["param_groups"] == {"matrix": {"weight_decay": 0.1}, "vector": {"weight_decay": 0.0}}
    assert check_resume(stored, record(_decay_matrices()), allow=False, where="ck") == []
    # The defaults are the same: only the groups tell the change (the vectors were trained without decay).
    with pytest.raises(ConfigError, match=r"different param_groups: param_groups \{'matrix': \{'weight_decay': 0.1\}, "
                                          r"'vector': \{'weight_decay': 0.0\}\} -> \{'matrix': \{'weight_decay': 0.1\}, "
                                          r"'vector': \{'weight_decay': 0.1\}\}"):
        check_resume(stored, record(_decay_matrices(vector_decay=0.1)), allow=False, where="ck")
    with pytest.raises(ConfigError, match=r"different param_groups"):
        check_resume(stored, record(_decay_matrices(vector_lr=1e-2)), allow=False, where="ck")
    # A factory that cannot build on the probe tensors records no groups: not compared. An older record: unknown.
    assert describe_groups(lambda params: torch.optim.SGD(list(params)[5:], lr=0.1)) == {}
    old = {k: v for k, v in stored.items() if k != "param_groups"}
    assert check_resume(old, record(_decay_matrices(vector_decay=0.5)), allow=False, where="ck") == []
    # A factory without groups: no overrides, so adding groups later is a change too; a change of the defaults
    # alone (--lr) is named once, as lr, not again as the groups.
    plain = lambda lr: lambda params: torch.optim.AdamW(params, lr=lr)  # noqa: E731
    assert describe_groups(plain(1e-3)) == {"param_groups": {"matrix": {}, "vector": {}}}
    with pytest.raises(ConfigError, match=r"different lr: lr 0.001 -> 0.01 \(checkpoint -> this run\)"):
        check_resume(record(plain(1e-3)), record(plain(1e-2)), allow=False, where="ck")


@pytest.mark.parametrize("field, value, want", [
    ("clip_grad", None, "without --clip_grad"),  # argparse takes no "--clip_grad None"
    ("data", "tokens:train.bin (1429 samples)", "--data tokens:train.bin"),
    ("data", "synthetic dense", "--data synthetic"),
    ("precision", "bf16", "--bf16"),
    ("precision", "float32", "without --bf16"),
    ("betas", [0.9, 0.99], "an optimizer_factory building the optimizer with betas=(0.9, 0.99)"),
    ("batch_size", 8, "--batch_size 8"),
])
def test_the_advice_is_a_value_the_command_line_takes(field, value, want):
    assert advice(field, value) == want


def test_another_optimizers_state_is_a_config_error_not_a_key_error(caplog):
    # A checkpoint that records no optimizer (older) holding SGD's state, resumed with AdamW (its step: KeyError 'exp_avg').
    adamw, sgd_state = torch.optim.AdamW(_params()), {"0.weight": {"momentum_buffer": torch.zeros(3)}}
    with pytest.raises(ConfigError, match=r"--resume from ck: the checkpoint holds another optimizer's state "
                                          r"\(momentum_buffer\) than this run's AdamW keeps \(exp_avg, exp_avg_sq, step\);"
                                          r".*--allow_config_change"):
        optimizer_state_fits(adamw, sgd_state, allow=False, where="ck")
    with caplog.at_level(logging.WARNING):
        assert not optimizer_state_fits(adamw, sgd_state, allow=True, where="ck")
    assert "without its optimizer state (momentum_buffer)" in caplog.text
    assert optimizer_state_fits(torch.optim.SGD(_params(), lr=0.1, momentum=0.9), sgd_state, allow=False, where="ck")
    assert optimizer_state_fits(adamw, {}, allow=False, where="ck")  # before the first step: nothing to mistake


@pytest.mark.slow
def test_the_api_refuses_a_resume_with_another_batch_size(tmp_path):
    # A world of one rank in this process: the engine's own checkpoint and resume path.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        r = recipe("mlp")

        def run(batch: int, steps: int, resume: bool, allow: bool = False, optimizer: type = torch.optim.SGD,
                criterion: Callable = r.criterion) -> int:
            options = RunOptions(timeout=60, checkpoint_dir=str(tmp_path / "ck"), resume=resume, progress=False,
                                 allow_config_change=allow)
            with PipelineTrainer(r.model(0), lambda p: optimizer(p, lr=0.01), r.data(batch, 0),
                                 TrainConfig(batch_size=batch, num_microbatches=2), options=options, num_stages=1,
                                 criterion=criterion) as trainer:
                return len(trainer.train(steps))

        assert run(8, 3, resume=False) == 3
        with pytest.raises(ConfigError, match=r"different batch_size: batch_size 8 -> 4"):
            run(4, 5, resume=True)
        assert run(4, 5, resume=True, allow=True) == 2  # steps 3 and 4
        with pytest.raises(ConfigError, match=r"different optimizer: optimizer 'sgd' -> 'adamw'"):
            run(4, 7, resume=True, optimizer=torch.optim.AdamW)
        # Parameter groups (no decay on biases) changed on resume: refused though the defaults are the same.
        def grouped(decay: float) -> Callable[..., torch.optim.Optimizer]:
            return lambda params, lr: torch.optim.SGD([
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": decay}], lr=lr)

        assert run(4, 6, resume=True, allow=True, optimizer=grouped(0.0)) == 1  # accepted: the kind did not change
        with pytest.raises(ConfigError, match=r"different param_groups"):
            run(4, 8, resume=True, optimizer=grouped(0.1))
        # Another loss (label smoothing) trains another objective from the same parameters: refused by name.
        with pytest.raises(ConfigError, match=r"different loss: loss 'torch.nn.functional.cross_entropy' -> "
                                              r"'functools.partial\(torch.nn.functional.cross_entropy, label_smoothing=0.1\)'"):
            run(4, 8, resume=True, optimizer=grouped(0.0), criterion=functools.partial(r.criterion, label_smoothing=0.1))
    finally:
        dist.destroy_process_group()


def test_the_data_record_names_the_source_through_the_batch_check():
    # A user's batch(step) object is wrapped to check its batches; this package's own sources are not (a wrapped
    # SyntheticData recorded "BatchSource", which a resume of an older checkpoint would have refused as other data).
    from model_parallel.runtime.data.sources import BatchSource, as_source

    class StepSource:
        def batch(self, step: int):
            return SyntheticData(8, (4,)).batch(step)

    assert describe_data(as_source(SyntheticData(8, (4,)), 8, 0)) == "synthetic dense"
    wrapped = as_source(StepSource(), 8, 0)
    assert isinstance(wrapped, BatchSource) and describe_data(wrapped) == "StepSource"
