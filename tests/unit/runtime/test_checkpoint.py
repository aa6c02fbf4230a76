"""Checkpoints keyed by layer: round trip, resume under another split, crash safety, typed errors."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint import store as ckpt

torch.set_num_threads(1)

LEAVES = ["0.0", "0.1", "1.0", "1.1", "2"]  # leaf modules of `_model()`, in execution order


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
        nn.Linear(8, 3),
    )


class _Stage(nn.Module):
    """A stage module as the code generator builds it: each layer under `target.replace('.', '_')`."""

    def __init__(self, model: nn.Module, targets: list[str]) -> None:
        super().__init__()
        self.targets = targets
        for target in targets:
            self.add_module(target.replace(".", "_"), copy.deepcopy(model.get_submodule(target)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for target in self.targets:
            x = getattr(self, target.replace(".", "_"))(x)
        return x


def _split(model: nn.Module, sizes: list[int]) -> list[_Stage]:
    stages, start = [], 0
    for size in sizes:
        stages.append(_Stage(model, LEAVES[start : start + size]))
        start += size
    return stages


def _train(stages: list[_Stage], optimizers: list[torch.optim.Optimizer], steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=generator)
        y = torch.randint(0, 3, (5,), generator=generator)
        for opt in optimizers:
            opt.zero_grad()
        out = x
        for stage in stages:
            out = stage(out)
        nn.functional.cross_entropy(out, y).backward()
        for opt in optimizers:
            opt.step()


def _save(directory, step: int, stages: list[_Stage], optimizers, fingerprint) -> None:
    for rank, (stage, opt) in enumerate(zip(stages, optimizers)):
        params, buffers = ckpt.split_state(stage)
        state = ckpt.optimizer_state_by_name(opt, dict(stage.named_parameters()))
        ckpt.save_shard(directory, step, rank, params, buffers, state, extra={"rng": torch.get_rng_state(), "rank": rank})
    ckpt.finalize(directory, step, {"world_size": len(stages)}, fingerprint, expected_ranks=range(len(stages)), extra={"data_position": step})


def _resume(directory, sizes: list[int], make_opt) -> tuple[list[_Stage], list[torch.optim.Optimizer]]:
    stages = _split(_model(), sizes)  # fresh weights: everything must come from the checkpoint
    checkpoint = ckpt.load_checkpoint(directory, expected_fingerprint=ckpt.model_fingerprint(_model()))
    optimizers = []
    for stage in stages:
        checkpoint.load_into(stage)
        opt = make_opt(stage)
        named = dict(stage.named_parameters())
        ckpt.load_optimizer_state_by_name(opt, named, checkpoint.optimizer_state(named))
        optimizers.append(opt)
    return stages, optimizers


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
    ],
    ids=["sgd_momentum", "adamw"],
)
def test_resume_under_another_split_matches_uninterrupted_run(tmp_path, make_opt):
    fingerprint = ckpt.model_fingerprint(_model())
    # Uninterrupted reference: one stage, 6 steps.
    reference = _split(_model(), [5])
    ref_opts = [make_opt(s) for s in reference]
    _train(reference, ref_opts, 3, seed=1)
    _train(reference, ref_opts, 3, seed=2)

    # 2 stages for 3 steps, checkpoint, resume on 3 stages for 3 more.
    stages = _split(_model(), [2, 3])
    opts = [make_opt(s) for s in stages]
    _train(stages, opts, 3, seed=1)
    _save(tmp_path, 3, stages, opts, fingerprint)
    resumed, resumed_opts = _resume(tmp_path, [1, 2, 2], make_opt)
    _train(resumed, resumed_opts, 3, seed=2)

    expected = reference[0].state_dict()
    got = {k: v for stage in resumed for k, v in stage.state_dict().items()}
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_checkpoint_contents_and_extras(tmp_path):
    stages = _split(_model(), [2, 3])
    opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
    _train(stages, opts, 1, seed=0)
    _save(tmp_path, 7, stages, opts, ckpt.model_fingerprint(_model()))
    checkpoint = ckpt.load_checkpoint(tmp_path)
    assert checkpoint.step == 7
    assert checkpoint.ranks == [0, 1]
    assert checkpoint.param_names == sorted(["0_0.weight", "0_0.bias", "0_1.weight", "0_1.bias", "1_0.weight", "1_0.bias", "2.weight", "2.bias"])
    assert "0_1.running_mean" in checkpoint.buffer_names and "0_1.num_batches_tracked" in checkpoint.buffer_names
    assert checkpoint.buffers(["0_1.num_batches_tracked"])["0_1.num_batches_tracked"].item() == 1
    momentum = checkpoint.optimizer_state(["2.weight"])["2.weight"]["momentum_buffer"]
    assert momentum.shape == (3, 8) and momentum.abs().sum() > 0
    assert checkpoint.extra == {"data_position": 7}
    assert checkpoint.world == {"world_size": 2}
    assert checkpoint.shard_extra(1)["rank"] == 1
    assert torch.equal(checkpoint.shard_extra(0)["rng"], torch.get_rng_state())
    with pytest.raises(CheckpointError, match="rank 5 wrote no shard"):
        checkpoint.shard_extra(5)


def test_fingerprint_is_partition_independent():
    model = _model()
    stage_names = {k: v for s in _split(model, [2, 3]) for k, v in s.named_parameters()}
    assert ckpt.model_fingerprint(model) == ckpt.model_fingerprint(stage_names)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in model.named_parameters()}
    assert ckpt.model_fingerprint(shapes) == ckpt.model_fingerprint(model)
    assert ckpt.model_fingerprint(nn.Linear(6, 9)) != ckpt.model_fingerprint(nn.Linear(6, 8))
    assert ckpt.model_fingerprint(nn.Linear(6, 8).double()) != ckpt.model_fingerprint(nn.Linear(6, 8))


def test_partial_checkpoint_is_ignored_and_latest_stays(tmp_path):
    stages = _split(_model(), [2, 3])
    opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
    fingerprint = ckpt.model_fingerprint(_model())
    _save(tmp_path, 1, stages, opts, fingerprint)
    saved = {k: v.clone() for s in stages for k, v in s.state_dict().items()}
    _train(stages, opts, 1, seed=0)
    # Crash after rank 0 wrote its shard, before rank 1 and finalize.
    params, buffers = ckpt.split_state(stages[0])
    ckpt.save_shard(tmp_path, 2, 0, params, buffers)
    # ... and a temporary file left over from a write that was killed mid-way.
    (tmp_path / "step_2" / ".shard_1.safetensors.123.tmp").write_bytes(b"half a shard")
    assert ckpt.latest_step(tmp_path) == 1
    assert ckpt.list_checkpoints(tmp_path) == [1]
    checkpoint = ckpt.load_checkpoint(tmp_path)
    assert checkpoint.step == 1
    for name, value in checkpoint.params().items():
        assert torch.equal(value, saved[name])
    with pytest.raises(CheckpointError, match=r"step 2 was never committed \(committed steps: \[1\]\)"):
        ckpt.load_checkpoint(tmp_path, step=2)
    # finalize refuses the incomplete step and leaves `latest` alone.
    with pytest.raises(CheckpointError, match=r"shards of ranks \[1\] are missing"):
        ckpt.finalize(tmp_path, 2, {}, fingerprint, expected_ranks=[0, 1])
    with pytest.raises(CheckpointError, match="fingerprint .* a shard is missing"):
        ckpt.finalize(tmp_path, 2, {}, fingerprint)
    assert ckpt.latest_step(tmp_path) == 1
    # Without the pointer, the newest committed step is used.
    os.remove(tmp_path / "latest")
    assert ckpt.load_checkpoint(tmp_path).step == 1


def test_fingerprint_mismatch_is_an_error(tmp_path):
    stages = _split(_model(), [5])
    opts = [torch.optim.SGD(stages[0].parameters(), lr=0.1)]
    _save(tmp_path, 0, stages, opts, ckpt.model_fingerprint(_model()))
    other = ckpt.model_fingerprint(nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"manifest.json: checkpoint belongs to another model .*use a fresh checkpoint directory"):
        ckpt.load_checkpoint(tmp_path, expected_fingerprint=other)
    with pytest.raises(CheckpointError, match="expected " + other):
        ckpt.finalize(tmp_path, 0, {}, other)


def test_corrupt_or_missing_shard_is_an_error(tmp_path):
    stages = _split(_model(), [2, 3])
    opts = [torch.optim.SGD(s.parameters(), lr=0.1) for s in stages]
    _save(tmp_path, 4, stages, opts, ckpt.model_fingerprint(_model()))
    shard = ckpt.shard_path(tmp_path, 4, 1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    checkpoint = ckpt.load_checkpoint(tmp_path)
    checkpoint.params(["0_0.weight"])  # rank 0's shard is intact and read on its own
    with pytest.raises(CheckpointError, match=r"shard_1.safetensors: shard of rank 1 is corrupt"):
        checkpoint.params(["2.weight"])
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"shard_1.safetensors: shard of rank 1 is missing"):
        ckpt.load_checkpoint(tmp_path).params()
    (tmp_path / "step_4" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest.json: manifest is corrupt"):
        ckpt.load_checkpoint(tmp_path)


def test_missing_key_and_other_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        ckpt.load_checkpoint(tmp_path)
    stages = _split(_model(), [5])
    opts = [torch.optim.SGD(stages[0].parameters(), lr=0.1)]
    _save(tmp_path, 0, stages, opts, None)
    checkpoint = ckpt.load_checkpoint(tmp_path)
    assert checkpoint.fingerprint == ckpt.model_fingerprint(_model())
    with pytest.raises(CheckpointError, match=r"no parameter 'layer9_conv.weight' in checkpoint step 0"):
        checkpoint.params(["layer9_conv.weight"])
    with pytest.raises(CheckpointError, match="is not among this shard's parameters"):
        ckpt.save_shard(tmp_path, 1, 0, {"a": torch.zeros(1)}, optimizer_state={"b": {"step": 1}})
    # Two shards holding the same name: a replicated stage saved from both replicas.
    ckpt.save_shard(tmp_path, 2, 0, {"a": torch.zeros(1)})
    ckpt.save_shard(tmp_path, 2, 1, {"a": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="'a' is in the shards of rank 0 and rank 1"):
        ckpt.finalize(tmp_path, 2, {}, None)
    (tmp_path / "latest").write_text("garbage")
    with pytest.raises(CheckpointError, match="expected 'step_<N>'"):
        ckpt.load_checkpoint(tmp_path)


def test_manifest_lists_shards(tmp_path):
    stages = _split(_model(), [3, 2])
    opts = [torch.optim.SGD(s.parameters(), lr=0.1) for s in stages]
    _save(tmp_path, 2, stages, opts, None)
    manifest = json.loads((tmp_path / "step_2" / "manifest.json").read_text())
    assert [s["rank"] for s in manifest["shards"]] == [0, 1]
    assert manifest["shards"][1]["params"]["2.weight"] == [[3, 8], "float32"]
    assert (tmp_path / "latest").read_text().strip() == "step_2"


# ---- an interrupted checkpoint: only what was committed counts -----------------------------------------
def test_rewritten_step_is_made_of_its_writers_shards_not_the_directorys(tmp_path):
    fingerprint = ckpt.model_fingerprint(_model())
    _save(tmp_path, 1, _split(_model(), [5]), [torch.optim.SGD(_model().parameters(), lr=0.1)], fingerprint)
    # Step 3 written by 3 ranks, killed before its commit ...
    for rank, stage in enumerate(_split(_model(), [1, 2, 2])):
        ckpt.save_shard(tmp_path, 3, rank, *ckpt.split_state(stage))
    # ... then written again by 2 ranks after a resume on fewer workers: rank 2's shard is stale.
    stages = _split(_model(), [2, 3])
    _train(stages, [torch.optim.SGD(s.parameters(), lr=0.1) for s in stages], 1, seed=0)
    for rank, stage in enumerate(stages):
        ckpt.save_shard(tmp_path, 3, rank, *ckpt.split_state(stage))
    ckpt.finalize(tmp_path, 3, {}, fingerprint, expected_ranks=[0, 1])
    checkpoint = ckpt.load_checkpoint(tmp_path)
    assert checkpoint.step == 3 and checkpoint.ranks == [0, 1]
    for name, value in checkpoint.params().items():
        assert torch.equal(value, {k: v for s in stages for k, v in s.state_dict().items()}[name]), name
    with pytest.raises(CheckpointError, match=r"shards of ranks \[5\] are missing \(found ranks \[0, 1, 2\]\)"):
        ckpt.finalize(tmp_path, 3, {}, fingerprint, expected_ranks=[0, 5])


def test_a_manifest_past_latest_was_never_committed(tmp_path):
    fingerprint = ckpt.model_fingerprint(_model())
    stages = _split(_model(), [5])
    opts = [torch.optim.SGD(stages[0].parameters(), lr=0.1)]
    _save(tmp_path, 1, stages, opts, fingerprint)
    _save(tmp_path, 2, stages, opts, fingerprint)
    # Killed between step 4's manifest and the move of `latest`: step 4 does not count.
    _save(tmp_path, 4, stages, opts, fingerprint)
    (tmp_path / "latest").write_text("step_2\n")
    assert ckpt.list_checkpoints(tmp_path) == [1, 2]
    assert ckpt.latest_step(tmp_path) == 2 and ckpt.load_checkpoint(tmp_path).step == 2


def test_commit_fsyncs_the_directory_after_moving_latest(tmp_path, monkeypatch):
    synced = []

    def record(directory):
        synced.append((str(directory), (tmp_path / "latest").read_text().strip() if (tmp_path / "latest").exists() else None))

    monkeypatch.setattr(ckpt, "fsync_dir", record)
    ckpt.save_shard(tmp_path, 0, 0, {"a": torch.zeros(1)})
    ckpt.finalize(tmp_path, 0, {}, None)
    assert synced[-1] == (str(tmp_path), "step_0")  # the commit rename itself is made durable
    assert (str(tmp_path / "step_0"), None) in synced  # and the shard's and manifest's renames before it


def test_prune_removes_leftovers_and_keeps_the_last_k(tmp_path):
    from model_parallel.runtime.checkpoint.commit import prune

    fingerprint = ckpt.model_fingerprint(_model())
    stages = _split(_model(), [2, 3])
    opts = [torch.optim.SGD(s.parameters(), lr=0.1) for s in stages]
    for step in (1, 3, 5, 7):
        _save(tmp_path, step, stages, opts, fingerprint)
    # Leftovers: an uncommitted step, a step whose manifest is past `latest`, a stale shard of an
    # earlier attempt at a committed step, and temporary files of writes cut short.
    ckpt.save_shard(tmp_path, 9, 0, *ckpt.split_state(stages[0]))
    _save(tmp_path, 11, stages, opts, fingerprint)
    (tmp_path / "latest").write_text("step_7\n")
    ckpt.save_shard(tmp_path, 7, 2, {"junk": torch.zeros(1)})
    (tmp_path / "step_7" / ".shard_0.safetensors.abc.tmp").write_bytes(b"half")
    (tmp_path / ".latest.abc.tmp").write_text("step_")
    (tmp_path / "notes.txt").write_text("not ours")

    prune(tmp_path)  # at start: leftovers only, every committed step stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes.txt", "step_1", "step_3", "step_5", "step_7"]
    assert sorted(p.name for p in (tmp_path / "step_7").iterdir()) == [
        "manifest.json", "shard_0.json", "shard_0.safetensors", "shard_1.json", "shard_1.safetensors"]
    prune(tmp_path, keep=2)  # after a commit: the newest two
    assert ckpt.list_checkpoints(tmp_path) == [5, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes.txt", "step_5", "step_7"]
    assert ckpt.load_checkpoint(tmp_path).step == 7
    (tmp_path / "latest").write_text("garbage")
    assert prune(tmp_path, keep=1) == []  # a broken pointer: nothing is guessed away
    assert (tmp_path / "step_5").is_dir() and (tmp_path / "step_7").is_dir()


def test_keep_checkpoints_must_keep_one():
    from model_parallel.cli.worker import build_parser
    from model_parallel.cli.worker_job import make_config
    from model_parallel.errors import ModelParallelError
    from model_parallel.runtime.config import RunOptions

    assert make_config(build_parser().parse_args(["--keep_checkpoints", "5"]))[1].keep_checkpoints == 5
    assert RunOptions().keep_checkpoints == 3
    with pytest.raises(ModelParallelError, match=r"keep_checkpoints must be >= 1 \(the one to resume from\), got 0"):
        RunOptions(keep_checkpoints=0)
