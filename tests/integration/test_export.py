"""The trained model out (issue 35 part 4): `trainer.state_dict(original_names=True)` loads strictly into
the unmodified torchvision / timm / Hugging Face model, `trainer.save_pretrained(dir)` writes a directory
`from_pretrained` reads with no missing or unexpected key and bitwise-equal values (ties stored once; on several
ranks each rank writes its own stage's shards, api/shard_export.py), and
`model-parallel export` does both from a checkpoint directory without any worker."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_parallel.api.export import original_state_dict
from model_parallel.api.trainer import PipelineTrainer, TrainConfig
from model_parallel.cli.export import main as export_main
from model_parallel.errors import CheckpointError, ConfigError
from support.hf_zoo import CASES, Images, Tokens, class_loss, lm_loss

pytestmark = pytest.mark.slow  # each test profiles and trains a model in this process


def _train(model: torch.nn.Module, data, loss, example, num_stages: int = 2) -> PipelineTrainer:
    trainer = PipelineTrainer(model, lambda params: torch.optim.SGD(params, lr=0.5), data,
                              TrainConfig(batch_size=8, num_microbatches=2), criterion=loss, example_inputs=example,
                              single_process=True, num_stages=num_stages)
    trainer.train(2)
    return trainer


def _initial(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_trained(state: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], rebuilt: torch.nn.Module) -> None:
    """`state` has exactly the model's keys, training moved it, and `rebuilt` holds it bitwise."""
    assert list(state) == list(initial)
    assert any(not torch.equal(state[k], initial[k]) for k in state if state[k].is_floating_point())
    loaded = rebuilt.state_dict()
    different = [k for k in state if not torch.equal(loaded[k], state[k])]
    assert not different, different[:5]


def _bart() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bart"])
def test_save_pretrained_round_trips_through_from_pretrained(name: str, tmp_path: Path) -> None:
    if name == "bart":
        model, data = _bart(), Tokens("decoder_input_ids")
        example = {k: v[:4] for k, v in data.batch(0)[0].items()}
    else:
        case = CASES[name]
        model, data, example = case.build(0, tie=name == "gpt2"), case.data, case.example(4)
    initial = _initial(model)
    trainer = _train(model, data, lm_loss, example)
    state = trainer.state_dict(original_names=True)
    out = trainer.save_pretrained(tmp_path / "hf", max_shard_size=20_000)  # several shards and the index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and (out / "config.json").is_file()
    back, info = type(model).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    _check_trained(state, initial, back)
    if name == "gpt2":  # tied: one tensor, stored once, one tensor again after loading
        assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
        assert back.lm_head.weight is back.transformer.wte.weight


def test_state_dict_loads_strictly_into_an_unmodified_torchvision_model() -> None:
    from model_parallel.compat import import_torchvision

    torchvision = import_torchvision()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    initial = _initial(model)
    data = Images()
    trainer = _train(model, data, class_loss, (data.batch(0)[0][0][:4],))
    state = trainer.state_dict(original_names=True)
    fresh = torchvision.models.resnet18(num_classes=10)
    fresh.load_state_dict(state, strict=True)
    _check_trained(state, initial, fresh)  # running statistics (buffers) included


def test_state_dict_loads_strictly_into_an_unmodified_timm_model() -> None:
    case = CASES["vit"]
    model = case.build(0)
    initial = _initial(model)
    trainer = _train(model, case.data, case.loss, case.example(4))
    state = trainer.state_dict(original_names=True)
    fresh = case.build(7)
    fresh.load_state_dict(state, strict=True)
    _check_trained(state, initial, fresh)


def test_original_state_dict_refuses_a_model_it_does_not_fit() -> None:
    case = CASES["llama"]
    trainer = _train(case.build(0), case.data, case.loss, case.example(4))
    stage_state = trainer.state_dict()
    with pytest.raises(ConfigError, match="lacks.*profiled from another model"):
        original_state_dict(trainer.graph, stage_state, CASES["gpt2"].build(0))


