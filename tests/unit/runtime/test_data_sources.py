"""A user's data (runtime/data/sources.py): each adapter trains exactly as single-process training, and reads any
step afresh as an uninterrupted run reads it (a resume mid-epoch continues exactly)."""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from model_parallel import PipelineTrainer, TrainConfig
from model_parallel.codegen.naming import state_key
from model_parallel.errors import DataError
from model_parallel.models.mlp import StackedMLP
from model_parallel.runtime.data.batches import make_dataset
from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.data.sources import IterableData, MapData, as_source, read_targets, token_data
from model_parallel.runtime.trainer import single_process_reference
from support.sources_cases import BATCH, CLASSES, FEATURES, N, sources, tensors

CONFIG = TrainConfig(batch_size=BATCH, num_microbatches=2, seed=3)


def _dict_collate(samples):
    return {"x": torch.stack([s[0] for s in samples]), "labels": torch.stack([s[1] for s in samples])}


class DictModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = StackedMLP(FEATURES, 32, 2, CLASSES)

    def forward(self, x):
        return self.net(x)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("name", sorted(sources()))
def test_each_adapter_trains_as_single_process(name):
    data = sources()[name]
    torch.manual_seed(1)
    model = StackedMLP(FEATURES, 32, 2, CLASSES)
    reference = copy.deepcopy(model)
    trainer = PipelineTrainer(model, _sgd, data, CONFIG, num_stages=2, single_process=True)
    losses = [r.loss for r in trainer.train(12)]  # past two epoch ends
    want = single_process_reference(reference, F.cross_entropy, _sgd, as_source(data, BATCH, CONFIG.seed), CONFIG, 12)
    assert losses == pytest.approx(want, abs=1e-6)
    got = trainer.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.allclose(got[state_key(key)], value, atol=1e-5), f"{name}: {key} differs"


def test_dict_batches_from_a_collate_function():
    x, y = tensors()
    torch.manual_seed(1)
    model = DictModel()
    reference = copy.deepcopy(model)
    trainer = PipelineTrainer(model, _sgd, TensorDataset(x, y), CONFIG, num_stages=2, single_process=True,
                              collate_fn=_dict_collate)
    source = as_source(TensorDataset(x, y), BATCH, CONFIG.seed, _dict_collate)
    inputs, target = source.batch(0)
    assert sorted(inputs) == ["x"] and target.shape == (BATCH,)
    losses = [r.loss for r in trainer.train(3)]
    want = single_process_reference(reference, F.cross_entropy, _sgd, source, CONFIG, 3)
    assert losses == pytest.approx(want, abs=1e-6)


class StepSource:
    """A user's `batch(step)` source; `form` is how it returns the minibatch of step `step`."""

    batch_size = BATCH

    def __init__(self, form: str) -> None:
        self.form = form

    def batch(self, step):
        x, y = tensors()
        x, y = x[step % 5 * BATCH:][:BATCH], y[step % 5 * BATCH:][:BATCH]
        return {"tuple": ((x,), y), "tensor": (x, y), "list": ([x], y), "dict": {"x": x, "labels": y},
                "kwargs": ({"x": x}, y), "triple": (x, x, y), "bare": x, "no_labels": {"x": x},
                "list_target": ((x,), y.tolist()), "no_tensor": (("x",), y)}[self.form]


@pytest.mark.parametrize("form", ["tensor", "list", "dict", "kwargs"])
def test_a_batch_source_s_other_forms_train_as_its_tuple_form(form):
    # QA: (x, y) iterated x row by row into 9 positional arguments; a dict batch failed with KeyError: 1 on the last stage.
    def run(source_form):
        torch.manual_seed(1)
        model = DictModel()
        trainer = PipelineTrainer(model, _sgd, StepSource(source_form), CONFIG, num_stages=2, single_process=True)
        return [r.loss for r in trainer.train(3)]

    assert run(form) == pytest.approx(run("tuple"), abs=1e-6)
    inputs, target = as_source(StepSource(form), BATCH, 0).batch(1)
    assert target.shape == (BATCH,) and (sorted(inputs) == ["x"] if form in ("dict", "kwargs") else len(inputs) == 1)
    assert torch.equal(read_targets(as_source(StepSource(form), BATCH, 0), 1), target)  # the last stage's read


