"""What export refuses before it writes anything, as one line naming the file and the fix: an --out that is a file
(or lies under one), and a config whose model has other shapes than the trained state (another vocab_size or width;
torch's load_state_dict raised "Error(s) in loading state_dict" with a traceback)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_parallel.api.export import export_checkpoint, save_pretrained
from model_parallel.cli.common import run_cli
from model_parallel.cli.export import main as export_main
from model_parallel.errors import ConfigError


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _gpt2(tmp_path: Path, vocab_size: int, n_embd: int = 16) -> tuple[Path, dict[str, torch.Tensor]]:
    import model_parallel  # noqa: F401  (before transformers: repairs its torchvision import on CPU-only torch)
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=n_embd, n_head=2, vocab_size=vocab_size, n_positions=8,
                                     architectures=["GPT2LMHeadModel"])
    folder = tmp_path / f"cfg_{vocab_size}_{n_embd}"
    config.save_pretrained(folder)
    return folder, transformers.GPT2LMHeadModel(config).state_dict()


def test_an_out_that_is_a_file_is_one_line_before_anything_is_read(tmp_path, capsys):
    (tmp_path / "outfile").write_text("x")
    for out in ("outfile", "outfile/sub"):
        with pytest.raises(ConfigError, match=r"outfile.*not a directory; export writes a directory .*give a new or an "
                                              r"existing directory path \(--out\)"):
            export_checkpoint(tmp_path / "no_checkpoint_here", None, tmp_path / out)
    with pytest.raises(SystemExit) as exit_:
        run_cli(export_main, [str(tmp_path / "no_checkpoint_here"), "--out", str(tmp_path / "outfile")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'outfile'}: exists and is a file" in err, err
    assert (tmp_path / "outfile").read_text() == "x"


def test_a_config_of_another_vocab_names_its_file_and_each_tensor_and_writes_nothing(tmp_path):
    _, state = _gpt2(tmp_path, vocab_size=32)
    edited, _ = _gpt2(tmp_path, vocab_size=40)
    with pytest.raises(ConfigError) as error:
        save_pretrained(edited, state, tmp_path / "out")
    message = str(error.value)
    assert message.startswith(f"{edited / 'config.json'}: 2 tensor(s) of the state have another shape than the "
                              "GPT2LMHeadModel this config builds"), message
    assert "transformer.wte.weight: [32, 16] stored, [40, 16] by the config" in message
    assert "lm_head.weight: [32, 16] stored, [40, 16] by the config" in message
    assert message.endswith("give the config the model was built from")
    assert not (tmp_path / "out").exists()


def test_a_config_of_another_width_lists_three_and_counts_the_rest(tmp_path):
    _, state = _gpt2(tmp_path, vocab_size=32, n_embd=16)
    wider, _ = _gpt2(tmp_path, vocab_size=32, n_embd=32)
    with pytest.raises(ConfigError, match=r"cfg_32_32/config\.json: \d+ tensor\(s\) .*\[32, 16\] stored, \[32, 32\] by "
                                          r"the config.*; and \d+ more\); give the config"):
        save_pretrained(wider, state, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_save_that_fails_midway_leaves_the_target_as_it_was(tmp_path, monkeypatch):
    """transformers writes config.json before the weights: a crash between them (a full disk) used to leave a config
    beside no or part of the weights, which from_pretrained loads with the missing tensors at their init."""
    import transformers
    import transformers.modeling_utils

    folder, state = _gpt2(tmp_path, vocab_size=32)
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    (existing / "tokenizer.json").write_text("{}")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)  # as transformers imports it
    for out in (fresh, existing):
        with pytest.raises(OSError, match="No space left"):
            save_pretrained(folder, state, out)
    assert not fresh.exists()
    assert sorted(p.name for p in existing.iterdir()) == ["tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")) == []  # no staging left behind

    monkeypatch.undo()
    save_pretrained(folder, state, existing)
    assert {"tokenizer.json", "config.json", "model.safetensors"} <= {p.name for p in existing.iterdir()}
    loaded = transformers.GPT2LMHeadModel.from_pretrained(existing).state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in state.items())
