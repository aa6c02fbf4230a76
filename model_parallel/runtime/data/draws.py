"""The random numbers a data read draws (a random augmentation: torchvision's RandomResizedCrop and
RandomHorizontalFlip draw from torch's generator, timm's transforms from Python's `random`, albumentations from
numpy's), keyed, and the one lock on the process's CPU generator.

    with keyed_draws(stream_seed(seed, step)):   # sources.MapData: step s's samples, read and collated
        samples = [dataset[i] for i in indices]

Each process reads the data itself (stage 0 the inputs, the last stage the targets, the single-process oracle all
of it, a resume from its step on), so a draw from wherever the process's generators happen to stand gave step s
other crops in each: a pipeline did not equal single-process training, a resume did not replay the run, and the
draws moved the process's own random stream. Under `keyed_draws` torch's CPU generator, `random` and numpy's global
generator are seeded from the key and put back after, so step s draws the same augmentation everywhere.

`GENERATOR_LOCK`: the data is read on a background thread (`prefetch.Prefetcher`) while stage 0's forward runs on
its CPU generator seeded by (seed, step, stage, microbatch) (`step/rng.seeded_forward`): without one lock, an
augmentation drew from the forward's seeded state (the dropout masks then depended on thread timing) and a restore
of one overwrote the other's state. Both hold it (a read waits for a forward in progress, and the reverse).
"""
from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

GENERATOR_LOCK = threading.RLock()  # held while anything seeds or draws from the process's CPU generator on purpose


@contextmanager
def keyed_draws(seed: int) -> Iterator[None]:
    """Run the body with torch's CPU generator, Python's `random` and numpy's global generator seeded from `seed`
    (under GENERATOR_LOCK); each is put back after, so the process's own random stream goes on untouched."""
    import numpy as np

    with GENERATOR_LOCK:
        cpu, python, numpy = torch.default_generator.get_state(), random.getstate(), np.random.get_state()
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            torch.default_generator.set_state(cpu)
            random.setstate(python)
            np.random.set_state(numpy)
