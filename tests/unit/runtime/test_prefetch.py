"""Batches prepared ahead (runtime/data/prefetch.py): same batches as the dataset, errors naming the step,
clean shutdown, and, in a real 2-rank run on an ImageFolder, preparation overlapping stage 0's compute."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from model_parallel.errors import DataError
from model_parallel.runtime.data.batches import SyntheticData, make_dataset
from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.observe.tracing import Tracer
from support.images import image_folder


class _Recording:
    """A dataset that records which steps were prepared and fails at one step."""

    batch_size = 2

    def __init__(self, fail_at: int = -1) -> None:
        self.inner, self.fail_at, self.asked = SyntheticData(2, (3,), seed=5), fail_at, []
        self.asked_for_step_1 = threading.Event()

    def batch(self, step: int):
        self.asked.append(step)
        if step == 1:
            self.asked_for_step_1.set()
        if step == self.fail_at:
            raise OSError("disk went away")
        return self.inner.batch(step)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetch")]


def test_prefetcher_returns_the_datasets_batches_in_any_order():
    data = SyntheticData(4, (3,), seed=1)
    with Prefetcher(data, depth=2) as ahead:
        for step in (0, 1, 2, 7, 8, 3, 3, 0):  # in order, a jump (resume), a repeat, back to the start
            (x,), y = ahead.batch(step)
            (want_x,), want_y = data.batch(step)
            assert torch.equal(x, want_x) and torch.equal(y, want_y), step
        assert ahead.batch_size == 4 and ahead.num_classes == 10  # the dataset's attributes pass through


def test_prefetcher_prepares_the_next_steps_ahead():
    data = _Recording()
    with Prefetcher(data, depth=2) as ahead:
        ahead.batch(0)
        # Nobody asks for step 1: the prefetcher's own thread must start preparing it.
        assert data.asked_for_step_1.wait(timeout=30), f"step 1 was never prepared ahead (asked: {data.asked})"
        assert data.asked[:2] == [0, 1]


def test_prefetcher_error_names_the_step_and_close_stops_the_thread():
    ahead = Prefetcher(_Recording(fail_at=3), depth=1)
    for step in range(3):
        ahead.batch(step)
    assert _prefetch_threads()
    with pytest.raises(DataError, match=r"step 3: preparing its batch failed in _Recording: OSError: disk went away"):
        ahead.batch(3)
    ahead.close()
    assert not _prefetch_threads()
    with pytest.raises(DataError, match="prefetch depth must be >= 1"):
        Prefetcher(SyntheticData(2, (3,)), depth=0)


def test_prefetcher_records_prepare_and_wait_spans():
    tracer = Tracer(0)
    with Prefetcher(SyntheticData(2, (3,)), depth=1, tracer=tracer) as ahead:
        ahead.batch(0)
        ahead.batch(1)
    names = [(e["name"], e["args"]["step"]) for e in tracer.events]
    assert ("prepare", 0) in names and ("prepare", 1) in names and ("data wait", 1) in names
    assert {e["cat"] for e in tracer.events} == {"data", "data wait"}


def test_make_dataset_prefetches_image_folders_only(tmp_path: Path):
    image_folder(tmp_path / "images")
    assert isinstance(make_dataset(str(tmp_path / "images"), 4, 0, shape=(3, 32, 32), num_classes=2), Prefetcher)
    assert isinstance(make_dataset("synthetic", 4, 0, shape=(3,), num_classes=2), SyntheticData)
    assert isinstance(make_dataset("synthetic", 4, 0, shape=(3,), num_classes=2, prefetch=1), Prefetcher)


