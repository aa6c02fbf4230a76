"""Unmodified Hugging Face and timm models: profiled through torch.export, rebuilt from the graph exactly
(whole, split in two, from graph.json, as a generated package), trained in single-process mode like the
original; non-persistent buffers keep their values on every path; dict inputs and ModelOutputs work."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import model_parallel  # noqa: F401  (installs the torchvision repair: transformers and timm import below)
from model_parallel.codegen.build import build_stages, full_model_from_graph
from model_parallel.codegen.naming import original_state_from_stage, stage_state_from_original
from model_parallel.codegen.package import generate_package, import_package
from model_parallel.errors import GraphFormatError, ProfileError, TiedParameterError
from model_parallel.graph.arguments import OutputDict, decode_argument
from model_parallel.graph.json_format import read_graph_json, write_graph_json
from model_parallel.graph.loader import function_target
from model_parallel.graph.plan import plan_from_graph
from model_parallel.profiler.api import profile
from model_parallel.profiler.trace import flat_inputs, trace_model
from model_parallel.runtime.data.batches import split_microbatches

import timm  # noqa: E402  (after model_parallel, which makes their torchvision import work)
import transformers  # noqa: E402

VOCAB, SEQ = 100, 8


def _ids(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _mask() -> torch.Tensor:
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 5:] = 0
    return mask


def gpt2(tie: bool = True) -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=tie))


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16))


def bert(tie: bool = True) -> nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=tie))


def opt() -> nn.Module:
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, word_embed_proj_dim=32))


def t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=VOCAB,
        dropout_rate=0.0, decoder_start_token_id=0))


def vit() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10)


def efficientnet() -> nn.Module:
    return timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)


# name -> (model factory, example inputs: a tuple of positional inputs or a dict of keyword inputs)
CASES = {
    "gpt2": (gpt2, lambda: (_ids(),)),
    "llama": (llama, lambda: (_ids(),)),
    "bert-mlm": (bert, lambda: {"input_ids": _ids(), "attention_mask": _mask()}),
    "opt": (opt, lambda: (_ids(),)),
    "t5": (t5, lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(1)}),
    "vit": (vit, lambda: (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)),
    "efficientnet": (efficientnet, lambda: (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)),
}


def _run(model: nn.Module, inputs: object) -> torch.Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


def _chain(stages: list[nn.Module], graph: object, inputs: object) -> object:
    values = list(flat_inputs(inputs))
    for stage in stages:
        values = list(stage(*values))
    by_name = dict(zip(stages[-1].output_names, values))
    return decode_argument(graph.metadata["outputs"], by_name.__getitem__)


def _cut_before(graph: object, prefix: str) -> dict[str, int]:
    """Two stages: everything before the first node reading a parameter under `prefix` (a block) is stage 0."""
    order = graph.topological_order
    first = next(i for i, n in enumerate(order) if graph[n].layer.op == "get_attr" and graph[n].layer.target.startswith(prefix))
    return {n: int(i >= first) for i, n in enumerate(order)}


@pytest.mark.parametrize("name", list(CASES))
def test_unmodified_model_traces_and_the_graph_rebuilds_it_exactly(name: str) -> None:
    torch.manual_seed(0)
    factory, make_inputs = CASES[name]
    model, inputs = factory().train(), make_inputs()
    graph, _ = trace_model(model, inputs)
    assert graph.metadata["route"] == "export"  # HF models by choice; timm's optional arguments defeat fx
    full = full_model_from_graph(graph).train()
    full.load_state_dict(stage_state_from_original(graph, model.state_dict()), strict=True)
    out = full(*flat_inputs(inputs))
    torch.testing.assert_close(out if isinstance(out, torch.Tensor) else out.logits, _run(model, inputs), rtol=1e-5, atol=1e-5)
    assert original_state_from_stage(graph, full.state_dict()).keys() == model.state_dict().keys()


def test_non_persistent_rotary_buffer_keeps_its_value_through_graph_json_and_a_package(tmp_path: object) -> None:
    torch.manual_seed(0)
    model = llama().train()
    graph, _ = trace_model(model, (_ids(),))
    assert list(graph.metadata["constants"]) == ["model.rotary_emb.inv_freq"]
    write_graph_json(graph, tmp_path / "graph.json")
    loaded = read_graph_json(tmp_path / "graph.json")  # no model object: the value comes from the file
    full = full_model_from_graph(loaded)
    assert torch.equal(full.model_rotary_emb_inv_freq, model.model.rotary_emb.inv_freq)  # was torch.empty
    full.load_state_dict(stage_state_from_original(loaded, model.state_dict()), strict=True)  # was: a missing key
    torch.testing.assert_close(full(_ids()).logits, model(_ids()).logits, rtol=1e-5, atol=1e-5)
    stage_of = _cut_before(loaded, "model.layers.1.")
    generate_package(loaded.with_stages(stage_of), plan_from_graph(loaded.with_stages(stage_of)), tmp_path / "pkg",
                     "TinyLlama", "tinyllama")
    package = import_package(tmp_path / "pkg")
    stage = next(m for m in package.full_model().modules() if hasattr(m, "model_rotary_emb_inv_freq"))
    assert torch.equal(stage.model_rotary_emb_inv_freq, model.model.rotary_emb.inv_freq)  # was torch.empty
    assert "model_rotary_emb_inv_freq" not in stage.state_dict()


def test_a_too_large_constant_is_refused_loudly_without_the_model() -> None:
    torch.manual_seed(0)
    model = llama()
    graph, _ = trace_model(model, (_ids(),))
    record = dict(graph.metadata["constants"]["model.rotary_emb.inv_freq"])
    del record["values"]  # what the profiler writes for a constant above MAX_CONSTANT_ELEMENTS
    big = type(graph)(graph.nodes, graph.edges, {**graph.metadata, "constants": {"model.rotary_emb.inv_freq": record}})
    with pytest.raises(Exception, match=r"constant 'model.rotary_emb.inv_freq'.*too large.*source_model="):
        full_model_from_graph(big)
    full_model_from_graph(big, source_model=model)  # the remedy works


@pytest.mark.parametrize("name, factory, inputs, block", [
    ("gpt2-untied", lambda: gpt2(tie=False), lambda: (_ids(),), "transformer.h.1."),
    ("llama", llama, lambda: (_ids(),), "model.layers.1."),
    ("bert-untied", lambda: bert(tie=False), lambda: {"input_ids": _ids(), "attention_mask": _mask()}, "bert.encoder.layer.1."),
])
def test_a_split_between_transformer_blocks_reproduces_the_model(name: str, factory: object, inputs: object, block: str) -> None:
    torch.manual_seed(0)
    model, example = factory().train(), inputs()
    graph, _ = trace_model(model, example)
    stages = build_stages(graph, _cut_before(graph, block))
    # strict=False: untied BERT-MLM keeps a `cls.predictions.bias` its forward never reads (no node owns it)
    state = stage_state_from_original(graph, model.state_dict(), strict=False)
    for stage in stages:
        stage.load_state_dict(state, strict=False)
    assert sum(len(s.state_dict()) for s in stages) == len(state)
    torch.testing.assert_close(_chain(stages, graph, example).logits, _run(model, example), rtol=1e-5, atol=1e-5)


def test_a_split_tied_embedding_stays_one_parameter_and_a_package_refuses_it_naming_both(tmp_path) -> None:
    torch.manual_seed(0)
    model = gpt2(tie=True).train()
    graph, _ = trace_model(model, (_ids(),))
    assert graph.metadata["tied_parameters"] == [["transformer.wte.weight", "lm_head.weight"]]
    stage_of = _cut_before(graph, "transformer.h.1.")
    first, second = build_stages(graph, stage_of)  # the embedding in stage 0, the output layer in stage 1
    assert first.transformer_wte_weight is second.lm_head_weight
    state = stage_state_from_original(graph, model.state_dict(), strict=False)
    for stage in (first, second):
        stage.load_state_dict(state, strict=False)
    torch.testing.assert_close(_chain([first, second], graph, (_ids(),)).logits, _run(model, (_ids(),)), rtol=1e-5, atol=1e-5)
    # PipeDream's runtime would run a generated package's stages as separate copies: refused.
    with pytest.raises(TiedParameterError, match=r"'transformer.wte.weight' and 'lm_head.weight'.*generated package"
                                                 r".*tie_word_embeddings=False"):
        generate_package(graph.with_stages(stage_of), plan_from_graph(graph.with_stages(stage_of)), tmp_path / "pkg",
                         "Gpt2", "gpt2")


def test_profile_takes_dict_inputs_and_the_loss_reads_model_output_attributes() -> None:
    torch.manual_seed(0)
    model = bert()
    seen = []

    def loss_fn(out: object) -> torch.Tensor:  # written for a Hugging Face ModelOutput
        seen.append(type(out))
        return out.logits.float().logsumexp(-1).mean()

    graph = profile(model, {"input_ids": _ids(), "attention_mask": _mask()}, loss_fn, warmup=0, iterations=1,
                    subtract_overhead=False)
    assert [i["name"] for i in graph.metadata["inputs"]] == ["input_ids", "attention_mask"]
    assert graph.metadata["route"] == "export" and seen and all(t is OutputDict for t in seen)
    assert graph.metadata["profile"]["loss_forward_ms"] > 0
    assert sum(n.forward_ms for n in graph.nodes) > 0
    by_kwargs = profile(model, (), example_kwargs={"input_ids": _ids(), "attention_mask": _mask()}, warmup=0,
                        iterations=1, subtract_overhead=False)
    assert [n.node_id for n in by_kwargs.nodes] == [n.node_id for n in graph.nodes]


def _ce(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class _Images:
    batch_size = 4

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        return (torch.randn(4, 3, 32, 32, generator=gen),), torch.randint(0, 10, (4,), generator=gen)


def test_single_process_training_step_of_a_split_timm_vit_matches_plain_training() -> None:
    import copy

    from model_parallel.runtime.config import TrainConfig
    from model_parallel.runtime.trainer import SingleProcessRunner, single_process_reference

    torch.manual_seed(0)
    model = vit()
    reference = copy.deepcopy(model)
    graph, _ = trace_model(model, (torch.randn(2, 3, 32, 32),))
    plan = plan_from_graph(graph.with_stages(_cut_before(graph, "blocks.6.")))
    factory = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    config = TrainConfig(batch_size=4, num_microbatches=2)
    runner = SingleProcessRunner(graph, plan, model, _ce, factory, _Images(), config)
    got = runner.train_step(0).loss
    want = single_process_reference(reference, _ce, factory, _Images(), config, 1)[0]
    assert got == pytest.approx(want, rel=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_a_training_step_of_split_gpt2_stages_with_microbatched_dict_inputs_matches_the_model() -> None:
    import copy

    torch.manual_seed(0)
    model = gpt2(tie=False).train()
    reference = copy.deepcopy(model)
    batch = {"input_ids": _ids(batch=4), "attention_mask": torch.ones(4, SEQ, dtype=torch.long)}
    graph, _ = trace_model(model, {k: v[:2] for k, v in batch.items()})
    stages = build_stages(graph, _cut_before(graph, "transformer.h.1."))
    for stage in stages:
        stage.load_state_dict(stage_state_from_original(graph, model.state_dict()), strict=False)
    target = _ids(7, batch=4)
    parts = split_microbatches([batch], target, 2)
    assert [tuple(p[0][0]["input_ids"].shape) for p in parts] == [(2, SEQ), (2, SEQ)]
    for (inputs,), part_target in parts:
        (_ce(_chain(stages, graph, inputs), part_target) / 2).backward()
        (_ce(reference(**inputs), part_target) / 2).backward()
    for stage in [*stages, reference]:
        torch.optim.SGD(stage.parameters(), lr=0.1).step()
    trained = original_state_from_stage(graph, {k: v for s in stages for k, v in s.state_dict().items()})
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6)


def test_output_dict_reads_fields_as_attributes_keys_and_positions() -> None:
    out = decode_argument({"dict": {"logits": 1, "loss": 2}}, lambda ref: None)
    assert isinstance(out, OutputDict) and out.logits == out["logits"] == out[0] == 1 and out[1] == 2
    with pytest.raises(AttributeError, match="no field 'hidden'.*logits, loss"):
        out.hidden


def test_aten_operators_are_allowed_by_a_closed_rule() -> None:
    assert function_target("torch.ops.aten.linear.default") is torch.ops.aten.linear.default
    assert function_target("torch.ops.aten.silu_.default") is torch.ops.aten.silu_.default
    for refused in ("torch.ops.aten.from_file.default", "torch.ops.aten._local_scalar_dense.default",
                    "torch.ops.aten.set_.source_Tensor", "torch.ops.higher_order.cond", "torch.ops.aten.linear",
                    "torch.ops.myns.op.default", "torch.ops.aten.nope.default"):
        with pytest.raises(GraphFormatError, match="is not allowed in a graph file"):
            function_target(refused)


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python control flow on a tensor's value: neither tracer can follow it
            return x * 2
        return x


def test_a_model_neither_tracer_follows_fails_naming_the_model_and_a_remedy() -> None:
    with pytest.raises(ProfileError, match=r"(?s)torch.fx could not trace _DataDependent.*torch.export could not "
                                           r"trace _DataDependent.*torch.cond"):
        trace_model(_DataDependent(), (torch.ones(2),))


def test_keyword_inputs_on_the_fx_route_are_refused_with_the_remedy() -> None:
    with pytest.raises(ProfileError, match="keyword inputs.*route='export'"):
        trace_model(nn.Linear(2, 2), {"input": torch.ones(1, 2)}, route="fx")


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.arange(1.0, 4.0), persistent=False)
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_a_non_persistent_buffer_on_the_fx_route_is_rebuilt_with_its_value() -> None:
    model = _WithBuffer()
    graph, _ = trace_model(model, (torch.ones(2, 3),))
    assert graph.metadata["route"] == "fx" and "scale" in graph.metadata["constants"]
    full = full_model_from_graph(graph)  # was: torch.empty, then a missing key on a strict load
    full.load_state_dict(stage_state_from_original(graph, model.state_dict()), strict=True)
    assert torch.equal(full(torch.ones(2, 3)), model(torch.ones(2, 3)))


def test_split_microbatches_splits_dict_inputs_key_by_key() -> None:
    inputs = [{"input_ids": torch.arange(8).reshape(4, 2), "attention_mask": torch.ones(4, 2)}, torch.zeros(4)]
    parts = split_microbatches(inputs, torch.arange(4), 2)
    assert torch.equal(parts[1][0][0]["input_ids"], torch.tensor([[4, 5], [6, 7]]))
    assert parts[1][0][0].keys() == inputs[0].keys() and parts[1][0][1].shape == (2,)


@pytest.mark.slow
def test_importing_transformers_and_timm_after_model_parallel_just_works() -> None:
    code = ("import model_parallel, transformers, timm\n"
            "from transformers import GPT2LMHeadModel\n"
            "timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32)\n"
            "print('imported', GPT2LMHeadModel.__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "imported GPT2LMHeadModel" in done.stdout


def test_tracing_leaves_every_buffer_as_it_was() -> None:
    # timm's BatchNormAct2d counts `num_batches_tracked` in Python, outside any traced op: the job builder
    # traces the very model it trains, so one extra count broke exactness against single-process training.
    model = efficientnet().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace_model(model, (torch.randn(2, 3, 32, 32),))
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])] == []


def test_the_profiled_graph_has_the_nodes_training_traces() -> None:
    # The profiler times under no_grad, but traces with autograd on: T5's graph had 4 `contiguous` nodes
    # fewer under no_grad, and a plan from it missed nodes of the graph every worker traces.
    torch.manual_seed(0)
    model, inputs = t5(), {"input_ids": _ids(), "decoder_input_ids": _ids(1)}
    profiled = profile(model, inputs, warmup=0, iterations=1, subtract_overhead=False)
    traced, _ = trace_model(model, inputs)
    assert [n.node_id for n in profiled.nodes] == [n.node_id for n in traced.nodes]


def test_the_job_builder_traces_a_module_on_a_dict_dataset() -> None:
    from model_parallel.api.job import JobSpec, build_job

    class Tokens:
        batch_size = 4

        def batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            return {"input_ids": _ids(step, 4), "attention_mask": torch.ones(4, SEQ, dtype=torch.long)}, _ids(9, 4)

    job = build_job(JobSpec(model=bert(tie=False), data=Tokens(), num_stages=2, batch_size=4, num_microbatches=2), 1)
    assert [i["name"] for i in job.graph.metadata["inputs"]] == ["input_ids", "attention_mask"]  # was: the keys traced as values
    assert job.graph.metadata["inputs"][0]["shape"] == [2, SEQ]  # one microbatch


def test_a_graph_from_its_file_rebuilds_with_initialised_weights_the_same_on_every_seeded_rank(tmp_path: object) -> None:
    # An export-route graph names ATen operators: no module constructor initialises their weights. They were
    # torch.empty, and a package trained from the seed (the command-line workflow) gave NaN losses.
    graph, _ = trace_model(vit(), (torch.randn(2, 3, 32, 32),))
    write_graph_json(graph, tmp_path / "graph.json")
    builds = []
    for _ in range(2):
        torch.manual_seed(0)
        builds.append(full_model_from_graph(read_graph_json(tmp_path / "graph.json")))
    state = builds[0].state_dict()
    assert all(torch.isfinite(v).all() for v in state.values())
    assert all(torch.equal(v, builds[1].state_dict()[k]) for k, v in state.items())
    assert torch.equal(state["blocks_0_norm1_bias"], torch.zeros(192)) and torch.equal(state["blocks_0_norm1_weight"], torch.ones(192))
    assert 0 < state["patch_embed_proj_weight"].abs().max() <= 1 / (3 * 16 * 16) ** 0.5
    loss = _ce(builds[0](torch.randn(2, 3, 32, 32)), torch.arange(2))  # export fixed the batch at 2
    assert torch.isfinite(loss) and 1.0 < float(loss.detach()) < 4.0  # about log(10): a sane start
