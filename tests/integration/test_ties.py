"""Workers (processes) refuse a plan that splits tied parameters under PipeDream's schedule."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import write_graph_json
from model_parallel.profiler.trace import tied_tensor_names, trace_model
from model_parallel.runtime.launch import launch_workers
from support.tied_lm import SEQ, VOCAB, TiedLM


def _tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))


def _traced(model: nn.Module) -> Graph:
    graph, _ = trace_model(model, (_tokens(),))
    return graph


@pytest.mark.slow
def test_workers_refuse_a_split_tie_under_pipedream_with_one_line_and_exit_2(tmp_path) -> None:
    write_graph_json(_traced(TiedLM()), tmp_path / "graph.json")
    result = launch_workers(["--graph", str(tmp_path / "graph.json"), "--num_stages", "2", "--steps", "2",
                             "--batch_size", "4", "--num_microbatches", "2", "--timeout", "30", "--schedule", "pipedream"],
                            2, timeout=180)
    assert not result.timed_out, result.summary()
    for worker in result.workers:
        assert worker.returncode == 2, result.summary()
        assert "Traceback" not in worker.output, worker.output
        assert len([line for line in worker.output.splitlines() if "error: tied parameters" in line]) == 1, worker.output
        assert "'wte.weight' and 'lm_head.weight'" in worker.output and "node lm_head on stage 1" in worker.output
        assert "pipedream schedule" in worker.output


@pytest.mark.slow  # a Hugging Face model
def test_hugging_face_gpt2_ties_are_found_by_identity() -> None:
    from model_parallel.compat import import_torchvision

    import_torchvision()  # transformers imports torchvision (see /work/shared/ENV.md)
    from transformers import GPT2Config, GPT2LMHeadModel

    def config(**kwargs: object) -> GPT2Config:
        return GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, **kwargs)

    assert tied_tensor_names(GPT2LMHeadModel(config())) == [["transformer.wte.weight", "lm_head.weight"]]
    assert tied_tensor_names(GPT2LMHeadModel(config(tie_word_embeddings=False))) == []
