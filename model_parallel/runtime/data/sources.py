"""A user's data as minibatches keyed by step: a map-style Dataset, an iterable, a DataLoader, a token file.

    data = as_source(my_dataset, batch_size=32, seed=0, collate_fn=my_collate)   # -> .batch(step)
    inputs, target = data.batch(step)

Every source here answers `batch(step) -> (inputs, target)` (the protocol of `runtime.data.batches`) with the
same minibatch for the same (seed, step) on every process and after a resume, so a pipeline run equals
single-process training and a resume mid-epoch continues exactly where the run stopped:

    map-style Dataset   epoch e = steps [e*S, (e+1)*S), S = len // batch_size; its order is
                        torch's RandomSampler under a generator seeded by (seed, e); BatchSampler groups it
    token file          (nanoGPT's train.bin: a flat uint16/uint32 array) -> a map-style Dataset of
                        windows (ids[i*T : i*T+T], ids[i*T+1 : i*T+T+1]; data/tokens.py), then as above
    iterable            read in order, batch_size samples per step, epochs concatenated; any step is
                        reached by iterating afresh and skipping (so it must iterate the same way twice: data/replay.py)
    DataLoader          shuffled or sequential over a map-style dataset: its dataset, batch size, collate
                        function and drop_last, in the order above; otherwise its batches, in order, as an iterable

A collated batch is `(inputs, target)` (inputs a tensor, a tuple of tensors or a dict of keyword
inputs) or a dict holding "labels" (the target; the other keys are the inputs). A dict batch is Hugging Face's
form, and with `causal_labels` (a causal-LM head trained with its default loss: api/hf_loss.py) its "labels" mean
what they mean to the model's own loss: position t is scored against labels[t + 1] (`shift_causal_labels`).

The last stage reads only targets (`read_targets`): a source may answer `targets(step)`, which must equal
`batch(step)[1]` (the token file slices the shifted windows only, a torchvision classification dataset lists its
labels: listed_labels.py); other sources are read whole (a map-style dataset's items hold the target beside the inputs).
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import default_collate

from model_parallel.errors import DataError
from model_parallel.runtime.data.draws import keyed_draws
from model_parallel.runtime.data.listed_labels import listed_labels
from model_parallel.runtime.data.pairs import BATCH_FORMS, Batch, as_pair, describe
from model_parallel.runtime.data.replay import RANDOM_TARGETS, check_replays, same
from model_parallel.runtime.data.tokens import TokenWindows

logger = logging.getLogger(__name__)

def stream_seed(seed: int, key: int) -> int:
    """The seed of stream (seed, key): a step's synthetic batch or its samples' augmentation, or (key = -1 - epoch)
    an epoch's shuffle. Distinct streams per (seed, key) without correlations between neighbouring keys."""
    return (seed * 1_000_003 + key * 7_919 + 17) % (2**63 - 1)


def seeded_generator(seed: int, key: int) -> torch.Generator:
    """A generator for (seed, key) (`stream_seed`)."""
    return torch.Generator().manual_seed(stream_seed(seed, key))


