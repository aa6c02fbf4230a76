"""A joiner whose `--data tokens:PATH` holds other tokens than the running job's is refused before it asks to be
admitted (cli/join_data.py): QA found that such a joiner (same flags, another file under the same path) was refused
only when it restored the admission's checkpoint, which ended every member of the running job with exit 2."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from model_parallel.cli.join_data import check_joiner_data
from model_parallel.errors import ConfigError
from model_parallel.runtime.checkpoint import store
from model_parallel.runtime.checkpoint.data_identity import token_file_content


def job_checkpoint(monkeypatch, tokens) -> None:
    record = {"training": {"data_content": {"kind": "token file", "samples": 10, **token_file_content(str(tokens))}}}
    monkeypatch.setattr(store, "load_checkpoint", lambda directory: SimpleNamespace(step=20, extra=record))


def test_a_joiner_with_another_token_file_under_the_same_path_is_refused(tmp_path, monkeypatch) -> None:
    job, mine = tmp_path / "job.bin", tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).tofile(job)
    np.arange(5000, dtype=np.uint16)[::-1].copy().tofile(mine)  # the same size, other tokens
    job_checkpoint(monkeypatch, job)
    args = SimpleNamespace(data=f"tokens:{mine}", checkpoint_dir=str(tmp_path / "ck"), allow_config_change=False)
    with pytest.raises(ConfigError, match=r"--join h:1: --data tokens:.*train.bin on this host holds other tokens than "
                                          r"the running job trained on \(sha256 of sampled blocks .* \(job\) vs .* "
                                          r"\(this worker\); checkpoint step 20"):
        check_joiner_data(args, "h:1")
    # --allow_config_change lets a job resume with other settings; a joiner's restore accepted other tokens with it,
    # and its stages trained on other data than the members' (a warning on the joiner only).
    args.allow_config_change = True
    with pytest.raises(ConfigError, match="holds other tokens than the running job trained on"):
        check_joiner_data(args, "h:1")


def test_the_same_tokens_by_another_path_join(tmp_path, monkeypatch) -> None:
    job, mine = tmp_path / "job.bin", tmp_path / "copy.bin"
    np.arange(5000, dtype=np.uint16).tofile(job)
    np.arange(5000, dtype=np.uint16).tofile(mine)
    job_checkpoint(monkeypatch, job)
    check_joiner_data(SimpleNamespace(data=f"tokens:{mine}", checkpoint_dir="ck", allow_config_change=False), "h:1")
    # Synthetic data, or no committed checkpoint yet: nothing to compare here (the restore checks).
    check_joiner_data(SimpleNamespace(data="synthetic", checkpoint_dir="ck", allow_config_change=False), "h:1")
    monkeypatch.setattr(store, "load_checkpoint", lambda d: (_ for _ in ()).throw(store.CheckpointError("none")))
    check_joiner_data(SimpleNamespace(data=f"tokens:{mine}", checkpoint_dir="ck", allow_config_change=False), "h:1")


def test_a_joiner_restores_without_allow_config_change() -> None:
    # QA: a joiner started with --allow_config_change (a per-process flag its flags comparison ignores) restored the
    # admission's checkpoint with another token file: its stages trained on other data than the members' (final
    # parameters 0.06 off an uninterrupted run, every process exit 0, a warning in the joiner's log only).
    from model_parallel.cli.worker_join import joiner_options
    from model_parallel.runtime.config import RunOptions

    options = joiner_options(RunOptions(allow_config_change=True, metrics="m/rank{rank}.jsonl", checkpoint_dir="ck"), 3)
    assert (options.allow_config_change, options.resume, options.metrics) == (False, True, "m/rank3.jsonl")


def test_a_joiner_with_another_graph_under_the_same_path_is_refused(tmp_path, monkeypatch) -> None:
    from model_parallel.graph.io import save_graph
    from model_parallel.runtime.checkpoint.graph_identity import describe_graph
    from tests.unit.coordinator.test_policy_replay import chain_graph

    job, other = chain_graph(6), chain_graph(7)
    save_graph(other, tmp_path / "graph.json")
    record = {"training": {"graph": describe_graph(job)}}
    monkeypatch.setattr(store, "load_checkpoint", lambda directory: SimpleNamespace(step=20, extra=record))
    args = SimpleNamespace(graph=str(tmp_path / "graph.json"), package=None, data="synthetic", checkpoint_dir="ck",
                           allow_config_change=True)
    with pytest.raises(ConfigError, match=r"the graph .*graph.json on this host is another model than the running "
                                          r"job's \(\d+ nodes, structure \w+ \(job, checkpoint step 20 in ck\) vs"):
        check_joiner_data(args, "h:1")
    save_graph(job, tmp_path / "graph.json")
    check_joiner_data(args, "h:1")  # the job's graph: admitted


def test_a_joiner_with_another_image_folder_is_refused_before_it_asks(tmp_path, monkeypatch) -> None:
    """Before, only token files were compared here: a joiner whose image folder lists other images was refused at
    restore, inside the new world, after the job had stopped for it."""
    import shutil

    from model_parallel.runtime.checkpoint.data_identity import data_content
    from model_parallel.runtime.data.batches import ImageFolderData
    from support.images import image_folder

    job = image_folder(tmp_path / "job")
    record = {"training": {"data_content": data_content(ImageFolderData(job, 1))}}
    monkeypatch.setattr(store, "load_checkpoint", lambda directory: SimpleNamespace(step=20, extra=record))
    copy = shutil.copytree(job, tmp_path / "copy")
    check_joiner_data(SimpleNamespace(data=str(copy), checkpoint_dir="ck"), "h:1")  # the same images elsewhere
    (copy / "dog" / "3.png").rename(copy / "cat" / "9.png")  # one image under another class
    with pytest.raises(ConfigError, match=r"--join h:1: --data .*copy on this host holds other images than the running "
                                          r"job trained on \(sha256 of the image list .* \(job\) vs .* \(this worker\); "
                                          r"checkpoint step 20"):
        check_joiner_data(SimpleNamespace(data=str(copy), checkpoint_dir="ck"), "h:1")
    with pytest.raises(ConfigError, match=r"--join h:1: --data .*missing: not a directory"):
        check_joiner_data(SimpleNamespace(data=str(tmp_path / "missing"), checkpoint_dir="ck"), "h:1")


def test_a_joiner_whose_code_traces_another_model_is_refused_before_any_checkpoint(tmp_path) -> None:
    # QA: a joiner with the job's flags (--model mlp) but another version of the code (a ReLU become Tanh) was found only
    # by the new world's agreement ("rank(s) [2] hold another graph than rank 0"), which ended every member with exit
    # 2; and the data and graph checks here read only a committed checkpoint's record, so a joiner that came before
    # the first checkpoint was not compared at all. Rank 0 publishes its training record; it is compared first.
    from model_parallel.api.job_models import zoo_model
    from model_parallel.runtime.checkpoint.graph_identity import describe_graph

    args = SimpleNamespace(model="mlp", batch_size=8, num_microbatches=4, data="synthetic",
                           checkpoint_dir=str(tmp_path / "none yet"), allow_config_change=False)
    other = {"graph": "16 nodes, structure 0123456789abcdef"}
    with pytest.raises(ConfigError, match=r"--join h:1: --model mlp traces on this host to another model than the "
                                          r"running job's \(16 nodes, structure 0123456789abcdef \(job, published by "
                                          r"the job's rank 0 at h:1\) vs 16 nodes, structure [0-9a-f]+ \(this worker\)\): "
                                          r"run this worker with the job's version of model_parallel"):
        check_joiner_data(args, "h:1", other)
    check_joiner_data(args, "h:1", {"graph": describe_graph(zoo_model("mlp", 2, None)[0])})  # the same code joins


def test_the_published_data_record_refuses_other_tokens_before_any_checkpoint(tmp_path) -> None:
    job, mine = tmp_path / "job.bin", tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).tofile(job)
    np.arange(5000, dtype=np.uint16)[::-1].copy().tofile(mine)
    published = {"data_content": {"kind": "token file", "samples": 10, **token_file_content(str(job))}}
    args = SimpleNamespace(data=f"tokens:{mine}", checkpoint_dir=str(tmp_path / "none yet"), allow_config_change=False)
    with pytest.raises(ConfigError, match=r"holds other tokens than the running job trained on .*published by the "
                                          r"job's rank 0 at h:1"):
        check_joiner_data(args, "h:1", published)
    check_joiner_data(args, "h:1")  # no record published, no checkpoint: nothing to compare here (the restore checks)
