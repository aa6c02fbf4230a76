"""A resume trains the same data and the same model: the training record's content fingerprint of the data
(checkpoint/data_identity.py) and its graph structure (checkpoint/graph_identity.py)."""
from __future__ import annotations

import logging
import os
import random
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from model_parallel.errors import ConfigError
from model_parallel.runtime.checkpoint.training_record import check_resume, training_record
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.data.prefetch import Prefetcher
from model_parallel.runtime.data.sources import as_source, token_data

CONFIG = TrainConfig(batch_size=4, num_microbatches=2)


def _tokens(path: Path, seed: int, count: int = 200_000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(seed).integers(0, 50_000, count, dtype=np.uint16).tofile(path)
    return path


def _record(path: str) -> dict:
    return training_record(CONFIG, Prefetcher(token_data(path, 64, 4)), 3)


def test_the_same_token_file_by_another_path_is_the_same_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tokens(tmp_path / "train.bin", 0)
    monkeypatch.chdir(tmp_path)
    stored = _record("train.bin")
    assert stored["data"] == "tokens:train.bin (3124 samples)"
    assert check_resume(stored, _record(str(tmp_path / "train.bin")), allow=False, where="ck") == []
    assert check_resume(stored, _record("./train.bin"), allow=False, where="ck") == []


def test_another_token_file_under_the_same_name_is_refused_and_accepted_when_allowed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _tokens(tmp_path / "train.bin", 0)
    _tokens(tmp_path / "alt" / "train.bin", 1)  # the same size, other tokens
    monkeypatch.chdir(tmp_path)
    stored = _record("train.bin")
    monkeypatch.chdir(tmp_path / "alt")
    other = _record("train.bin")
    with pytest.raises(ConfigError, match=r"different data: data 'tokens:train.bin \(3124 samples\)' -> 'tokens:train.bin "
                                          r"\(3124 samples\)' \(the token file's contents differ: sha256 of sampled blocks "
                                          r"[0-9a-f]{16} -> [0-9a-f]{16}\).*--data tokens:train.bin.*--allow_config_change"):
        check_resume(stored, other, allow=False, where="ck")
    with caplog.at_level(logging.WARNING):
        assert len(check_resume(stored, other, allow=True, where="ck")) == 1
    assert "--allow_config_change: resuming from ck with data 'tokens:train.bin (3124 samples)'" in caplog.text


def test_the_token_fingerprint_reads_sampled_blocks_not_the_whole_file(tmp_path: Path) -> None:
    path = _tokens(tmp_path / "train.bin", 0, count=4_000_000)  # 8 MB
    content = _record(str(path))["data_content"]
    assert content["bytes"] == 8_000_000
    tokens = np.memmap(path, dtype=np.uint16, mode="r+")
    tokens[1_000_000] += 1  # inside no sampled block: not seen (the price of not reading gigabytes)
    tokens.flush()
    assert _record(str(path))["data_content"] == content
    tokens[0] += 1  # the first block is always sampled
    tokens.flush()
    assert _record(str(path))["data_content"] != content


class Toks(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(1, 100, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i, 0] % 3}


def _dataset_record(dataset: Dataset, seed: int = 0) -> dict:
    return training_record(replace(CONFIG, seed=seed), as_source(dataset, 4, seed), 3)


def test_another_dataset_of_the_same_length_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    stored = _dataset_record(Toks(64, 1))
    assert check_resume(stored, _dataset_record(Toks(64, 1)), allow=False, where="ck") == []  # another instance, same data
    with pytest.raises(ConfigError, match=r"different data: data 'Toks \(64 samples\)' -> 'Toks \(64 samples\)' "
                                          r"\(the dataset's contents differ: sha256 of samples 0, 32, 63"):
        check_resume(stored, _dataset_record(Toks(64, 7)), allow=False, where="ck")
    # The fingerprint does not depend on the shuffle (the seed is a field of its own).
    assert _dataset_record(Toks(64, 1), seed=5)["data_content"] == stored["data_content"]
    # Reading the samples leaves the training's random state alone, and reads them under fixed seeds: a random
    # augmentation (here Python's generator) gives the same fingerprint on resume.
    class Augmented(Toks):
        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i] + random.randint(0, 5), "labels": self.ids[i, 0] % 3}

    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    expected = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    augmented = _dataset_record(Augmented(64, 1))
    assert (torch.rand(1), random.random(), np.random.rand()) == expected
    assert check_resume(augmented, _dataset_record(Augmented(64, 1)), allow=False, where="ck") == []
    assert augmented["data_content"] != stored["data_content"]

    # Samples that differ on every read (state in the dataset): no fingerprint, compared by description, rather
    # than a false refusal on every resume.
    class Counting(Toks):
        reads = 0

        def __getitem__(self, i: int) -> dict:
            self.reads += 1
            return {"input_ids": self.ids[i] + self.reads, "labels": self.ids[i, 0] % 3}

    record = _dataset_record(Counting(64, 1))
    assert "data_content" not in record
    assert check_resume(record, _dataset_record(Counting(64, 1)), allow=False, where="ck") == []


def test_a_checkpoint_without_a_data_fingerprint_resumes_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _tokens(tmp_path / "train.bin", 0)
    monkeypatch.chdir(tmp_path)
    old = {k: v for k, v in _record("train.bin").items() if k != "data_content"}
    with caplog.at_level(logging.WARNING):
        assert check_resume(old, _record(str(tmp_path / "train.bin")), allow=False, where="ck") == []
    warned = [r.getMessage() for r in caplog.records if "cannot verify" in r.getMessage()]
    assert len(warned) == 1 and "written before the data's contents were recorded" in warned[0]


