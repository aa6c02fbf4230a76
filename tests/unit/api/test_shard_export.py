"""api/shard_export.py's layout: which rank writes which tensor into which shard file, the same on every rank."""
from __future__ import annotations

import pytest

from model_parallel.api.shard_export import Shard, TensorEntry, parse_shard_size, shard_layout
from model_parallel.errors import CheckpointError, ConfigError


def _e(key: str, nbytes: int, shape: tuple[int, ...] = (1,)) -> TensorEntry:
    return TensorEntry(key, "float32", shape, nbytes)


SHAPES = {k: (1,) for k in ("a", "b", "c", "d", "e")}


def test_each_rank_writes_its_own_keys_in_model_order_cut_at_the_limit() -> None:
    entries = [[_e("b", 40), _e("a", 40), _e("c", 40)], [_e("d", 100), _e("e", 10)]]
    assert shard_layout(list("abcde"), entries, 100, SHAPES) == [
        Shard("model-00001-of-00004.safetensors", 0, ("a", "b")),
        Shard("model-00002-of-00004.safetensors", 0, ("c",)),
        Shard("model-00003-of-00004.safetensors", 1, ("d",)),  # exactly the limit: alone
        Shard("model-00004-of-00004.safetensors", 1, ("e",)),
    ]


def test_a_tensor_held_by_several_ranks_is_written_once_by_the_lowest() -> None:
    # rank 1 and 2 replicate one stage; rank 2 also holds the tie's copy "a" (transformers' key for both)
    entries = [[_e("a", 8)], [_e("b", 8), _e("c", 8)], [_e("b", 8), _e("c", 8), _e("a", 8)]]
    layout = shard_layout(list("abc"), entries, 1000, {k: (1,) for k in "abc"})
    assert layout == [Shard("model-00001-of-00002.safetensors", 0, ("a",)),
                      Shard("model-00002-of-00002.safetensors", 1, ("b", "c"))]


def test_one_file_is_named_as_transformers_names_an_unsharded_model() -> None:
    assert shard_layout(["a"], [[_e("a", 8)], []], 1000, {"a": (1,)}) == [Shard("model.safetensors", 0, ("a",))]


def test_a_tensor_no_rank_holds_or_the_model_lacks_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"no rank holds 1 tensor\(s\) of the model, e.g. \[.b.\]: the stages"):
        shard_layout(["a", "b"], [[_e("a", 8)], []], 1000, {"a": (1,), "b": (1,)})
    with pytest.raises(CheckpointError, match="rank 1 holds 'z', which the model does not store"):
        shard_layout(["a"], [[_e("a", 8)], [_e("z", 8)]], 1000, {"a": (1,)})
    with pytest.raises(CheckpointError, match=r"rank 0 holds 'a' as \[2\], the model has \[1\]"):
        shard_layout(["a"], [[_e("a", 8, (2,))]], 1000, {"a": (1,)})


def test_max_shard_size_reads_as_huggingface_hub_reads_it() -> None:
    assert parse_shard_size("20KB") == 20_000 and parse_shard_size(5) == 5
    with pytest.raises(ConfigError, match="max_shard_size '5 parsecs'"):
        parse_shard_size("5 parsecs")
    with pytest.raises(ConfigError, match="must be positive"):
        parse_shard_size(0)


def test_into_an_existing_directory_other_files_stay_and_an_earlier_saves_shards_go(tmp_path) -> None:
    from model_parallel.api.hf_directory import INDEX_NAME, move_into_place

    out, staging = tmp_path / "out", tmp_path / ".out.x.partial"
    out.mkdir()
    for name in ("tokenizer.json", "model-extra.safetensors", "model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors", INDEX_NAME):
        (out / name).write_text("old")
    staging.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_NAME, "config.json"):
        (staging / name).write_text("new")
    move_into_place(staging, out, {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"})
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        "tokenizer.json": "old", "model-extra.safetensors": "old", "model-00001-of-00002.safetensors": "new", "model-00002-of-00002.safetensors": "new",
        INDEX_NAME: "new", "config.json": "new"}
    assert not staging.exists() or not list(staging.iterdir())

    staging.mkdir(exist_ok=True)
    (staging / "model.safetensors").write_text("one")
    move_into_place(staging, out, {"model.safetensors"})  # one file now: no index, no earlier shards
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-extra.safetensors", "model.safetensors",
                                                     "tokenizer.json"]


def test_a_new_directory_is_one_rename(tmp_path) -> None:
    from model_parallel.api.hf_directory import move_into_place

    staging = tmp_path / ".out.x.partial"
    staging.mkdir()
    (staging / "model.safetensors").write_text("w")
    move_into_place(staging, tmp_path / "out", {"model.safetensors"})
    assert not staging.exists() and (tmp_path / "out" / "model.safetensors").read_text() == "w"
