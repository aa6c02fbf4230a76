"""A random augmentation in a map-style dataset draws step s's own numbers (runtime/data/draws.py): each process
reads the data itself, and before, step s's crops and flips came from wherever that process's generators stood (a
pipeline's stage 0 drew other augmentations than the single-process oracle, a resume other than the run), and a
read on the prefetch thread could draw from stage 0's forward's seeded generator (dropout masks then depended on
thread timing)."""
from __future__ import annotations

import random
import threading

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from model_parallel.runtime.data.draws import GENERATOR_LOCK
from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.data.sources import as_source
from model_parallel.runtime.step.rng import seeded_forward


class Augmented(Dataset):
    """Eight samples, each randomly flipped and jittered from torch's, Python's and numpy's generators
    (torchvision's RandomHorizontalFlip, timm's and albumentations' transforms draw from these)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        x = torch.arange(4.0) + 10 * i
        if torch.rand(1) < 0.5:
            x = x.flip(0)
        x = x + random.random() + float(np.random.rand())
        self.lock_held = GENERATOR_LOCK._is_owned()  # type: ignore[attr-defined]
        return x, i % 2


def _process_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def test_a_step_reads_the_same_augmentation_wherever_the_process_generators_stand():
    source = as_source(DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2), 4, seed=3)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    first = [source.batch(step)[0][0] for step in range(3)]  # inputs (x,)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    fresh = as_source(DataLoader(Augmented(), batch_size=4, shuffle=True), 4, seed=3)
    # A resume at step 2 and another process (other generator states, other reads before) read step 2 alike.
    assert torch.equal(fresh.batch(2)[0][0], first[2])
    assert torch.equal(source.batch(1)[0][0], first[1])
    assert not torch.equal(first[0], first[1])  # the steps' draws differ (keyed, not fixed)


def test_a_read_leaves_the_process_random_stream_untouched():
    source = as_source(Augmented(), 4, seed=0)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    before = _process_states()
    source.batch(0)
    after = _process_states()
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and np.array_equal(before[2], after[2])


def test_a_prefetched_read_never_runs_during_a_seeded_cpu_forward():
    dataset = Augmented()
    with Prefetcher(as_source(dataset, 4, seed=0), depth=1) as data:
        data.batch(0)
        assert dataset.lock_held  # the background read held the generator lock
    seen = []
    with seeded_forward(torch.device("cpu"), 0, 0, 0, 0):
        other = threading.Thread(target=lambda: seen.append(GENERATOR_LOCK.acquire(blocking=False)))
        other.start()
        other.join()
    assert seen == [False]  # a data read on another thread waits for the forward's end