@pytest.mark.parametrize("form, why", [
    ("triple", r"a tuple of 3 items, not \(inputs, target\)"),
    ("bare", r"not \(inputs, target\) nor a dict"),
    ("no_labels", r"a dict batch needs a 'labels' entry"),
    ("list_target", r"the target is a list, not a tensor"),
    ("no_tensor", r"the inputs hold no tensor"),
])
def test_a_batch_source_s_wrong_batch_is_refused_naming_the_source_step_value_and_forms(form, why):
    with pytest.raises(DataError, match=rf"^StepSource\.batch\(2\): {why}.*returned .*Tensor\(8,.*"
                                        r"batch\(step\) returns \(inputs, target\).*\(\(x,\), y\)"):
        as_source(StepSource(form), BATCH, 0).batch(2)


class HalfTargets:
    """A source whose targets hold half the samples of its inputs (a collate bug): with a regression loss each
    microbatch's 2 outputs broadcast against 1 target row (torch only warns) and the run trained a wrong loss."""

    def __init__(self, keyword: bool) -> None:
        self.keyword = keyword

    def batch(self, step):
        x = torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(step))
        return ({"x": x} if self.keyword else (x,)), torch.zeros(BATCH // 2, CLASSES)


@pytest.mark.parametrize("keyword, name", [(False, "#0"), (True, "'x'")])
def test_inputs_and_target_of_different_sizes_are_refused_naming_both(keyword, name):
    trainer = PipelineTrainer(DictModel(), _sgd, HalfTargets(keyword), CONFIG, num_stages=2, single_process=True,
                              criterion=torch.nn.MSELoss())
    refusal = rf"minibatch 0: input {name} holds {BATCH} samples \(shape \({BATCH}, {FEATURES}\)\) but its target {BATCH // 2}"
    with pytest.raises(DataError, match=refusal + ".*must hold the same samples"):
        trainer.train(1)
    with pytest.raises(DataError, match=refusal):  # the oracle splits by the same rule
        single_process_reference(DictModel(), torch.nn.MSELoss(), _sgd, HalfTargets(keyword), CONFIG, 1)


def test_a_prefetcher_over_a_user_s_source_has_its_batches_checked_inside():
    # QA: Prefetcher(source) was this package's type, so a user's batches inside it went unchecked (a dict batch failed
    # deep in the trace); the Prefetcher now reads the checked source, and is not re-wrapped by a later call.
    def run(data):
        torch.manual_seed(1)
        trainer = PipelineTrainer(DictModel(), _sgd, data, CONFIG, num_stages=2, single_process=True)
        return [r.loss for r in trainer.train(3)]

    with Prefetcher(StepSource("dict")) as ahead:
        assert run(ahead) == pytest.approx(run(StepSource("tuple")), abs=1e-6)
        assert as_source(ahead, BATCH, 0) is ahead and type(ahead.dataset).__name__ == "BatchSource"
    with Prefetcher(StepSource("bare")) as ahead, pytest.raises(DataError, match=r"StepSource\.batch\(0\): not \(inputs"):
        as_source(ahead, BATCH, 0).batch(0)
    with Prefetcher(StepSource("tuple")) as used:
        used.batch(0)  # batches prepared from the unchecked source: refused, not mixed with checked ones
        with pytest.raises(DataError, match="already prepared batches of StepSource.*pass a new Prefetcher"):
            as_source(used, BATCH, 0)


def test_a_batch_source_keeps_its_own_attributes():
    source = as_source(StepSource("tuple"), BATCH, 0)
    assert source.batch_size == BATCH and source.form == "tuple" and as_source(source, BATCH, 0) is source
    assert copy.deepcopy(source).batch(0)[1].shape == (BATCH,)


@pytest.mark.parametrize("name", sorted(sources()))
def test_a_fresh_source_reads_mid_epoch_steps_as_an_uninterrupted_one(name):
    # What a resume does: a new process asks its new source for the checkpoint's next step directly.
    running = as_source(sources()[name], BATCH, 7)
    seen = [running.batch(step) for step in range(13)]
    for step in (7, 3, 12):  # mid-epoch 1, backwards, mid-epoch 2
        inputs, target = as_source(sources()[name], BATCH, 7).batch(step)
        assert torch.equal(inputs[0], seen[step][0][0]) and torch.equal(target, seen[step][1])
    again_inputs, _ = running.batch(2)  # the same object jumping back replays
    assert torch.equal(again_inputs[0], seen[2][0][0])


def test_epochs_are_permutations_keyed_by_seed_and_epoch():
    x, y = tensors()
    data = MapData(TensorDataset(torch.arange(N), y), BATCH, seed=5)
    epoch0 = torch.cat([data.batch(s)[0][0] for s in range(5)])
    epoch1 = torch.cat([data.batch(s)[0][0] for s in range(5, 10)])
    assert sorted(epoch0.tolist()) == list(range(N)) == sorted(epoch1.tolist())
    assert not torch.equal(epoch0, epoch1)
    assert data.position(7) == {"epoch": 1, "batch": 2}
    other = MapData(TensorDataset(torch.arange(N), y), BATCH, seed=6)
    assert not torch.equal(other.batch(0)[0][0], data.batch(0)[0][0])


def test_token_file_gives_windows_and_shifted_targets(tmp_path):
    ids = np.arange(1000, dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")
    data = token_data(str(tmp_path / "train.bin"), seq_len=16, batch_size=4, seed=0)
    (x,), y = data.batch(3)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert all(int(row[0]) % 16 == 0 for row in x)  # windows start on multiples of seq_len
    made = make_dataset(f"tokens:{tmp_path / 'train.bin'}", 4, 0, shape=(16,), num_classes=1000, kind="tokens", prefetch=0)
    assert torch.equal(made.batch(3)[0][0], x)
    with pytest.raises(DataError, match=r"--seq_len 8 differs from the model's input length 16 \(as traced\)"):
        make_dataset(f"tokens:{tmp_path / 'train.bin'}", 4, 0, shape=(16,), num_classes=1000, kind="tokens", seq_len=8)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_token_file_that_is_not_a_regular_file_is_named_by_kind(tmp_path, kind):
    """A FIFO, /dev/zero behind a symlink or a directory was reported as "no such file" (it exists), by both the
    API and the worker's --data check."""
    from model_parallel.cli.worker import build_parser
    from model_parallel.cli.worker_inputs import check_inputs
    from model_parallel.errors import PlanError

    path = tmp_path / "train.bin"
    {"fifo": lambda: os.mkfifo(path), "device": lambda: path.symlink_to("/dev/zero"), "directory": path.mkdir}[kind]()
    shown = {"fifo": "a FIFO", "device": "a device", "directory": "a directory"}[kind]
    with pytest.raises(DataError, match=rf"tokens:{path}: not a regular file \({shown}, possibly behind a symlink\)"):
        token_data(str(path), 4, 2)
    with pytest.raises(PlanError, match=rf"--data tokens:{path}: not a regular file \({shown}"):
        check_inputs(build_parser().parse_args(["--model", "gpt", "--data", f"tokens:{path}"]))


def test_token_file_errors(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match=r"3 bytes is not a whole number of uint16 ids"):
        token_data(str(tmp_path / "odd.bin"), 4, 2)
    with pytest.raises(DataError, match=r"no such file"):
        token_data(str(tmp_path / "missing.bin"), 4, 2)
    # An id past the model's vocabulary (another tokenizer, the wrong --token_dtype) is named when the file is opened,
    # the first one in the file, not at the step that would first read it.
    ids = np.arange(100, dtype=np.uint16)
    ids[37] = 95
    ids.tofile(tmp_path / "ids.bin")
    assert token_data(str(tmp_path / "ids.bin"), 4, 2, vocab=100).batch(0)[0][0].max() < 100
    with pytest.raises(DataError, match=r"ids.bin: token id 95 \(at token 37\) is not below the model's "
                                        r"vocabulary size 90; was the file made by another tokenizer.*--token_dtype"):
        token_data(str(tmp_path / "ids.bin"), 4, 2, vocab=90)
    np.arange(10, dtype=np.uint32).tofile(tmp_path / "short.bin")
    with pytest.raises(DataError, match=r"10 token\(s\) cannot make one window of --seq_len 16"):
        token_data(str(tmp_path / "short.bin"), 16, 2, dtype="uint32")


def test_bad_data_is_refused_with_the_fix():
    with pytest.raises(DataError, match=r"one-shot iterator.*re-iterable"):
        as_source(iter([1, 2]), BATCH, 0)
    with pytest.raises(DataError, match=r"3 sample\(s\) cannot fill one minibatch of 8"):
        as_source(TensorDataset(torch.zeros(3, 2), torch.zeros(3)), BATCH, 0)
    with pytest.raises(DataError, match=r"a batch must be \(inputs, target\) or a dict with 'labels'"):
        as_source(TensorDataset(torch.zeros(8, 2)), BATCH, 0).batch(0)
    with pytest.raises(DataError, match=r"needs a 'labels' entry"):
        as_source(TensorDataset(torch.zeros(8, 2)), BATCH, 0, lambda s: {"x": torch.stack([t[0] for t in s])}).batch(0)
    with pytest.raises(DataError, match=r"yielded nothing"):
        IterableData([], 2).batch(0)


def test_a_data_loader_trains_the_run_s_batch_size_or_is_refused(caplog):
    # A user's QA: DataLoader(batch_size=4) under TrainConfig(batch_size=8) trained 4 samples a step, recorded as 8.
    x, y = tensors()
    with pytest.raises(DataError, match=r"DataLoader: its batch_size 4 differs from the run's batch size 8"):
        as_source(DataLoader(TensorDataset(x, y), batch_size=4), BATCH, 0)
    # Batches a batch_sampler makes are checked as they come: a short one would split into unequal microbatches.
    short = DataLoader(TensorDataset(x, y), batch_sampler=[list(range(8)), list(range(8, 13))])
    source = as_source(short, BATCH, 0)
    assert len(source.batch(0)[1]) == BATCH
    with pytest.raises(DataError, match=r"step 1: a batch of 5 sample\(s\) where the run's batch size is 8"):
        source.batch(1)
    # drop_last=False with a remainder: every step is still a full minibatch, and the samples left out are said.
    loader = DataLoader(TensorDataset(x[:35], y[:35]), batch_size=BATCH, shuffle=True)
    source = as_source(loader, BATCH, 0)
    assert "3 sample(s) of 35 are left out of every epoch" in caplog.text
    assert {len(source.batch(step)[1]) for step in range(10)} == {BATCH}


@pytest.mark.parametrize("sampler", ["subset", "weighted", "batch_sampler", "shuffling_iterable", "replacement",
                                     "num_samples", "augmenting_iterable"])
def test_an_iterable_whose_passes_differ_is_refused(sampler):
    """Each process reads the data itself (stage 0 the inputs, the last stage the targets): a random order not keyed
    by the run's seed paired one sample's inputs with another's target, and training went on without a word. A
    RandomSampler with replacement or num_samples was read as a plain shuffle (both ignored: num_samples=BATCH
    trained N // BATCH steps an epoch, without a word)."""
    from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

    dataset = TensorDataset(*tensors())

    class Shuffling(IterableDataset):
        def __iter__(self):
            return iter(dataset[i] for i in torch.randperm(N).tolist())

    class Augmenting(IterableDataset):  # the same order, random jitter per item (an augmentation's draw)
        def __iter__(self):
            return iter((x + torch.rand_like(x), y) for x, y in (dataset[i] for i in range(N)))

    data = {"subset": lambda: DataLoader(dataset, batch_size=BATCH, sampler=SubsetRandomSampler(range(N))),
            "weighted": lambda: DataLoader(dataset, batch_size=BATCH, sampler=WeightedRandomSampler(torch.ones(N), N)),
            "batch_sampler": lambda: DataLoader(dataset, batch_sampler=BatchSampler(RandomSampler(dataset), BATCH, True)),
            "shuffling_iterable": Shuffling,
            "replacement": lambda: DataLoader(dataset, batch_size=BATCH, sampler=RandomSampler(dataset, replacement=True)),
            "num_samples": lambda: DataLoader(dataset, batch_size=BATCH, sampler=RandomSampler(dataset, num_samples=BATCH)),
            "augmenting_iterable": Augmenting,
            }[sampler]()
    with pytest.raises(DataError, match=r"two passes over it begin with different samples.*shuffle=True.*augmentation"):
        as_source(data, BATCH, seed=0).batch(0)


def test_an_iterable_in_a_fixed_order_of_its_own_is_read_as_it_is():
    x, y = tensors()
    order = list(reversed(range(N)))  # a deterministic sampler of the user's: replays, so it is accepted
    source = as_source(DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=order), BATCH, seed=0)
    inputs, target = source.batch(1)
    assert torch.equal(inputs[0], x[order[BATCH:2 * BATCH]]) and torch.equal(target, y[order[BATCH:2 * BATCH]])


@pytest.mark.parametrize("size", [2 * BATCH, BATCH - 2])
def test_a_batch_source_of_another_batch_size_is_refused(size):
    """As a DataLoader of another batch size is: a step trained `size` samples (in unequal microbatches, each weighted
    1/m, for BATCH - 2) while the plan's memory and the checkpoint's record said BATCH, without a word."""

    class Sized:
        def batch(self, step: int):
            x, y = tensors()
            return (x[:size],), y[:size]

    with pytest.raises(DataError, match=rf"Sized.batch\(0\): a minibatch of {size} sample\(s\) where the run's batch "
                                        rf"size is {BATCH}"):  # the first read: the trace's example microbatch
        PipelineTrainer(StackedMLP(in_features=FEATURES, width=8, depth=2, num_classes=CLASSES), _sgd, Sized(),
                        TrainConfig(batch_size=BATCH, num_microbatches=4), num_stages=2, single_process=True).train(1)


def test_keyword_inputs_other_than_the_traced_ones_are_refused_naming_them():
    """The placeholders are named after the traced keys: a batch holding token_type_ids where attention_mask was
    traced fed it into attention_mask's slot (in the dict's order) and trained, and a missing key failed as
    "forward() missing 1 required positional argument"."""
    from model_parallel.runtime.data.batches import stage_zero_inputs

    traced = [{"name": "input_ids"}, {"name": "attention_mask"}]
    ids, mask, types = torch.zeros(2, 4), torch.ones(2, 4), torch.full((2, 4), 2.0)
    got = stage_zero_inputs(traced, {}, [{"attention_mask": mask, "input_ids": ids}])
    assert got[0] is ids and got[1] is mask  # the graph's order, not the dict's
    with pytest.raises(DataError, match=r"minibatch 3: its keyword inputs \['input_ids', 'token_type_ids'\] are not "
                                        r"those the model was traced with .*missing \['attention_mask'\], unexpected "
                                        r"\['token_type_ids'\]"):
        stage_zero_inputs(traced, {}, [{"input_ids": ids, "token_type_ids": types}], "minibatch 3")
    with pytest.raises(DataError, match=r"missing \['attention_mask'\], unexpected none"):
        stage_zero_inputs(traced, {}, [{"input_ids": ids}])
    # No placeholder named after any key (no record of them): the dict's order, as the trace took it.
    assert stage_zero_inputs([{"name": "arg0"}, {"name": "arg1"}], {}, [{"a": ids, "b": mask}]) == [ids, mask]


def _masking(samples):
    inputs = torch.stack([s[0] for s in samples])
    return inputs, torch.where(torch.rand(len(samples)) < 0.5, torch.stack([s[1] for s in samples]), -100)


def test_a_collate_fn_that_draws_targets_at_random_is_refused_naming_it():
    """Each process collates for itself: random masking in the collate_fn (as DataCollatorForLanguageModeling does)
    gave the last stage targets of another draw than stage 0's inputs. An iterable's trained silently."""
    from support.sources_cases import Stream

    source = as_source(Stream(), BATCH, seed=0, collate_fn=_masking)
    with pytest.raises(DataError, match=r"two collations of the same samples hold different targets.*collate_fn"):
        read_targets(source, 0, verify=True)


def test_a_map_style_collate_fn_that_draws_at_random_draws_alike_in_every_process():
    """A map-style dataset's step is read and collated under draws keyed by (seed, step) (data/draws.py), so a random
    collate_fn gives stage 0 and the last stage the same draw (before: refused as two reads that differ)."""
    x, y = tensors()
    source = as_source(TensorDataset(x, y), BATCH, seed=0, collate_fn=_masking)
    targets = read_targets(source, 0, verify=True)
    torch.manual_seed(7)  # another process: its generator stands elsewhere
    other = as_source(TensorDataset(x, y), BATCH, seed=0, collate_fn=_masking)
    assert torch.equal(other.batch(0)[1], targets) and (targets == -100).any()