@pytest.mark.slow
def test_the_api_refuses_a_resume_with_another_dataset_of_the_same_length(tmp_path: Path) -> None:
    import datetime

    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    from model_parallel import PipelineTrainer, RunOptions
    from model_parallel.runtime.build.zoo import recipe

    # A world of one rank in this process: the engine's own checkpoint and resume path.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        r = recipe("mlp")

        def run(seed: int, steps: int, resume: bool, allow: bool = False) -> int:
            g = torch.Generator().manual_seed(seed)
            data = TensorDataset(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
            options = RunOptions(timeout=60, checkpoint_dir=str(tmp_path / "ck"), resume=resume, progress=False,
                                 allow_config_change=allow)
            with PipelineTrainer(r.model(0), lambda p: torch.optim.SGD(p, lr=0.01), data, CONFIG, options=options,
                                 num_stages=1, criterion=r.criterion) as trainer:
                return len(trainer.train(steps))

        assert run(1, 2, resume=False) == 2
        with pytest.raises(ConfigError, match=r"different data: data 'TensorDataset \(32 samples\)' -> 'TensorDataset "
                                              r"\(32 samples\)' \(the dataset's contents differ"):
            run(7, 4, resume=True)
        assert run(1, 3, resume=True) == 1  # the same data: resumes
        assert run(7, 4, resume=True, allow=True) == 1
    finally:
        dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.drop = nn.Dropout(dropout) if dropout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        return torch.relu(self.drop(x) if self.drop is not None else x)


def _graph(dropout: float = 0.0, batch: int = 2):
    from model_parallel.profiler.trace import trace_model

    return trace_model(Net(dropout), (torch.zeros(batch, 4),))[0]


def _graph_record(graph) -> dict:
    from model_parallel.runtime.data.batches import SyntheticData

    return training_record(CONFIG, SyntheticData(4, (4,)), 3, graph=graph)


def test_another_graph_of_the_same_parameters_is_refused_naming_the_first_differing_node(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from model_parallel.runtime.checkpoint.graph_identity import graph_details
    from model_parallel.runtime.checkpoint.model_files import write_model_files

    trained = _graph()
    write_model_files(tmp_path, trained)
    stored, other = _graph_record(trained), _graph_record(_graph(dropout=0.1))
    details = graph_details(tmp_path, _graph(dropout=0.1))
    with pytest.raises(ConfigError, match=r"different graph: graph '3 nodes, structure [0-9a-f]{16}' -> '4 nodes, "
                                          r"structure [0-9a-f]{16}' \(3 -> 4 nodes; the first that differs is node #3: "
                                          r"'relu' -> 'drop'\).*the graph the run trained.*--allow_config_change"):
        check_resume(stored, other, allow=False, where="ck", details=details)
    with caplog.at_level(logging.WARNING):
        assert len(check_resume(stored, other, allow=True, where="ck", details=details)) == 1
    assert "--allow_config_change: resuming from ck with graph" in caplog.text


def test_the_same_graph_reprofiled_or_read_back_from_the_checkpoint_is_the_same(tmp_path: Path) -> None:
    from model_parallel.runtime.checkpoint.model_files import checkpoint_graph, write_model_files

    trained = _graph()
    stored = _graph_record(trained)
    timed = replace(trained, nodes=tuple(replace(n, forward_ms=n.forward_ms + 1.5) for n in trained.nodes))
    write_model_files(tmp_path, trained)
    for graph in (timed, _graph(batch=8), checkpoint_graph(tmp_path)):  # other timings, another profiled batch size
        assert check_resume(stored, _graph_record(graph), allow=False, where="ck") == []
    # A checkpoint written before the graph was recorded: not compared.
    old = {k: v for k, v in stored.items() if k != "graph"}
    assert check_resume(old, _graph_record(_graph(dropout=0.1)), allow=False, where="ck") == []
    assert os.path.isfile(tmp_path / "graph.json")


def test_an_iterable_and_a_batch_object_are_fingerprinted_by_their_first_minibatch() -> None:
    """Before, they recorded no fingerprint: another copy of an iterable, or a batch(step) object reading other
    files, resumed (and trained beside the job's other ranks) as the same data."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __init__(self, seed: int) -> None:
            self.seed = seed

        def __iter__(self):
            g = torch.Generator().manual_seed(self.seed)
            return iter([(torch.randn(3, generator=g), int(torch.randint(0, 5, (), generator=g))) for _ in range(12)])

    class Steps:
        def __init__(self, seed: int) -> None:
            self.seed = seed

        def batch(self, step: int):
            g = torch.Generator().manual_seed(self.seed * 1000 + step)
            return (torch.randn(4, 3, generator=g),), torch.randint(0, 5, (4,), generator=g)

    def record(data: object) -> dict:
        return training_record(CONFIG, as_source(data, 4, 0), 3)

    for make, kind in ((Stream, "iterable"), (Steps, "batch(step) object")):
        stored = record(make(1))
        assert stored["data_content"]["kind"] == kind
        assert check_resume(stored, record(make(1)), allow=False, where="ck") == []
        with pytest.raises(ConfigError, match=rf"the {re.escape(kind)}'s contents differ: sha256 of the first minibatch"):
            check_resume(stored, record(make(2)), allow=False, where="ck")
    # Reading the fingerprint does not move the iterable's own position.
    source = as_source(Stream(1), 4, 0)
    first = source.batch(0)
    assert training_record(CONFIG, source, 3)["data_content"] == record(Stream(1))["data_content"]
    assert torch.equal(source.batch(1)[0][0], torch.stack([x for x, _ in list(Stream(1))[4:8]]))
    assert torch.equal(first[1], torch.tensor([y for _, y in list(Stream(1))[:4]]))
