"""A Hugging Face config transformers cannot read is a ConfigError naming the file, not transformers' traceback."""
from __future__ import annotations

import os

import pytest

from model_parallel.api.export import hf_config_and_class
from model_parallel.errors import ConfigError


def test_an_unknown_model_type_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "config.json").write_text('{"model_type": "nonexistent_model"}')
    with pytest.raises(ConfigError, match=r"config\.json: transformers .* cannot read it \(.*nonexistent_model"):
        hf_config_and_class(tmp_path)


def test_a_fifo_config_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        hf_config_and_class(tmp_path)
