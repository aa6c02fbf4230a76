"""Models built on meta: the per-layer init rule, stored weights (safetensors, checkpoints), and ranks
that allocate only their own stage's layers (runtime/build/materialize.py, runtime/build/weights.py)."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from model_parallel.codegen.naming import state_key_map
from model_parallel.models import TinyGPT
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build import weights
from model_parallel.runtime.build.materialize import (
    InitError,
    Initializer,
    allocate_layers,
    layer_seed,
    materialize_layers,
    materialize_model,
    release_layers,
)
from model_parallel.runtime.build.stages import even_plan, layer_modules, stage_layers
from model_parallel.runtime.build.weights import CheckpointValues, SafetensorsValues
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.checkpoint.store import finalize, save_shard
from model_parallel.runtime.launch import free_port, launch

GPT = dict(vocab_size=64, seq_len=8, dim=16, num_heads=2, num_layers=4)


def meta_gpt():
    with torch.device("meta"):
        model = TinyGPT(**GPT)
    graph, _ = trace_model(model, (torch.zeros(2, GPT["seq_len"], dtype=torch.long, device="meta"),))
    return model, graph


def real_gpt(seed: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(**GPT)


def test_layer_seed_is_a_stable_hash_of_seed_and_name():
    assert layer_seed(0, "blocks_0_fc") == layer_seed(0, "blocks_0_fc")
    assert layer_seed(0, "blocks_0_fc") != layer_seed(1, "blocks_0_fc") != layer_seed(0, "blocks_1_fc")
    assert layer_seed(0, "x") == 5154572919779615919  # sha256("0/x"): the same in every process, on every machine
    assert 0 <= layer_seed(12345, "head") < 2**63


@pytest.mark.parametrize("num_stages", [2, 4])
def test_the_init_rule_does_not_depend_on_the_partition_or_the_order(num_stages):
    model, graph = meta_gpt()
    whole = materialize_model(copy.deepcopy(model), seed=5, graph=graph)
    plan = even_plan(graph, num_stages)
    layers = layer_modules(graph, model)
    for stage in reversed(range(num_stages)):  # last stage first, each stage's layers backwards
        materialize_layers(layers, list(reversed(stage_layers(graph, plan, stage))), Initializer(5), graph=graph)
    assert not any(p.is_meta for p in model.parameters())
    for (name, want), got in zip(whole.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name
    # ... and the built-in models' reference (Recipe.model) follows the same rule without a graph
    r = recipe("gpt")
    meta = r.meta_model()
    traced, _ = trace_model(meta, tuple(x.to("meta") for x in r.example(2)))
    for (name, want), got in zip(r.model(3).state_dict().items(), materialize_model(meta, 3, traced).state_dict().values()):
        assert torch.equal(got, want), name


def test_a_materialized_model_keeps_its_values_and_a_bare_parameter_needs_the_hook():
    model = real_gpt()
    before = copy.deepcopy(model.state_dict())
    materialize_model(model, seed=0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.empty(4))

        def forward(self, x):
            return self.fc(x) * self.scale

    with torch.device("meta"):
        scaled = Scaled()
    with pytest.raises(InitError, match=r"layer 'scale' is a bare tensor of shape \(4,\).*init_weights=fn\(layer, layer_name\)"):
        materialize_model(copy.deepcopy(scaled), seed=0)

    def init_weights(layer, name):
        if name == "scale":
            layer.fill_(2.0)
        else:
            layer.reset_parameters()

    done = materialize_model(copy.deepcopy(scaled), seed=0, init_weights=init_weights)
    assert torch.equal(done.scale, torch.full((4,), 2.0)) and isinstance(done.scale, nn.Parameter)
    again = materialize_model(copy.deepcopy(scaled), seed=0, init_weights=init_weights)
    assert torch.equal(done.fc.weight, again.fc.weight)


def test_release_and_allocate_keep_parameters_trainable_and_free_storage():
    model, graph = meta_gpt()
    layers = layer_modules(graph, model)
    names = list(layers)[:3]
    allocate_layers(layers, names, torch.device("cpu"))
    assert all(not p.is_meta for n in names for p in layers[n].parameters())
    release_layers(layers, names)
    assert all(p.is_meta and isinstance(p, nn.Parameter) for n in names for p in layers[n].parameters())
    allocate_layers(layers, names, torch.device("cpu"))
    assert all(p.requires_grad and isinstance(p, nn.Parameter) for n in names for p in layers[n].parameters())


def write_sharded(directory: Path, model: nn.Module, num_files: int = 3) -> None:
    """An HF-style sharded directory: model-0000k-of-0000n.safetensors + model.safetensors.index.json."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    weight_map = {}
    for k in range(num_files):
        file = f"model-{k + 1:05d}-of-{num_files:05d}.safetensors"
        part = names[k::num_files]
        save_file({n: state[n] for n in part}, str(directory / file))
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_sharded_safetensors_directory_is_read_only_for_the_owned_tensors(tmp_path, monkeypatch):
    source_model = real_gpt()
    write_sharded(tmp_path, source_model)
    model, graph = meta_gpt()
    read: list[str] = []
    real_open = weights.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(weights, "safe_open", Spy)
    plan = even_plan(graph, 3)
    layers = layer_modules(graph, model)
    owned = stage_layers(graph, plan, 1)
    materialize_layers(layers, owned, Initializer(0, source=SafetensorsValues(tmp_path, graph)), graph=graph)
    reverse = {v: k for k, v in state_key_map(graph).items()}
    want = sorted(reverse[k] for n in owned for k in [f"{n}.{p}" for p in layers[n].state_dict()])
    assert sorted(read) == want and len(read) < len(source_model.state_dict()) / 2
    original = source_model.state_dict()
    for name in want:
        layer, _, key = state_key_map(graph)[name].partition(".")
        assert torch.equal(layers[layer].state_dict()[key], original[name]), name
    assert all(p.is_meta for n in layers if n not in owned for p in layers[n].parameters())


