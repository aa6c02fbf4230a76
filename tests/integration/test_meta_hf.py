"""Hugging Face models built on meta train exactly: fresh init, save_pretrained safetensors, one stage per rank.

`with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)` goes through the torch.export route,
whose graph reads parameters as bare tensors and writes the traced-on device into operators. Checked
here: the graph records that device as "run" (no `meta` left for training to run on); with no
`init_weights` a bare tensor gets the model's own `_init_weights` (`hf_init_weights`, the default for a
`PreTrainedModel`: GPT-2's Conv1D, Llama's RMSNorm and rotary table have no reset_parameters()), under
the layer's seed, so the pipeline equals `materialize_model` + `single_process_reference` whatever the
partition; an explicit `init_weights` overrides it; weights from `save_pretrained` equal the real
model's training (Llama's rotary table, in no weight file, by the default rule); and on 2 ranks each
rank holds only its stage.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import model_parallel  # noqa: F401  (installs the torchvision repair: transformers imports below)
import transformers  # noqa: E402
from model_parallel import PipelineTrainer, TrainConfig  # noqa: E402
from model_parallel.codegen.naming import stage_state_from_original  # noqa: E402
from model_parallel.errors import GraphError, InitError  # noqa: E402
from model_parallel.graph.arguments import decode_argument  # noqa: E402
from model_parallel.graph.io import load_graph, save_graph  # noqa: E402
from model_parallel.graph.json_format import graph_to_dict  # noqa: E402
from model_parallel.runtime.build.materialize import materialize_model  # noqa: E402
from model_parallel.runtime.launch import free_port, launch  # noqa: E402
from model_parallel.runtime.trainer import single_process_reference  # noqa: E402

VOCAB, SEQ, SEED, STEPS = 64, 8, 3, 4
CONFIG = TrainConfig(batch_size=4, num_microbatches=2, seed=SEED)
EXAMPLE = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long)}


def hf_config(name: str):
    if name in ("gpt2", "gpt2_tied"):  # tied: the head on the last rank takes the embedding's init from rank 0's rule
        return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=name == "gpt2_tied",
                                       bos_token_id=0, eos_token_id=0)
    if name == "opt":
        return transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
                                      vocab_size=VOCAB, max_position_embeddings=16, word_embed_proj_dim=32, dropout=0.0,
                                      attention_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=16,
                                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def meta_model(name: str):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config(name))


class Data:
    def batch(self, step: int):
        ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss(out, target):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), target.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def reference(name: str, model, graph, weights=None):
    """The single-process oracle: the meta model materialized by the same rule (or the real model), trained."""
    if weights is None:
        ref = copy.deepcopy(model)
        materialize_model(ref, SEED, graph)  # no hook: the HF default, as in the pipeline
    else:
        ref = weights
    initial = {k: v.clone() for k, v in stage_state_from_original(graph, ref.state_dict(), strict=False).items()}
    single_process_reference(ref, loss, sgd, Data(), CONFIG, STEPS)
    return initial, stage_state_from_original(graph, ref.state_dict(), strict=False)


def assert_close(state, want, what):
    assert state.keys() <= want.keys(), (what, sorted(state.keys() - want.keys()))
    for key, value in state.items():
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-7, msg=f"{what}: {key}")


def train(model, num_stages, init_weights=None, weights=None, steps=STEPS):
    with PipelineTrainer(model, sgd, Data(), CONFIG, criterion=loss, example_inputs=EXAMPLE, num_stages=num_stages,
                         init_weights=init_weights, weights=weights) as trainer:
        initial = {k: v.clone() for k, v in trainer.state_dict().items()}
        trainer.train(steps)
        return trainer.graph, initial, trainer.state_dict()


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt"])
def test_fresh_init_of_a_meta_model_trains_like_the_reference_and_ignores_the_partition(name):
    model = meta_model(name)
    pristine = copy.deepcopy(model)  # the single-process trainer materializes the model it is given
    graph, initial, trained = train(model, 2)  # no init_weights: HF's own init by default
    want_initial, want_trained = reference(name, pristine, graph)
    assert_close(initial, want_initial, "initial values")
    assert_close(trained, want_trained, f"after {STEPS} steps")
    other = copy.deepcopy(pristine)
    _, initial_3, _ = train(other, 3, steps=0)
    assert initial_3.keys() == initial.keys()
    assert all(torch.equal(initial_3[k], initial[k]) for k in initial)


def test_the_default_init_is_the_models_own_and_an_explicit_hook_overrides_it():
    gpt2 = meta_model("gpt2")
    graph, initial, _ = train(gpt2, 1, steps=0)
    attn, proj = initial["transformer_h_0_attn_c_attn_weight"], initial["transformer_h_0_attn_c_proj_weight"]
    assert proj.std() < 0.014 < attn.std()  # GPT-2 scales c_proj by 1/sqrt(2 * n_layer): 0.01 against 0.02
    assert torch.equal(initial["transformer_h_0_ln_1_weight"], torch.ones(32))
    explicit = meta_model("gpt2")
    _, same, _ = train(explicit, 1, model_parallel.hf_init_weights(explicit), steps=0)
    assert same.keys() == initial.keys() and all(torch.equal(same[k], initial[k]) for k in initial)
    llama = meta_model("llama")
    ref = copy.deepcopy(llama)
    materialize_model(ref, SEED)
    real = transformers.AutoModelForCausalLM.from_config(hf_config("llama"))
    torch.testing.assert_close(ref.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    assert torch.equal(ref.model.norm.weight, torch.ones(32))

    def halves(layer, name):  # the user's hook replaces HF's rule, for every tensor
        for tensor in [layer] if isinstance(layer, torch.Tensor) else [*layer.parameters(), *layer.buffers()]:
            tensor.fill_(0.5)

    _, mine, _ = train(meta_model("gpt2"), 2, halves, steps=0)
    assert mine.keys() == initial.keys() and all(torch.equal(v, torch.full_like(v, 0.5)) for v in mine.values())
    ref = materialize_model(meta_model("llama"), SEED, init_weights=halves)
    assert torch.equal(ref.model.rotary_emb.inv_freq, torch.full_like(ref.model.rotary_emb.inv_freq, 0.5))


def test_a_module_without_reset_parameters_is_named_with_the_fix():
    class Scaled(torch.nn.Module):  # no Hugging Face model: no default hook, and `scale` has no rule
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.empty(4))

        def forward(self, x):
            return self.fc(x) * self.scale

    class Dense:
        def batch(self, step: int):
            return (torch.zeros(4, 4),), torch.zeros(4, 4)

    with torch.device("meta"):
        scaled = Scaled()
    with pytest.raises(InitError, match=r"layer 'scale' .*\('scale' of a Scaled, which has no reset_parameters\(\)\)"):
        PipelineTrainer(scaled, sgd, Dense(), CONFIG, criterion=F.mse_loss, example_inputs=(torch.zeros(2, 4),),
                        num_stages=1)
    with pytest.raises(InitError, match="is not a Hugging Face PreTrainedModel"):
        model_parallel.hf_init_weights(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_save_pretrained_weights_train_like_the_real_model(name, tmp_path):
    torch.manual_seed(0)
    real = transformers.AutoModelForCausalLM.from_config(hf_config(name))
    real.save_pretrained(tmp_path / "hf")
    model = meta_model(name)
    # Llama's rotary table is no weight (a non-persistent buffer): HF's init computes it, by default.
    graph, initial, trained = train(model, 2, weights=tmp_path / "hf")
    want_initial, want_trained = reference(name, None, graph, weights=real)
    assert_close(initial, want_initial, "initial values")
    assert_close(trained, want_trained, f"after {STEPS} steps")


def test_a_graph_traced_on_meta_records_the_run_device_and_loads_back(tmp_path):
    model = meta_model("gpt2")
    graph = model_parallel.trace_model(model, (), example_kwargs={k: v.to("meta") for k, v in EXAMPLE.items()})[0]
    text = json.dumps(graph_to_dict(graph))
    assert '"device": "meta"' not in text and '"device": "run"' in text
    assert load_graph(save_graph(graph, tmp_path / "graph.json")) == graph  # the loader's checks accept it
    with pytest.raises(GraphError, match="only known where a stage is built"):
        decode_argument({"device": "run"}, lambda ref: None)
    assert decode_argument({"device": "run"}, lambda ref: None, lambda: torch.device("cpu")) == torch.device("cpu")


# Each rank builds the meta model and trains its stage; it checks that only its stage's parameters have
# storage (their bytes are the stage's share) and saves its trained state for the test to compare.
_WORKER = r'''
import sys
from datetime import timedelta
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
import test_meta_hf as t
from model_parallel import PipelineTrainer, RunOptions
from model_parallel.runtime.build.stages import stage_layers

torch.set_num_threads(1)
rank, world, port, tmp, name, weights = int(sys.argv[1]), 2, int(sys.argv[3]), sys.argv[5], sys.argv[6], sys.argv[7]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=120))
model = t.meta_model(name)
trainer = PipelineTrainer(model, t.sgd, t.Data(), t.CONFIG, criterion=t.loss, example_inputs=t.EXAMPLE, num_stages=2,
                          weights=None if weights == "-" else weights,
                          options=RunOptions(timeout=120, progress=False))
engine = trainer.runner
mine = set(stage_layers(engine.graph, engine.plan, engine.stage_id))
share = sum(p.numel() * p.element_size() for n, obj in engine.modules.items() if n in mine
            for p in ([obj] if isinstance(obj, torch.Tensor) else obj.parameters()) if isinstance(p, torch.nn.Parameter))
params = {id(p): p for obj in engine.modules.values() for p in ([obj] if isinstance(obj, torch.Tensor) else obj.parameters())
          if isinstance(p, torch.nn.Parameter)}
held = sum(p.numel() * p.element_size() for p in params.values() if not p.is_meta)
held_model = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
assert held == share > 0 and held_model == 0, (rank, held, share, held_model)
trainer.train(t.STEPS)
torch.save(trainer.state_dict(), f"{tmp}/{name}-{weights != '-'}-rank{rank}.pt")
trainer.close()
print("ok", rank, held, share, flush=True)
'''


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "gpt2_tied", "llama"])
@pytest.mark.parametrize("stored", [False, True], ids=["fresh", "safetensors"])
def test_two_ranks_hold_only_their_stage_and_train_like_the_reference(name, stored, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    weights = "-"
    real = None
    if stored:
        torch.manual_seed(0)
        real = transformers.AutoModelForCausalLM.from_config(hf_config(name))
        real.save_pretrained(tmp_path / "hf")
        weights = str(tmp_path / "hf")
    port = free_port()
    result = launch([[sys.executable, str(script), str(r), "2", str(port), str(Path(__file__).parent), str(tmp_path),
                      name, weights] for r in range(2)], timeout=300)
    assert result.ok, result.summary()
    model = meta_model(name)
    graph = model_parallel.trace_model(model, (), example_kwargs={k: v.to("meta") for k, v in EXAMPLE.items()})[0]
    _, want = reference(name, model, graph, weights=real)
    for rank in range(2):
        state = torch.load(tmp_path / f"{name}-{stored}-rank{rank}.pt", weights_only=True)
        assert state, rank
        assert_close(state, want, f"rank {rank}")
