"""What a checkpoint records of its run's training configuration, and the resume that changes it refused."""
from __future__ import annotations

import datetime
import logging

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from model_parallel import PipelineTrainer, RunOptions, TrainConfig
from model_parallel.errors import ConfigError
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.training_record import check_resume, describe_data, training_record
from model_parallel.runtime.data.batches import SyntheticData
from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.data.sources import MapData

CONFIG = TrainConfig(batch_size=8, num_microbatches=2, lr_schedule="cosine:100")


def test_the_record_holds_the_configuration_and_the_data_position():
    data = MapData(TensorDataset(torch.zeros(40, 2), torch.zeros(40)), 8, name="TensorDataset")
    record = training_record(CONFIG, Prefetcher(data), 7)
    assert record == {"batch_size": 8, "num_microbatches": 2, "schedule": "1f1b", "schedule_running": "1f1b", "seed": 0, "lr_schedule": "cosine:100",
                      "precision": "float32", "clip_grad": None, "data": "TensorDataset (40 samples)",
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


def test_a_checkpoint_without_a_record_resumes_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert check_resume(None, training_record(CONFIG, SyntheticData(8, (4,)), 0), allow=False, where="old") == []
    assert "old records no training configuration" in caplog.text


@pytest.mark.slow
def test_the_api_refuses_a_resume_with_another_batch_size(tmp_path):
    # A world of one rank in this process: the engine's own checkpoint and resume path.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        r = recipe("mlp")

        def run(batch: int, steps: int, resume: bool, allow: bool = False) -> int:
            options = RunOptions(timeout=60, checkpoint_dir=str(tmp_path / "ck"), resume=resume, progress=False,
                                 allow_config_change=allow)
            with PipelineTrainer(r.model(0), lambda p: torch.optim.SGD(p, lr=0.01), r.data(batch, 0),
                                 TrainConfig(batch_size=batch, num_microbatches=2), options=options, num_stages=1,
                                 criterion=r.criterion) as trainer:
                return len(trainer.train(steps))

        assert run(8, 3, resume=False) == 3
        with pytest.raises(ConfigError, match=r"different batch_size: batch_size 8 -> 4"):
            run(4, 5, resume=True)
        assert run(4, 5, resume=True, allow=True) == 2  # steps 3 and 4
    finally:
        dist.destroy_process_group()