def test_a_missing_or_misshaped_tensor_names_it_and_the_file(tmp_path):
    model, graph = meta_gpt()
    state = dict(real_gpt().state_dict())
    state.pop("head.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(InitError, match=r"model\.safetensors: no tensor for stage key 'head\.weight' \(looked for 'head\.weight'\)"):
        materialize_model(copy.deepcopy(model), 0, graph, source=SafetensorsValues(tmp_path / "model.safetensors", graph))
    state["head.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(InitError, match=r"model\.safetensors: tensor 'head\.weight' .* has shape \(3, 3\), the model expects \(64, 16\)"):
        materialize_model(copy.deepcopy(model), 0, graph, source=SafetensorsValues(tmp_path, graph))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"head.weight": "../x.safetensors"}}))
    with pytest.raises(InitError, match=r"tensor 'head.weight' names file '\.\./x\.safetensors'"):
        SafetensorsValues(tmp_path, graph)


def write_checkpoint(directory: Path, model: nn.Module, graph) -> None:
    mapping = state_key_map(graph)
    params = {mapping[k]: v for k, v in model.named_parameters()}
    save_shard(directory, 0, 0, params)
    finalize(directory, 0, {"world_size": 1}, None)


def test_a_checkpoint_gives_a_stage_exactly_its_values(tmp_path):
    source_model = real_gpt()
    model, graph = meta_gpt()
    write_checkpoint(tmp_path, source_model, graph)
    assert isinstance(weights.weight_source(tmp_path, graph), CheckpointValues)
    done = materialize_model(model, 0, graph, source=CheckpointValues(tmp_path, graph=graph))
    for (name, want), got in zip(source_model.state_dict().items(), done.state_dict().values()):
        assert torch.equal(got, want), name


