"""A rank whose stage cannot be built (a weight missing from the file given with `weights=`) is named by its peers.

PipelineTrainer published a failure only from `train`; one raised while building the stage left the exit hook to
publish "done", and the rank waiting on it reported "rank(s) [1] already finished while rank 0 still needed them (do
all ranks run the same --steps and plan?)". Now the builder's error is published as the rank's failure
(api/trainer.py `_publish_failure`)."""
from __future__ import annotations

import sys

import pytest
import torch

import model_parallel  # noqa: F401  (installs the torchvision repair: transformers imports below)
import transformers  # noqa: E402
from model_parallel.runtime.launch import free_port, launch  # noqa: E402

_WORKER = r'''
import sys
from datetime import timedelta
import torch, torch.distributed as dist
import model_parallel, transformers
from model_parallel import PipelineTrainer, RunOptions, TrainConfig

rank, port, weights = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config.from_pretrained(weights))


class Data:
    def batch(self, step):
        ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids[:, :-1]}, ids[:, 1:]


trainer = PipelineTrainer(model, lambda p: torch.optim.SGD(p, lr=0.1), Data(), TrainConfig(batch_size=4, num_microbatches=2),
                          example_inputs={"input_ids": torch.zeros(2, 8, dtype=torch.long)}, weights=weights,
                          options=RunOptions(timeout=60, progress=False))
trainer.train(1)
'''


@pytest.mark.slow
def test_a_rank_that_cannot_build_its_stage_is_named_by_its_peer(tmp_path):
    from safetensors.torch import load_file, save_file

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, tie_word_embeddings=False,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["lm_head.weight"]  # the last stage's weight: only rank 1 reads it
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = free_port()
    result = launch([[sys.executable, str(script), str(r), str(port), str(tmp_path / "hf")] for r in range(2)], timeout=120)
    assert not result.timed_out, result.summary()
    assert "no tensor for stage key 'lm_head_weight'" in result.output(1), result.summary()
    waiting = result.output(0)
    assert "rank 1 failed: InitError" in waiting and "already finished" not in waiting, result.summary()
