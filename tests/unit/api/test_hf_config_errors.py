"""A Hugging Face config transformers cannot read is a ConfigError naming the file, not transformers' traceback;
one that names code of its own (`auto_map` and a .py beside it, as a hostile checkpoint or downloaded folder may carry)
is refused by every reader (`export`, `profile-hf`, `save_pretrained(config_dir)`) and the code never runs:
transformers asked "Do you wish to run the custom code? [y/N]" on a terminal and ran it on "y"."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from model_parallel.api.export import hf_config_and_class
from model_parallel.errors import ConfigError


def test_an_unknown_model_type_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "config.json").write_text('{"model_type": "nonexistent_model"}')
    with pytest.raises(ConfigError, match=r"config\.json: not a config transformers [0-9.]+ reads as data alone "
                                         r"\(.*nonexistent_model"):
        hf_config_and_class(tmp_path)


def test_a_fifo_config_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        hf_config_and_class(tmp_path)


def test_a_config_naming_its_own_code_is_refused_and_the_code_never_runs(tmp_path: Path) -> None:
    from model_parallel.api.export import hf_config_and_class

    ran = tmp_path / "RAN"
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "evilmodel", "auto_map": {"AutoConfig": "evil.EvilConfig"}, "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "evil.py").write_text(f"open({str(ran)!r}, 'w').write('x')\nfrom transformers import PretrainedConfig\n"
                                      "class EvilConfig(PretrainedConfig):\n    model_type = 'evilmodel'\n")
    with pytest.raises(ConfigError, match=r"config.json: not a config transformers [0-9.]+ reads as data alone .*never run"):
        hf_config_and_class(tmp_path)
    assert not ran.exists()
    # A model type transformers has still reads, from the same folder.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    config, cls = hf_config_and_class(tmp_path)
    assert cls.__name__ == "GPT2LMHeadModel" and not ran.exists()