@dataclass
class MapData:
    """A map-style dataset (`len`, `[i]`): shuffled per epoch by RandomSampler under the seed (seed, epoch)."""

    dataset: Any
    batch_size: int
    collate_fn: Callable[[list[Any]], Any] = default_collate
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True  # every step a full minibatch (a short last one would change the microbatching)
    name: str = "dataset"  # how error messages and the training record name the source
    causal_labels: bool = False  # a dict batch's "labels" are Hugging Face's causal-LM labels (`as_pair`)
    _epoch: tuple[int, list[list[int]]] = field(default=(-1, []), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise DataError(f"{self.name}: batch size must be >= 1, got {self.batch_size}")
        size = len(self.dataset)
        if size < self.batch_size:
            raise DataError(f"{self.name}: {size} sample(s) cannot fill one minibatch of {self.batch_size}; "
                            "lower the batch size or give more data")
        self.steps_per_epoch = size // self.batch_size if self.drop_last else -(-size // self.batch_size)

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._epoch[0] != epoch:  # one epoch's order kept (a resume or an evaluation asks for another)
            sampler = (RandomSampler(self.dataset, generator=seeded_generator(self.seed, -1 - epoch)) if self.shuffle
                       else SequentialSampler(self.dataset))
            self._epoch = (epoch, list(BatchSampler(sampler, self.batch_size, self.drop_last)))
        return self._epoch[1]

    def position(self, step: int) -> dict[str, int]:
        """Where `step` reads: its epoch and the minibatch within that epoch."""
        return {"epoch": step // self.steps_per_epoch, "batch": step % self.steps_per_epoch}

    def batch(self, step: int) -> Batch:
        where = self.position(step)
        indices = self._batches(where["epoch"])[where["batch"]]
        # A random augmentation (RandomResizedCrop, RandomHorizontalFlip) draws step s's own numbers in every process
        # that reads it, and after a resume (data/draws.py).
        with keyed_draws(stream_seed(self.seed, step)):
            try:
                samples = [self.dataset[i] for i in indices]
            except (IndexError, KeyError) as error:
                raise DataError(f"{self.name}: reading sample of step {step} failed ({type(error).__name__}: {error}); "
                                "a map-style dataset must answer every index in range(len(dataset))") from None
            batch = self.collate_fn(samples)
        return as_pair(batch, f"{self.name} step {step}", self.causal_labels)

    def targets(self, step: int) -> torch.Tensor:
        """`batch(step)[1]`; with the default collate, no input read for a token file (the shifted windows only) or a
        torchvision classification dataset (its label list, `listed_labels`)."""
        if self.collate_fn is default_collate:
            where = self.position(step)
            indices = self._batches(where["epoch"])[where["batch"]]
            if isinstance(self.dataset, TokenWindows):
                return torch.stack([self.dataset.target(i) for i in indices])
            labels = None if self.causal_labels else listed_labels(self.dataset)
            if labels is not None:
                return default_collate([labels(i) for i in indices])
        return self.batch(step)[1]


class IterableData:
    """An iterable read in order (`batched`: each item is already a minibatch, e.g. a DataLoader's);
    any step is reached by iterating afresh and skipping, so a resume continues exactly."""

    def __init__(self, iterable: Iterable[Any], batch_size: int, collate_fn: Callable[[list[Any]], Any] = default_collate,
                 batched: bool = False, name: str = "iterable", causal_labels: bool = False) -> None:
        if iter(iterable) is iterable:
            raise DataError(f"{name}: {type(iterable).__name__} is a one-shot iterator, which cannot be replayed for a "
                            "resume or read again next epoch; give a re-iterable (a list, an IterableDataset, a DataLoader)")
        self.iterable, self.batch_size, self.collate_fn, self.batched, self.name = iterable, batch_size, collate_fn, batched, name
        self.causal_labels = causal_labels
        self.per_step = 1 if batched else batch_size  # items consumed per step
        self.epoch_items: Optional[int] = None  # items per pass, known after the first pass
        self._replays = False  # two passes were seen to begin alike (`check_replays`)
        self._iter: Any = None
        self._next = 0  # the index, over concatenated passes, of the item `_iter` yields next

    def _restart(self, item: int) -> None:
        # Only whole passes can be skipped without reading them.
        passes = item // self.epoch_items if self.epoch_items else 0
        self._iter, self._next = iter(self.iterable), passes * (self.epoch_items or 0)

    def _item(self) -> Any:
        try:
            value = next(self._iter)
        except StopIteration:
            if self._next == 0 or (self.epoch_items is not None and self._next % self.epoch_items):
                raise DataError(f"{self.name}: it yielded {'nothing' if self._next == 0 else 'a different count this pass'}; "
                                "an iterable must yield the same items on every pass") from None
            self.epoch_items = self.epoch_items or self._next
            self._iter = iter(self.iterable)
            value = next(self._iter, None)
        self._next += 1
        return value

    def opening(self) -> Any:
        """The first minibatch of a fresh pass as collated (the data's fingerprint: checkpoint/data_identity.py),
        read without moving this source's own position."""
        items = list(itertools.islice(iter(self.iterable), self.per_step))
        if not items:
            return None
        return items[0] if self.batched else self.collate_fn(items)

    def position(self, step: int) -> dict[str, int]:
        item = step * self.per_step
        if not self.epoch_items:
            return {"item": item}
        return {"item": item, "epoch": item // self.epoch_items, "in_epoch": item % self.epoch_items}

    def batch(self, step: int) -> Batch:
        if not self._replays:  # once: a random order would pair inputs with other samples' targets (data/replay.py)
            check_replays(self.iterable, self.per_step, self.name, None if self.batched else
                          lambda items: as_pair(self.collate_fn(items), self.name, self.causal_labels)[1])
            self._replays = True
        first = step * self.per_step
        if self._iter is None or first < self._next:
            self._restart(first)
        while self._next < first:
            self._item()
        items = [self._item() for _ in range(self.per_step)]
        inputs, target = as_pair(items[0] if self.batched else self.collate_fn(items), f"{self.name} step {step}",
                                 self.causal_labels)
        if self.batched and len(target) != self.batch_size:  # a batch_sampler's, or a last short batch
            raise DataError(f"{self.name} step {step}: a batch of {len(target)} sample(s) where the run's batch size is "
                            f"{self.batch_size}; every step trains a full minibatch: give batches of {self.batch_size} "
                            "(drop_last=True)")
        return inputs, target


def token_data(path: str, seq_len: int, batch_size: int, seed: int = 0, dtype: str = "uint16",
               vocab: Optional[int] = None) -> MapData:
    """`--data tokens:PATH --seq_len N`: inputs (B, N) and next-token targets (B, N), shuffled windows per epoch."""
    return MapData(TokenWindows(path, seq_len, dtype, vocab), batch_size, seed=seed, name=f"tokens:{path}")


def from_loader(loader: DataLoader, seed: int, batch_size: int, causal_labels: bool = False) -> Any:
    """A DataLoader as a step-keyed source (see the module docstring for which order it keeps). Its batch size must
    be the run's: a step trains `batch_size` samples in `num_microbatches` equal parts, and a checkpoint records it."""
    if loader.batch_size is not None and loader.batch_size != batch_size:
        raise DataError(f"DataLoader: its batch_size {loader.batch_size} differs from the run's batch size {batch_size} "
                        f"(TrainConfig.batch_size / --batch_size); make them equal")
    sampler = loader.sampler
    map_style = not isinstance(loader.dataset, IterableDataset)
    # A RandomSampler with replacement or its own num_samples draws another epoch than a permutation of the dataset:
    # it was read as one (num_samples=16 of 40 trained 5 steps an epoch), so it is left to the iterable's check below.
    whole = isinstance(sampler, SequentialSampler) or (
        isinstance(sampler, RandomSampler) and not sampler.replacement and map_style
        and sampler.num_samples == len(loader.dataset))  # type: ignore[arg-type]  # map-style: it has a length
    if map_style and loader.batch_size is not None and whole:
        # Its own shuffle draws a fresh seed per pass: ours is keyed by (seed, epoch), so a resume replays it.
        # Every step a full minibatch: a short last one would split into unequal microbatches (config.py refuses those).
        size = len(loader.dataset)  # type: ignore[arg-type]  # map-style: it has a length
        if not loader.drop_last and (left := size % batch_size):
            logger.warning("DataLoader: %d sample(s) of %d are left out of every epoch (drop_last=False, but a step is "
                           "always a full minibatch of %d)", left, size, batch_size)
        return MapData(loader.dataset, batch_size, loader.collate_fn, seed, shuffle=isinstance(sampler, RandomSampler),
                       name="DataLoader", causal_labels=causal_labels)
    return IterableData(loader, batch_size, batched=True, name="DataLoader", causal_labels=causal_labels)


class BatchSource:
    """A user's object with `batch(step)`, each batch checked and put in the runtime's form (`as_pair`): a bare
    tensor of inputs is the model's one input, a dict holding "labels" is Hugging Face's batch. Anything else is
    a `DataError` naming the source, the step, what it returned and the forms that work, instead of a traceback
    from deep in a stage (a tensor iterated into positional arguments). A few isinstance checks a step. Other
    attributes (`targets`, `position`, `batch_size`, ...) are the source's own."""

    def __init__(self, source: Any, causal_labels: bool = False, batch_size: Optional[int] = None) -> None:
        self.source, self.causal_labels, self.expected_size = source, causal_labels, batch_size
        self.name = source.name if isinstance(getattr(source, "name", None), str) else type(source).__name__

    def __getattr__(self, name: str) -> Any:
        if name == "source" or name.startswith("__"):  # not set yet (unpickling, copying)
            raise AttributeError(name)
        return getattr(self.source, name)

    def batch(self, step: int) -> Batch:
        value = self.source.batch(step)
        if isinstance(value, (tuple, list)):
            if len(value) != 2:
                self._refuse(step, value, f"a {type(value).__name__} of {len(value)} items, not (inputs, target)")
        elif not isinstance(value, Mapping):
            self._refuse(step, value, "not (inputs, target) nor a dict")
        elif "labels" not in value:
            self._refuse(step, value, f"a dict batch needs a 'labels' entry (the target), found keys {sorted(value)}")
        target: Any  # as_pair's type says a tensor; a user's source can return anything there
        inputs, target = as_pair(value, f"{self.name}.batch({step})", self.causal_labels)  # the one normal form
        if not isinstance(target, torch.Tensor):
            self._refuse(step, value, f"the target is a {type(target).__name__}, not a tensor")
        tensors = [x for x in (inputs.values() if isinstance(inputs, dict) else inputs) if isinstance(x, torch.Tensor)]
        if not tensors:
            self._refuse(step, value, "the inputs hold no tensor")
        # As a DataLoader of another batch size is refused (from_loader): the step would train other than the run's
        # batch (microbatches of unequal sizes, each weighted 1/m), priced and recorded as the run's. (Inputs and a
        # target of different sizes are named by the microbatch split: runtime/data/batches.py.)
        sizes = {int(x.shape[0]) for x in tensors + [target] if x.dim()}
        if self.expected_size is not None and len(sizes) == 1 and sizes != {self.expected_size}:
            raise DataError(f"{self.name}.batch({step}): a minibatch of {target.shape[0]} sample(s) where the run's batch "
                            f"size is {self.expected_size} (TrainConfig.batch_size / --batch_size); every step trains "
                            f"the run's batch size in equal microbatches: return {self.expected_size} samples a step, "
                            f"or give batch_size={target.shape[0]}")
        return inputs, target

    def _refuse(self, step: int, value: Any, why: str) -> NoReturn:
        raise DataError(f"{self.name}.batch({step}): {why}: it returned {describe(value)}; {BATCH_FORMS}")


def as_source(data: Any, batch_size: int, seed: int, collate_fn: Optional[Callable[[list[Any]], Any]] = None,
              causal_labels: bool = False) -> Any:
    """`data` as a step-keyed source: anything with `batch(step)` checked batch by batch (`BatchSource`), else
    the matching adapter. `causal_labels`: dict batches carry Hugging Face causal-LM labels (`as_pair`)."""
    # This package's own sources (synthetic, image folders, the adapters, a BatchSource) give the runtime's form
    # already, and are recognised by type downstream (the checkpoint's data record): not wrapped. One that wraps a
    # source (a Prefetcher) has the source it wraps made a source here, so a user's batches are checked inside it.
    if type(data).__module__.startswith("model_parallel."):
        if callable(getattr(type(data), "replace_source", None)):
            checked = as_source(data.dataset, batch_size, seed, collate_fn, causal_labels)
            if checked is not data.dataset:  # not yet (a source of this package, or checked by an earlier call)
                data.replace_source(checked)
        return data
    if hasattr(data, "batch") and callable(data.batch):
        return BatchSource(data, causal_labels, batch_size)
    collate = collate_fn or default_collate
    if isinstance(data, DataLoader):
        return from_loader(data, seed, batch_size, causal_labels)
    if isinstance(data, IterableDataset) or not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        if not isinstance(data, Iterable):
            raise DataError(f"data of type {type(data).__name__} is none of: a map-style Dataset, an iterable, a "
                            "DataLoader, or an object with batch(step) -> (inputs, target)")
        return IterableData(data, batch_size, collate, name=type(data).__name__, causal_labels=causal_labels)
    return MapData(data, batch_size, collate, seed, name=type(data).__name__, causal_labels=causal_labels)


def read_targets(data: Any, step: int, verify: bool = False) -> Any:
    """`data.batch(step)[1]`, through `data.targets(step)` where the source offers that cheaper read. With
    `verify` (the first read of a source), its own `targets(step)` is compared with `batch(step)[1]` (one
    whole read): a difference would pair inputs with the wrong targets, so it is refused."""
    targets = getattr(data, "targets", None)
    if not callable(targets):
        got = data.batch(step)[1]
        if verify and isinstance(data, BatchSource) and not same(got, data.batch(step)[1]):
            # Stage 0 reads the inputs of step s from its own call, this stage the targets from another: a batch(step)
            # that is not a function of step (a stream that ignores it, draws from the process's generator) pairs
            # one draw's inputs with another's targets, and a resume at step s reads something else again.
            raise DataError(f"{data.name}: two calls of batch({step}) returned different targets; each process calls "
                            f"batch(step) itself (stage 0 for the inputs, the last stage for the targets), so its "
                            f"minibatch must be a function of step: seed any randomness from step, and return step's "
                            f"samples whatever was read before (a resume starts at a later step)")
        return got
    got = targets(step)
    if verify:
        want = data.batch(step)[1]
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
                and torch.equal(got, want)):
            found = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
            expected = f"{tuple(want.shape)} {want.dtype}"
            what = "other values" if found == expected else f"{found} where the batch has {expected}"
            if isinstance(data, MapData) and type(data).targets is MapData.targets and found == expected:
                # Not a user's targets(): two collations of the same samples differed. The old message said "fix
                # targets(step) or remove it", a method the user never wrote.
                raise DataError(f"{data.name}: two reads of step {step}'s minibatch hold different targets, so its "
                                f"collate_fn (or the dataset) {RANDOM_TARGETS}")
            raise DataError(f"{type(data).__name__}.targets({step}) differs from batch({step})'s target ({what}); the "
                            "last stage would pair inputs with the wrong targets: fix targets(step) or remove it")
    return got


def position(data: Any, step: int) -> dict[str, int]:
    """Where in its data a source reads `step` (a Prefetcher forwards the question to the source it wraps)."""
    where = getattr(data, "position", None)
    return where(step) if callable(where) else {"step": step}
