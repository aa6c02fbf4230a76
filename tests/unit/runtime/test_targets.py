"""The last stage's read of the data (issue #35): `read_targets` equals `batch(step)[1]` for every source, through
the cheap `targets(step)` where one exists (ImageFolder labels, token-file windows), prefetched like batches, and
split into microbatch targets by the rule that splits stage 0's inputs."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from model_parallel.errors import DataError, ModelParallelError
from model_parallel.runtime.data.batches import ImageFolderData, SyntheticData, minibatch_parts, split_targets
from model_parallel.runtime.data.named_data import NamedSyntheticData
from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.data.sources import MapData, read_targets, token_data
from model_parallel.runtime.observe.tracing import Tracer
from support.images import image_folder


def test_split_targets_matches_the_microbatch_split_also_when_uneven():
    inputs, target = {"input_ids": torch.arange(22).view(11, 2)}, torch.arange(11)
    parts = split_targets(target, 4)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
    assert all(torch.equal(p, t) for p, (_, t) in zip(parts, minibatch_parts(inputs, target, 4)))
    with pytest.raises(ModelParallelError, match="a minibatch of 3 samples cannot be split into 4 microbatches"):
        split_targets(torch.arange(3), 4)


@pytest.mark.parametrize("data", [
    SyntheticData(4, (3,), seed=2),
    SyntheticData(4, (5,), num_classes=50, kind="tokens", seed=2),
    NamedSyntheticData(4, (("input_ids", (6,), "int64"), ("attention_mask", (6,), "int64")), 30, seed=1),
    MapData([(torch.randn(3), i % 5) for i in range(13)], batch_size=4, seed=3),
], ids=["synthetic", "tokens", "named", "map"])
def test_read_targets_is_the_batchs_target(data):
    for step in (0, 1, 5):
        assert torch.equal(read_targets(data, step), data.batch(step)[1]), step


def test_token_file_targets_slice_only_the_shifted_windows(tmp_path: Path):
    path = tmp_path / "train.bin"
    np.arange(200, dtype=np.uint16).tofile(path)
    data = token_data(str(path), seq_len=8, batch_size=3, seed=4)
    for step in (0, 3, 7, 8):  # 24 windows, 8 steps an epoch: into the second epoch's order
        target = data.targets(step)
        assert torch.equal(target, data.batch(step)[1]) and target.dtype == torch.int64, step
    assert data.dataset.target(2).tolist() == list(range(17, 25))  # window 2 = ids[16:24], shifted by one


def test_image_folder_targets_are_the_labels_without_decoding_an_image(tmp_path: Path, monkeypatch):
    data = ImageFolderData(image_folder(tmp_path / "images"), batch_size=3, image_size=8, seed=1)
    want = [data.batch(step)[1] for step in range(4)]  # 8 images: step 2 wraps into the second epoch
    monkeypatch.setattr(data, "_sample", lambda index: pytest.fail(f"image {index} decoded for its label"))
    for step, labels in enumerate(want):
        assert torch.equal(data.targets(step), labels), step


class _Recording:
    """Synthetic data that records which part of which step was read, on which thread."""

    batch_size = 2

    def __init__(self) -> None:
        self.inner, self.calls = SyntheticData(2, (3,), seed=5), []
        self.asked_for_step_1 = threading.Event()

    def batch(self, step: int):
        self.calls.append(("batch", step))
        return self.inner.batch(step)

    def targets(self, step: int) -> torch.Tensor:
        self.calls.append(("targets", step))
        if step == 1:
            self.asked_for_step_1.set()
        return self.inner.batch(step)[1]


def test_prefetcher_prepares_targets_ahead_and_checks_the_sources_own_once():
    data, tracer = _Recording(), Tracer(0)
    with Prefetcher(data, depth=1, tracer=tracer) as ahead:
        assert torch.equal(ahead.targets(0), data.inner.batch(0)[1])
        assert data.asked_for_step_1.wait(timeout=30), f"step 1's targets were never prepared ahead ({data.calls})"
        assert torch.equal(read_targets(ahead, 1), data.inner.batch(1)[1])  # the prefetcher's own read
    # Only targets are read ahead; the source's own targets() is checked once against batch(0).
    assert data.calls[:3] == [("targets", 0), ("batch", 0), ("targets", 1)]
    assert [c for c in data.calls if c[0] == "batch"] == [("batch", 0)]
    prepared = [(e["args"]["step"], e["args"].get("part")) for e in tracer.events if e["name"] == "prepare"]
    assert (0, "targets") in prepared


def test_prefetcher_targets_fall_back_to_the_batch_of_a_source_without_them():
    data = SyntheticData(4, (3,), seed=6)
    with Prefetcher(data, depth=2) as ahead:
        for step in (0, 1, 4, 2):
            assert torch.equal(ahead.targets(step), data.batch(step)[1]), step


class _WrongTargets(_Recording):
    """targets(step) of the next step: a source whose cheap read is wrong."""

    def targets(self, step: int) -> torch.Tensor:
        return self.inner.batch(step + 1)[1]


def test_a_source_whose_targets_differ_from_its_batch_is_refused_on_the_first_read():
    data = _WrongTargets()
    with pytest.raises(DataError, match=r"_WrongTargets.targets\(0\) differs from batch\(0\)'s target \(other values\); "
                                        r"the last stage would pair inputs with the wrong targets"):
        read_targets(data, 0, verify=True)
    assert torch.equal(read_targets(data, 0), data.inner.batch(1)[1])  # unchecked after the first read
    with Prefetcher(_WrongTargets(), depth=1) as ahead, pytest.raises(DataError, match="step 0: .*differs from batch"):
        ahead.targets(0)


def test_a_source_whose_targets_has_another_shape_is_named_with_both_shapes():
    class Short(_Recording):
        def targets(self, step: int) -> torch.Tensor:
            return self.inner.batch(step)[1][:1]

    with pytest.raises(DataError, match=r"target \(\(1,\) torch.int64 where the batch has \(2,\) torch.int64\)"):
        read_targets(Short(), 3, verify=True)


def test_a_batch_object_whose_batch_is_not_a_function_of_step_is_refused_at_the_first_read():
    """Stage 0 and the last stage each call batch(step) themselves: a source drawing from the process's generator
    (or a stream that ignores `step`) paired one draw's inputs with another's targets and trained on, exit 0."""
    from model_parallel.runtime.data.sources import as_source

    class Drawn:
        def batch(self, step: int):
            return (torch.randn(4, 3),), torch.randint(0, 5, (4,))  # the global generator, not keyed by step

    with pytest.raises(DataError, match=r"Drawn: two calls of batch\(0\) returned different targets; .* must be a "
                                        r"function of step: seed any randomness from step"):
        read_targets(as_source(Drawn(), 4, 0), 0, verify=True)

    class Keyed:
        def batch(self, step: int):
            g = torch.Generator().manual_seed(step)
            return (torch.randn(4, 3, generator=g),), torch.randint(0, 5, (4,), generator=g)

    keyed = as_source(Keyed(), 4, 0)
    assert torch.equal(read_targets(keyed, 0, verify=True), Keyed().batch(0)[1])
    # Only the first read is checked (`verify`): later ones read once.
    assert read_targets(as_source(Drawn(), 4, 0), 1).shape == (4,)
