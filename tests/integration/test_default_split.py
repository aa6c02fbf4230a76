"""The default split (no plan given) balances what stages hold, never node counts; `memory_per_worker`
finds a plan whose predicted peak fits, or names the smallest memory that would (api/job.py,
optimizer/contiguous.py). Checked on a tiny Hugging Face Llama built on meta (traced, not profiled)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import model_parallel  # noqa: F401  (installs the torchvision repair: transformers imports below)
import transformers  # noqa: E402
from model_parallel.api.job import JobSpec, build_job  # noqa: E402
from model_parallel.errors import InfeasibleError, PlanError  # noqa: E402
from model_parallel.optimizer.contiguous import even_stages  # noqa: E402
from model_parallel.optimizer.memory import Footprint, plan_footprint  # noqa: E402

STAGES = 4


def llama_job(**spec):
    config = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=512, max_position_embeddings=16,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    example = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    job = build_job(JobSpec(model=model, example_inputs=example, batch_size=4, num_microbatches=2, **spec), STAGES)
    return job, model


def stage_parameters(graph, plan) -> list[int]:
    return [int(sum(graph[n].parameter_size for n in s.node_ids) // 4) for s in plan.stages]


def test_default_split_balances_parameters_not_node_counts():
    job, model = llama_job()
    counts = stage_parameters(job.graph, job.plan)
    total = sum(p.numel() for p in model.parameters())
    assert sum(counts) == total
    # The embedding and the LM head (16384 each) are one node each, a layer's 10304 are 7 weights: stages
    # within 5 % of a quarter of the parameters (cut inside layers where that evens them out).
    assert max(counts) <= 1.05 * total / STAGES and min(counts) >= 0.95 * total / STAGES, counts
    by_nodes = even_stages(job.graph.replace_nodes(replace(n, parameter_size=0.0) for n in job.graph.nodes), STAGES)
    assert max(stage_parameters(job.graph, by_nodes)) > max(counts)  # what counting nodes would give
    # Every weight is read on the stage that holds it (no weight crosses a cut).
    for node in job.graph.nodes:
        if node.reads_state:
            readers = {job.plan.stage_of[s] for s in job.graph.successors[node.node_id]}
            assert readers <= {job.plan.stage_of[node.node_id]}, node.node_id


def test_memory_per_worker_finds_a_plan_that_fits_or_names_the_smallest():
    job, _ = llama_job()
    footprint = Footprint("adamw", "1f1b", 2)
    balanced = max(p["total"] for p in plan_footprint(job.graph, job.plan, footprint))
    fitted, _ = llama_job(memory_per_worker=balanced, optimizer="adamw")
    assert max(p["total"] for p in plan_footprint(fitted.graph, fitted.plan, footprint)) <= balanced
    with pytest.raises(InfeasibleError, match=r"no split of the model into 4 stages fits .* the smallest that fits is "
                                              r".*raise memory_per_worker"):
        llama_job(memory_per_worker=0.8 * balanced, optimizer="adamw")
    with pytest.raises(InfeasibleError, match="the plan given puts .* on stage 0 .* over memory_per_worker"):
        llama_job(memory_per_worker=0.5 * balanced, optimizer="adamw", plan=job.plan)
    with pytest.raises(PlanError, match="memory_per_worker is bytes per worker"):
        JobSpec(model="mlp", memory_per_worker=-1.0)


def test_the_worker_command_line_passes_memory_per_worker_and_what_it_prices():
    from model_parallel.cli.worker import build_parser
    from model_parallel.cli.worker_job import job_spec

    args = build_parser().parse_args(["--model", "mlp", "--memory_per_worker", "2.5e9", "--optimizer", "adamw",
                                      "--schedule", "gpipe"])
    spec = job_spec(args)
    assert (spec.memory_per_worker, spec.optimizer, spec.schedule) == (2.5e9, "adamw", "gpipe")
    assert job_spec(build_parser().parse_args(["--model", "mlp"])).optimizer == "sgd_momentum"  # momentum 0.9


def test_pipeline_trainer_prices_its_own_optimizer_under_memory_per_worker():
    from model_parallel import PipelineTrainer, TrainConfig

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=16,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    example = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}

    def trainer(factory, memory):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        return PipelineTrainer(model, factory, None, TrainConfig(batch_size=4, num_microbatches=2), num_stages=2,
                               example_inputs=example, single_process=True, memory_per_worker=memory)

    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    parameters = 2 * 256 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 64) + 32
    # AdamW holds 16 bytes a parameter, plain SGD 8 (a stage holds at least half: 8 P or 4 P), plus the same
    # activations (here ~4.6 P: a traced graph prices every output): SGD fits 0.6 x 16 P, AdamW does not.
    cap = 0.6 * 16 * parameters
    assert trainer(sgd, cap).plan.num_stages == 2
    with pytest.raises(InfeasibleError, match="adamw, 1f1b, 2 microbatches"):
        trainer(adamw, cap)
    with pytest.raises(PlanError, match="no memory model for optimizer 'rmsprop'"):
        trainer(lambda params: torch.optim.RMSprop(params), cap)
