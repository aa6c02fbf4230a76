"""The random numbers a stage's forward draws (dropout, DropPath), keyed by (seed, step, stage, microbatch).

Each forward runs on its device's default generator seeded from that key, and the generator's state is put back
after it, so the process's own random stream (a user's script around `PipelineTrainer`) is untouched. So a run is
reproducible under `--seed`, a resume draws from step N on the masks the uninterrupted run would have drawn,
and the single-process oracle (`trainer.SingleProcessRunner`, keyed alike) trains the same masks, replicas and
ranks included: the key has no rank in it. What moves a stage's masks: a live switch (other stage contents under
a stage id). Recomputation (`torch.utils.checkpoint`) replays the forward's state, so its masks too.
A generator-level seed costs ~3 us (`torch.manual_seed` seeds every device: ~180 us).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from model_parallel.runtime.data.draws import GENERATOR_LOCK

_MIX = 1_000_003  # a prime: (seed, step, stage, microbatch) -> one 63-bit seed, distinct for realistic keys
_BITS = (1 << 63) - 1


def forward_seed(seed: int, step: int, stage: int, microbatch: int) -> int:
    return (((seed * _MIX + step) * _MIX + stage) * _MIX + microbatch) & _BITS


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


@contextmanager
def seeded_forward(device: torch.device, seed: int, step: int, stage: int, microbatch: int) -> Iterator[None]:
    """Run a stage's forward of `microbatch` at `step` on the generator seeded from that key; restore it after."""
    generator = _generator(device)
    # On the CPU, not while the data is read on the prefetch thread from the same generator (data/draws.py).
    with GENERATOR_LOCK if generator is torch.default_generator else nullcontext():
        state = generator.get_state()
        generator.manual_seed(forward_seed(seed, step, stage, microbatch))
        try:
            yield
        finally:
            generator.set_state(state)