def _checkpoint(trainer: PipelineTrainer, directory: Path, step: int) -> None:
    """What the workers write at a checkpoint (runtime/checkpoint/commit.py), one shard per stage."""
    from model_parallel.runtime.build.tied import without_aliases
    from model_parallel.runtime.checkpoint.resume import fingerprint
    from model_parallel.runtime.checkpoint.store import finalize, save_shard, split_state

    stages = trainer.runner.stages
    for rank, stage in enumerate(stages):
        params, buffers = (without_aliases(part, trainer.graph) for part in split_state(stage))
        save_shard(directory, step, rank, params, buffers)
    finalize(directory, step, {"world_size": len(stages)}, fingerprint(trainer.graph, trainer.model),
             expected_ranks=range(len(stages)))


def test_export_writes_a_checkpoint_out_without_workers(tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file

    from model_parallel.graph.json_format import write_graph_json

    case = CASES["gpt2"]
    model = case.build(0, tie=True)
    initial = _initial(model)
    trainer = _train(model, case.data, case.loss, case.example(4), num_stages=3)  # the tie across stages 0 and 2
    state = trainer.state_dict(original_names=True)
    _checkpoint(trainer, tmp_path / "ckpt", 2)
    write_graph_json(trainer.graph, tmp_path / "graph.json")
    model.config.save_pretrained(tmp_path / "config")  # a config without `architectures`: --model_class names it
    args = [str(tmp_path / "ckpt"), "--graph", str(tmp_path / "graph.json")]
    assert export_main(args + ["--out", str(tmp_path / "hf"), "--config", str(tmp_path / "config"),
                               "--model_class", "GPT2LMHeadModel", "--max_shard_size", "20KB"]) == 0
    back, info = type(model).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _check_trained(state, initial, back)

    assert export_main(args + ["--out", str(tmp_path / "plain")]) == 0  # no config: the state dict as safetensors
    fresh = case.build(3, tie=True)
    fresh.load_state_dict(load_file(tmp_path / "plain" / "model.safetensors"), strict=True)
    _check_trained(state, initial, fresh)
    assert "wrote" in capsys.readouterr().out

    with pytest.raises(ConfigError, match="names no model class.*--model_class"):
        export_main(args + ["--out", str(tmp_path / "x"), "--config", str(tmp_path / "config")])
    with pytest.raises(ConfigError, match="--max_shard_size '5 parsecs'"):
        export_main(args + ["--out", str(tmp_path / "x"), "--max_shard_size", "5 parsecs"])
    llama = _train(CASES["llama"].build(0), CASES["llama"].data, lm_loss, CASES["llama"].example(4))
    write_graph_json(llama.graph, tmp_path / "llama.json")
    with pytest.raises(CheckpointError, match="does not hold the graph's parameters.*pass the graph the run trained"):
        export_main([str(tmp_path / "ckpt"), "--graph", str(tmp_path / "llama.json"), "--out", str(tmp_path / "x")])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_save_pretrained_on_several_processes_writes_each_stage_on_its_rank(tmp_path: Path, world: int) -> None:
    """Each rank holds one stage and writes only its own shards, rank 0 the index and config: what transformers'
    save_pretrained writes (keys, a tie split across the ranks stored once, total_size, config), bitwise the stages'
    values (GPT-2 and T5 tied, Llama untied; with 3 ranks GPT-2's stage 0 replicated: written once); a write that
    fails on one rank fails the call on every rank, naming that rank, and leaves no directory; one every rank
    refuses alike (a bad max_shard_size) raises that error itself (ConfigError) on every rank."""
    import dataclasses
    import sys

    from model_parallel.codegen.naming import original_state_from_stage
    from model_parallel.graph.plan import Plan, write_plan
    from model_parallel.profiler.trace import trace_model
    from model_parallel.runtime.build.stages import even_plan
    from model_parallel.runtime.launch import free_port, launch
    from support import hf_worker as worker

    names = {"gpt2+tied": CASES["gpt2"].build(tie=True)}
    if world == 2:  # T5: one tensor under four keys, encoder and decoder
        names.update({"llama": CASES["llama"].build(), "t5+tied": CASES["t5"].build(tie=True)})
    graphs = {}
    for name, model in names.items():
        graphs[name], _ = trace_model(model, CASES[name.split("+")[0]].example(worker.BATCH // worker.MICROBATCHES))
        plan = even_plan(graphs[name], 2)
        if world == 3:
            first, second = plan.stages
            plan = Plan((dataclasses.replace(first, num_replicas=2, ranks=(0, 1)), dataclasses.replace(second, ranks=(2,))))
        write_plan(plan, tmp_path / f"{name}.plan.json")
    script = Path(__file__).parents[1] / "support" / "hf_worker.py"
    port = free_port()
    result = launch([[sys.executable, str(script), str(rank), str(world), str(port), str(tmp_path), ",".join(names),
                      "save_pretrained"] for rank in range(world)], timeout=500)
    assert result.ok, result.summary()
    for name, model in names.items():
        out = tmp_path / f"{name}-hf"
        stages = [torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=True)["state"] for rank in range(world)]
        assert all(stages)  # every rank held part of the model
        held = [set(original_state_from_stage(graphs[name], s)) for s in stages]
        assert len({frozenset(h) for h in held}) == 2  # two stages (with 3 ranks: ranks 0 and 1 hold the same)
        trained = original_state_from_stage(graphs[name], {k: v for s in stages for k, v in s.items()})
        back, info = type(model).from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        loaded, initial = back.state_dict(), _initial(model)
        assert set(loaded) == set(trained) == set(initial)
        assert all(torch.equal(loaded[k], trained[k]) for k in trained)  # bitwise: what the stages hold
        assert any(not torch.equal(loaded[k], initial[k]) for k in trained)  # trained, not the initial model
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files: dict[str, list[str]] = {}
        for key, file in index["weight_map"].items():
            files.setdefault(file, []).append(key)
        assert len(files) > 2 and set(files) == {p.name for p in out.glob("model-*.safetensors")}
        assert all(any(set(keys) <= h for h in held) for keys in files.values())  # a file is one rank's tensors
        assert any(set(keys) <= held[0] - held[-1] for keys in files.values())  # both stages wrote their own
        assert any(set(keys) <= held[-1] - held[0] for keys in files.values())
        back.save_pretrained(tmp_path / f"{name}-reference", max_shard_size=20_000)  # what transformers writes
        reference = json.loads((tmp_path / f"{name}-reference" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(reference["weight_map"])  # the same tied keys dropped
        assert index["metadata"] == reference["metadata"]  # total_size, total_parameters
        for config in ("config.json", "generation_config.json"):
            assert json.loads((out / config).read_text()) == json.loads(
                (tmp_path / f"{name}-reference" / config).read_text())
        if name.endswith("+tied"):  # tied: one tensor, stored once, one tensor again after loading
            assert "lm_head.weight" not in index["weight_map"]
            assert back.get_output_embeddings().weight is back.get_input_embeddings().weight
        else:
            assert "lm_head.weight" in index["weight_map"]
        for rank in range(world):
            message = (tmp_path / f"{name}-broken.rank{rank}.txt").read_text()
            assert message.startswith("CheckpointError: save_pretrained failed writing its shards on rank(s) [1]")
            assert "No space left on device (injected)" in message
            assert message.splitlines()[-1].startswith("ConfigError: max_shard_size '5 parsecs'")
        assert not (tmp_path / f"{name}-broken").exists()
        assert not list(tmp_path.glob(f".{name}-broken.*"))  # the temporary directory removed too
