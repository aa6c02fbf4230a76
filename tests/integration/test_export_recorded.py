"""`model-parallel export CKPT --out DIR` with no other flag: every checkpoint records the graph it trained and,
for a Hugging Face model, its config.json (runtime/checkpoint/model_files.py), so a 2-rank run's checkpoint
comes out as a `from_pretrained` directory (a GPT-2 built from a config) or a strict state dict (the zoo's MLP)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_parallel.api.export import checkpoint_stage_state, original_state_dict
from model_parallel.cli.export import main as export_main
from model_parallel.errors import CheckpointError, ConfigError
from model_parallel.runtime.checkpoint.layout import latest_step, step_dir
from model_parallel.runtime.checkpoint.model_files import GRAPH_FILE, HF_CONFIG_FILE, checkpoint_graph
from model_parallel.runtime.launch import launch_workers

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
TRAIN = ["--steps", "2", "--batch_size", "4", "--num_microbatches", "2", "--lr", "0.1", "--timeout", "60"]


def _recorded_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in the original model's names, through the graph it recorded."""
    graph = checkpoint_graph(step_dir(ckpt, latest_step(ckpt)))
    return original_state_dict(graph, checkpoint_stage_state(ckpt, graph))


def test_hf_checkpoint_exports_with_no_flag(tmp_path: Path) -> None:
    import transformers

    from model_parallel.cli.profile_hf import main as profile_main

    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, architectures=["GPT2LMHeadModel"])
    config.save_pretrained(tmp_path / "hf")
    graph = tmp_path / "run" / "graph.json"
    assert profile_main([str(tmp_path / "hf" / "config.json"), "--batch_size", "2", "--seq_len", "8",
                         "--iterations", "1", "--out", str(graph)]) == 0
    ckpt = tmp_path / "ckpt"
    result = launch_workers(["--graph", str(graph), "--loss", "lm", "--checkpoint_dir", str(ckpt), *TRAIN], 2,
                            timeout=300)
    assert result.ok, result.summary()
    folder = step_dir(ckpt, latest_step(ckpt))
    assert (folder / GRAPH_FILE).is_file() and (folder / HF_CONFIG_FILE).is_file()

    assert export_main([str(ckpt), "--out", str(tmp_path / "out")]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(back).__name__ == "GPT2LMHeadModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    want, loaded = _recorded_state(ckpt), back.state_dict()
    assert set(want) == set(loaded)
    assert all(torch.equal(loaded[k], want[k]) for k in want)  # bitwise: what the checkpoint holds
    initial = transformers.GPT2LMHeadModel(config).state_dict()
    assert not torch.equal(loaded["transformer.h.0.mlp.c_fc.weight"], initial["transformer.h.0.mlp.c_fc.weight"])

    # The recorded config.json edited to another vocab: one error naming that file and both shapes; nothing written.
    recorded = folder / HF_CONFIG_FILE
    recorded.write_text(recorded.read_text().replace('"vocab_size": 32', '"vocab_size": 40'))
    with pytest.raises(ConfigError, match=r"step_\d+/config\.json: 2 tensor\(s\) of the checkpoint .*"
                                          r"transformer\.wte\.weight: \[32, 16\] stored, \[40, 16\] by the config"):
        export_main([str(ckpt), "--out", str(tmp_path / "edited")])
    assert not (tmp_path / "edited").exists()


def test_zoo_checkpoint_exports_a_strict_state_dict_with_no_flag(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from model_parallel.runtime.build.zoo import recipe

    ckpt = tmp_path / "ckpt"
    result = launch_workers(["--model", "mlp", "--checkpoint_dir", str(ckpt), *TRAIN], 2, timeout=300)
    assert result.ok, result.summary()
    assert not (step_dir(ckpt, latest_step(ckpt)) / HF_CONFIG_FILE).exists()  # not a Hugging Face model
    assert export_main([str(ckpt), "--out", str(tmp_path / "out")]) == 0
    exported = load_file(tmp_path / "out" / "model.safetensors")
    model = recipe("mlp").model(5)
    model.load_state_dict(exported, strict=True)
    want = _recorded_state(ckpt)
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)

    # A checkpoint of a version that recorded no graph: the flag to pass, named; --graph still works.
    (step_dir(ckpt, latest_step(ckpt)) / GRAPH_FILE).rename(tmp_path / "graph.json")
    with pytest.raises(CheckpointError, match="records no graph.json.*pass --graph GRAPH"):
        export_main([str(ckpt), "--out", str(tmp_path / "x")])
    assert export_main([str(ckpt), "--graph", str(tmp_path / "graph.json"), "--out", str(tmp_path / "y")]) == 0
    assert load_file(tmp_path / "y" / "model.safetensors").keys() == exported.keys()