# ---- ranks ---------------------------------------------------------------------------------------------
# Each rank builds the model on meta and an engine for an even split, three times (fresh init, our
# checkpoint, sharded safetensors), and checks: only its stage's parameters have storage (their bytes
# are exactly the stage's share), their values equal the single-process reference, safetensors reads
# only its tensors; then a live switch to another plan keeps all of that true.
_WORKER = r'''
import copy, sys
from dataclasses import replace
from datetime import timedelta
import torch, torch.distributed as dist
from safetensors.torch import load_file
sys.path.insert(0, sys.argv[4])
from test_meta_init import meta_gpt, real_gpt
from model_parallel.codegen.naming import state_key_map
from model_parallel.runtime.build import weights
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.data.batches import SyntheticData
from model_parallel.runtime.engine import PipelineEngine
from model_parallel.runtime.build.materialize import Initializer, materialize_model
from model_parallel.runtime.wire.migration import switch_plan
from model_parallel.runtime.build.stages import even_plan, stage_layers

torch.set_num_threads(1)
rank, world, port, tmp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
read = []
real_open = weights.safe_open
class Spy:
    def __init__(self, *a, **k): self.inner = real_open(*a, **k)
    def __enter__(self): return self
    def __exit__(self, *e): return self.inner.__exit__(*e)
    def keys(self): return self.inner.keys()
    def get_tensor(self, name):
        read.append(name)
        return self.inner.get_tensor(name)
weights.safe_open = Spy

def check(engine, want, what):
    names = set(stage_layers(engine.graph, engine.plan, engine.stage_id))
    share = sum(p.numel() * 4 for n, obj in engine.modules.items() if n in names for p in obj.parameters())
    held = sum(p.numel() * 4 for obj in engine.modules.values() for p in obj.parameters() if not p.is_meta)
    assert held == share, (what, rank, held, share)
    assert all(p.is_meta for n, obj in engine.modules.items() if n not in names for p in obj.parameters()), (what, rank)
    for key, value in engine.named_state().items():
        assert torch.allclose(value, want[key], rtol=0, atol=1e-6), (what, rank, key)
    return held

model, graph = meta_gpt()
mapping = state_key_map(graph)
fresh = materialize_model(copy.deepcopy(model), 11, graph)
stored = real_gpt()
references = {"fresh": ({mapping[k]: v for k, v in fresh.state_dict().items()}, Initializer(11)),
              "checkpoint": ({mapping[k]: v for k, v in stored.state_dict().items()},
                             Initializer(11, source=weights.weight_source(tmp + "/checkpoint", graph))),
              "safetensors": ({mapping[k]: v for k, v in stored.state_dict().items()},
                              Initializer(11, source=weights.weight_source(tmp + "/sharded", graph)))}
data = SyntheticData(4, (8,), 64, "tokens", seed=0)
for what, (want, init) in references.items():
    read.clear()
    engine = PipelineEngine(graph=graph, plan=even_plan(graph, world), model=copy.deepcopy(model), criterion=lambda o, t: o.sum(),
                            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1), dataset=data,
                            config=TrainConfig(batch_size=4, num_microbatches=2, seed=11), initializer=init)
    before = check(engine, want, what)
    if what == "safetensors":
        owned = sorted(k for k, v in mapping.items() if v.partition(".")[0] in stage_layers(graph, engine.plan, engine.stage_id))
        assert sorted(read) == owned, (rank, read, owned)
    if world == 2:  # swap the ranks: every layer moves
        base = even_plan(graph, 2).with_default_ranks()
        other = replace(base, version=1, stages=tuple(replace(s, ranks=(1 - s.ranks[0],)) for s in base.stages))
    else:  # two stages of two replicas: ranks 1 and 2 receive layers they never held
        other = replace(even_plan(graph, 2, {0: 2, 1: 2}).with_default_ranks(), version=1)
    switch_plan(engine, other)
    after = check(engine, want, what + " after a switch")
    print(f"rank {rank} {what}: {before} bytes before, {after} after", flush=True)
dist.barrier()
dist.destroy_process_group()
print("ok", rank, flush=True)
'''


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_materializes_only_its_stage_with_the_reference_values(tmp_path, world):
    stored = real_gpt()
    _, graph = meta_gpt()
    (tmp_path / "sharded").mkdir()
    write_sharded(tmp_path / "sharded", stored)
    write_checkpoint(tmp_path / "checkpoint", stored, graph)
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = free_port()
    commands = [[sys.executable, str(script), str(r), str(world), str(port), str(Path(__file__).parent), str(tmp_path)]
                for r in range(world)]
    result = launch(commands, timeout=240)
    assert result.ok, result.summary()
    for worker in result.workers:
        assert f"ok {worker.rank}" in worker.output, worker.output
