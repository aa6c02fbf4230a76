"""Hugging Face on the command line (issue 35 part 6): `model-parallel profile-hf` profiles a model built
from its config with named inputs and saves its own initial values; the worker trains the graph with
`--single_process --weights` from them, a second input (`attention_mask`) included, exactly as the
unmodified model would; heads without a default loss are refused before any profiling."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_parallel.cli.profile_hf import main as profile_main
from model_parallel.errors import ConfigError


def _gpt2_dir(root: Path, architectures: str = "GPT2LMHeadModel") -> Path:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, architectures=[architectures])
    config.save_pretrained(root / "hf")
    return root / "hf"


@pytest.mark.slow
def test_profile_hf_then_single_process_training_from_its_initial_values(tmp_path: Path, capsys) -> None:
    import transformers
    from safetensors.torch import load_file

    from model_parallel.api.job import JobSpec, build_job
    from model_parallel.cli.worker import main as worker_main
    from model_parallel.models.gpt import lm_loss
    from model_parallel.runtime.config import TrainConfig
    from model_parallel.runtime.trainer import single_process_reference

    config_dir = _gpt2_dir(tmp_path)
    graph = tmp_path / "run" / "graph.json"
    assert profile_main([str(config_dir / "config.json"), "--inputs", "input_ids,attention_mask", "--batch_size", "2",
                         "--seq_len", "8", "--iterations", "1", "--seed", "3", "--out", str(graph)]) == 0
    assert "--loss lm" in capsys.readouterr().out
    inputs = json.loads(graph.read_text())["metadata"]["inputs"]
    assert [i["name"] for i in inputs] == ["input_ids", "attention_mask"]
    # transformers' own initialisation under --seed (its _init_weights: normal(0, 0.02), not a generic init)
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(transformers.AutoConfig.from_pretrained(config_dir))
    initial = load_file(tmp_path / "run" / "init.safetensors")
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())

    args = ["--graph", str(graph), "--weights", str(tmp_path / "run" / "init.safetensors"), "--single_process",
            "--steps", "2", "--loss", "lm", "--batch_size", "4", "--num_microbatches", "2", "--lr", "0.1"]
    assert worker_main(args) == 0
    printed = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", capsys.readouterr().out)]
    # The oracle: the unmodified model from those values, on the same data (both inputs), trained in one process.
    dataset = build_job(JobSpec(graph=graph, data="synthetic", batch_size=4, num_microbatches=2), 1).dataset
    assert set(dataset.batch(0)[0]) == {"input_ids", "attention_mask"}
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731 - the worker's defaults
    want = single_process_reference(model, lm_loss, sgd, dataset, TrainConfig(batch_size=4, num_microbatches=2), 2)
    assert printed == pytest.approx(want, abs=2e-6)

    # No --weights: the graph names its initial values beside it, the model's own initialisation.
    assert json.loads(graph.read_text())["metadata"]["initial_weights"] == "init.safetensors"
    without = args[:args.index("--weights")] + args[args.index("--weights") + 2:]
    assert worker_main(without) == 0
    assert [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", capsys.readouterr().out)] == printed

    # Another weights source: the same values as a sharded Hugging Face directory (the export's own output).
    from model_parallel.api.export import save_pretrained

    torch.manual_seed(3)
    fresh = transformers.GPT2LMHeadModel(transformers.AutoConfig.from_pretrained(config_dir))
    sharded = save_pretrained(fresh, fresh.state_dict(), tmp_path / "sharded", max_shard_size=10_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    args[args.index("--weights") + 1] = str(sharded)
    assert worker_main(args) == 0
    assert [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", capsys.readouterr().out)] == printed


def test_profile_hf_refuses_before_profiling(tmp_path: Path) -> None:
    bare = _gpt2_dir(tmp_path / "bare", "GPT2Model")
    with pytest.raises(ConfigError, match="GPT2Model has no default loss.*--model_class"):
        profile_main([str(bare), "--out", str(tmp_path / "g.json")])
    with pytest.raises(ConfigError, match="unknown input 'pixels'"):
        profile_main([str(_gpt2_dir(tmp_path)), "--inputs", "input_ids,pixels", "--out", str(tmp_path / "g.json")])
    with pytest.raises(ConfigError, match="no config.json"):
        profile_main([str(tmp_path), "--out", str(tmp_path / "g.json")])
    assert not (tmp_path / "g.json").exists()


def test_a_hugging_face_model_without_a_criterion_gets_its_heads_loss_or_a_refusal() -> None:
    import transformers

    from model_parallel.api.trainer import PipelineTrainer, TrainConfig
    from model_parallel.models.gpt import lm_loss
    from support.hf_zoo import CASES

    case = CASES["gpt2"]
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    with pytest.raises(ConfigError, match="GPT2Model has no default loss"):
        PipelineTrainer(transformers.GPT2Model(config), sgd, case.data, TrainConfig(batch_size=8, num_microbatches=2),
                        example_inputs=case.example(4), single_process=True)
    from model_parallel.api.hf_loss import default_criterion

    assert default_criterion(case.build(0)) is lm_loss and default_criterion(torch.nn.Linear(2, 2)) is F.cross_entropy


def test_named_synthetic_data_gives_every_graph_input_a_value_of_its_kind() -> None:
    from model_parallel.errors import DataError
    from model_parallel.runtime.data.named_data import NamedSyntheticData

    records = [{"name": "input_ids", "shape": [2, 5], "dtype": "int64"},
               {"name": "attention_mask", "shape": [2, 5], "dtype": "int64"},
               {"name": "token_type_ids", "shape": [2, 5], "dtype": "int64"}]
    data = NamedSyntheticData.from_graph_inputs(records, batch_size=4, num_classes=7, kind="tokens", seed=1)
    inputs, target = data.batch(3)
    assert list(inputs) == ["input_ids", "attention_mask", "token_type_ids"]
    assert inputs["input_ids"].shape == target.shape == (4, 5) and int(inputs["input_ids"].max()) < 7
    assert bool((inputs["attention_mask"] == 1).all()) and bool((inputs["token_type_ids"] == 0).all())
    again, _ = data.batch(3)
    assert torch.equal(again["input_ids"], inputs["input_ids"])  # the same on every rank and after a resume
    assert not torch.equal(data.batch(4)[0]["input_ids"], inputs["input_ids"])
    classes = NamedSyntheticData.from_graph_inputs(records[:1], 4, 3, "dense", 0).batch(0)[1]
    assert classes.shape == (4,)
    with pytest.raises(DataError, match="lack a name, shape or dtype"):
        NamedSyntheticData.from_graph_inputs([{"shape": [2]}], 4, 3, "tokens", 0)


def test_a_microbatch_size_the_graph_cannot_run_is_refused_before_training(tmp_path: Path, capsys) -> None:
    # A user's QA: profiled at --batch_size 4, trained at 8 / 4 microbatches: "shape '[4, 64, 192]' is invalid" at
    # step 0, and the resume advice failed the same way. torch.export keeps the traced size in the reshapes.
    from model_parallel.api.job import JobSpec, build_job
    from model_parallel.cli.worker import main as worker_main
    from model_parallel.models.mlp import StackedMLP
    from model_parallel.profiler.api import profile
    from model_parallel.graph.json_format import write_graph_json

    graph = tmp_path / "run" / "graph.json"
    assert profile_main([str(_gpt2_dir(tmp_path) / "config.json"), "--inputs", "input_ids", "--batch_size", "2",
                         "--seq_len", "8", "--iterations", "1", "--out", str(graph)]) == 0
    capsys.readouterr()
    args = ["--graph", str(graph), "--single_process", "--steps", "1", "--loss", "lm", "--num_microbatches", "2"]
    with pytest.raises(ConfigError, match=r"the model was traced at microbatches of 2 sample\(s\) and does not run at "
                                          r"this run's 4 \(batch size 8 / 2 microbatches: shape .*\); give batch size 4"):
        worker_main(args + ["--batch_size", "8"])  # the command line prints it and exits 2
    assert worker_main(args + ["--batch_size", "4"]) == 0  # the size it names runs
    # A graph that does not bake its size (an fx trace) runs at any microbatch size, as before.
    mlp = profile(StackedMLP(8, 16, 2, 4), (torch.randn(2, 8),), warmup=0, iterations=1)
    write_graph_json(mlp, tmp_path / "mlp.json")
    assert build_job(JobSpec(graph=tmp_path / "mlp.json", batch_size=12, num_microbatches=2), 1).plan.num_stages == 1
