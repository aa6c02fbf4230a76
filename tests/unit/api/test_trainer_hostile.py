"""The hostile checkpoint and weights corpus through the Python API: `PipelineTrainer(weights=...)` and a
`PipelineTrainer` resuming (`RunOptions(resume=True)`) raise one typed error naming the file, never a traceback
from deep inside, a blocked read or a silent wrong resume."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from model_parallel.api.trainer import PipelineTrainer
from model_parallel.errors import CheckpointError, InitError
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.config import RunOptions, TrainConfig
from model_parallel.runtime.launch import free_port

CONFIG = TrainConfig(batch_size=8, num_microbatches=4)


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def trainer(meta: bool = False, **kwargs: object) -> PipelineTrainer:
    r = recipe("mlp")
    model = r.meta_model() if meta else r.model(0)  # on meta, stored weights give the values
    return PipelineTrainer(model, sgd, r.data(8, 0), CONFIG, criterion=r.criterion, **kwargs)


def corrupt_manifest(checkpoints: Path, **changes: object) -> None:
    step = (checkpoints / "latest").read_text().strip()
    path = checkpoints / step / "manifest.json"
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "file":
            manifest["shards"][0]["file"] = value
        else:
            manifest["extra"][key] = value
    path.write_text(json.dumps(manifest))


@pytest.fixture
def one_rank_world() -> Iterator[None]:
    """A world of one gloo rank in this process, so PipelineTrainer runs its engine (checkpoints, resume)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def checkpointed(directory: Path) -> None:
    with trainer(num_stages=1, options=RunOptions(timeout=30, checkpoint_dir=str(directory), checkpoint_every=1)) as t:
        t.train(2)


@pytest.mark.slow
@pytest.mark.parametrize("changes, message", [
    ({"file": ".."}, r"malformed manifest: shards\[0\]\.file must be a file name in the step directory, found '\.\.'"),
    ({"next_step": 1e300}, r"malformed manifest: extra\.next_step must be a whole number of steps in 0\.\.2"),
    ({"next_step": -5}, r"malformed manifest: extra\.next_step must be a whole number"),
])
def test_a_trainer_resuming_from_a_corrupt_manifest_raises_one_checkpoint_error(
        tmp_path: Path, one_rank_world: None, changes: dict, message: str) -> None:
    checkpoints = tmp_path / "ck"
    checkpointed(checkpoints)
    corrupt_manifest(checkpoints, **changes)
    with trainer(num_stages=1, options=RunOptions(timeout=30, checkpoint_dir=str(checkpoints), resume=True)) as t:
        with pytest.raises(CheckpointError, match=r"restoring the checkpoint failed on rank 0: .*" + message):
            t.train(4)


@pytest.mark.slow
def test_a_trainer_resuming_from_a_fifo_shard_is_refused_without_blocking(tmp_path: Path, one_rank_world: None) -> None:
    checkpoints = tmp_path / "ck"
    checkpointed(checkpoints)
    shard = checkpoints / "step_1" / "shard_0.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    with trainer(num_stages=1, options=RunOptions(timeout=30, checkpoint_dir=str(checkpoints), resume=True)) as t:
        with pytest.raises(CheckpointError, match=r"shard_0\.safetensors: the shard of rank 0 is not a regular file"):
            t.train(4)


@pytest.mark.slow
def test_trainer_weights_from_a_corrupt_checkpoint_or_a_fifo_are_typed_errors(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ck"
    from model_parallel.runtime.checkpoint.store import finalize, save_shard

    r = recipe("mlp")
    from model_parallel.codegen.naming import state_key

    save_shard(checkpoints, 1, 0, {state_key(k): v.detach() for k, v in r.model(5).named_parameters()})
    finalize(checkpoints, 1, {}, None, expected_ranks=[0])
    corrupt_manifest(checkpoints, file="")
    with pytest.raises(CheckpointError, match=r"shards\[0\]\.file must be a file name"):
        trainer(meta=True, num_stages=2, single_process=True, weights=checkpoints)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors")
    with pytest.raises(InitError, match=r"model\.safetensors \(named by .*\): not a regular file"):
        trainer(meta=True, num_stages=2, single_process=True, weights=fifo)


def test_a_trainer_without_data_refuses_to_train_with_the_reason() -> None:
    from model_parallel import PipelineTrainer, TrainConfig
    from model_parallel.errors import DataError
    from model_parallel.models import StackedMLP

    trainer = PipelineTrainer(StackedMLP(depth=2), lambda p: torch.optim.SGD(p, lr=0.1), None,
                              TrainConfig(batch_size=8, num_microbatches=2), num_stages=2,
                              example_inputs=[torch.zeros(4, 64)], single_process=True)
    assert trainer.plan.num_stages == 2  # built for its plan (or to evaluate) without data
    with pytest.raises(DataError, match=r"built without data \(dataset=None\)"):
        trainer.train(1)


@pytest.mark.parametrize("option", [{"checkpoint_dir": "ck"}, {"resume": True, "checkpoint_dir": "ck"}, {"metrics": "m.jsonl"},
                                    {"trace_dir": "t"}])
def test_single_process_mode_refuses_what_it_would_ignore(option: dict) -> None:
    # It trains in memory: a checkpoint it never writes, or a resume that starts at step 0, would pass without a word.
    from model_parallel.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"single-process mode .* does not honour RunOptions [^:]*{next(iter(option))}"):
        trainer(num_stages=2, single_process=True, options=RunOptions(progress=False, **option))
