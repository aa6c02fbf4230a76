"""An iterable source must replay: two fresh passes begin with the same items.

Each process reads the data itself (stage 0 the inputs, the last stage the targets: runtime/data/sources.py), so an
iterable whose order is random and not keyed by the run's seed (a DataLoader's SubsetRandomSampler,
WeightedRandomSampler or random batch_sampler, an IterableDataset that shuffles as it goes) would pair one sample's
inputs with another sample's target, and training would go on with no error; a resume could not replay it either.
`check_replays` reads one step's items of two fresh passes, once per source, and refuses them if they differ, or if
collating them twice gives different targets (a collate_fn that masks at random).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch

from model_parallel.errors import DataError

# Why a collate_fn (or dataset) that draws targets at random cannot train here, and the fix: said for iterables
# (`check_replays`) and map-style data (sources.read_targets) alike.
RANDOM_TARGETS = ("draws them at random, as random masking does (DataCollatorForLanguageModeling): each process "
                  "collates for itself (stage 0 the inputs, the last stage the targets), so the targets would come from "
                  "another draw than the inputs; make them a function of the samples (seed any randomness from the "
                  "sample's index), give a map-style Dataset (its steps are collated under draws keyed by (seed, step): "
                  "data/draws.py), or an object with batch(step) that seeds its draws by step")


def check_replays(iterable: Iterable[Any], items: int, name: str,
                  target_of: Optional[Callable[[list[Any]], Any]] = None) -> None:
    """Refuse `iterable` (a `DataError` naming it and the fixes) when two fresh passes differ in their first `items`,
    or when `target_of` (collate, then the target) gives the same items different targets: a random collate_fn."""
    passes = []
    for _ in range(2):
        read, iterator = [], iter(iterable)
        for _ in range(items):
            try:
                read.append(next(iterator))
            except StopIteration:  # too short: the source's own read says so
                break
        passes.append(read)
    if not same(passes[0], passes[1]):
        raise DataError(f"{name}: two passes over it begin with different samples, so its order is random and not the "
                        "run's: each process reads the data itself (stage 0 the inputs, the last stage the targets), "
                        "and they would pair one sample's inputs with another's target (a resume could not replay it "
                        "either). A DataLoader's own sampler (SubsetRandomSampler, WeightedRandomSampler, a "
                        "batch_sampler, a RandomSampler with replacement or num_samples) draws a fresh order in every "
                        "process: give DataLoader(dataset, batch_size, shuffle=True) over a map-style dataset (shuffled per epoch under the run's seed), the dataset "
                        "itself, or an object with batch(step) -> (inputs, target) for an order of your own; an "
                        "iterable must yield the same items in the same order on every pass (a random augmentation inside an iterable "
                        "dataset draws other items on every pass too: give the samples as a map-style Dataset, whose "
                        "reads draw keyed by (seed, step), data/draws.py)")
    if target_of is not None and passes[0] and not same(target_of(passes[0]), target_of(passes[1])):
        raise DataError(f"{name}: two collations of the same samples hold different targets, so its collate_fn "
                        f"{RANDOM_TARGETS}")


def same(a: Any, b: Any) -> bool:
    """Whether two samples (or batches) are equal: tensors by shape, dtype and values; containers member by member."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys()
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # an == that is no truth value (an array): not compared, not refused
        return True
