"""Pipeline-train a small GPT-style transformer (model_parallel.models.TinyGPT) on random tokens.

    torchrun --nproc_per_node=2 examples/gpt_pipeline.py

`--steps 2` for a quick try; `python examples/gpt_pipeline.py` runs the same 2-stage plan in one process.
"""
from __future__ import annotations

import argparse

import torch

from _common import finish, init_distributed
from model_parallel import Hierarchy, PartitionOptions, PipelineTrainer, RunOptions, TrainConfig, partition, profile
from model_parallel.models import TinyGPT
from model_parallel.models.gpt import lm_loss
from model_parallel.runtime.data.batches import SyntheticData


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    rank, world = init_distributed()
    num_stages = world if world > 1 else 2
    torch.manual_seed(0)  # every rank builds the same initial weights
    model = TinyGPT(vocab_size=args.vocab, seq_len=args.seq_len, dim=args.dim, num_layers=args.layers)
    # Token ids (batch, seq_len) in, next-token targets (batch, seq_len) out.
    data = SyntheticData(batch_size=args.batch_size, shape=(args.seq_len,), num_classes=args.vocab, kind="tokens")

    plan = None
    if rank == 0:
        tokens, targets = data.batch(0)
        graph = profile(model, tokens, loss_fn=lambda logits: lm_loss(logits, targets))
        plan = partition(graph, Hierarchy.from_lists([num_stages]), PartitionOptions(straight_pipeline=True))
        print(plan.table(), flush=True)
    # Only rank 0 profiled and partitioned: the trainer hands its plan to every rank.

    config = TrainConfig(batch_size=args.batch_size, num_microbatches=args.microbatches)
    trainer = PipelineTrainer(model, lambda params: torch.optim.AdamW(params, lr=1e-3), data, config,
                              options=RunOptions(progress=False), criterion=lm_loss, plan=plan)
    results = trainer.train(args.steps)
    if rank == 0 and results:
        print(f"trained {len(results)} steps on {world} process(es); loss {results[0].loss:.4f} -> {results[-1].loss:.4f}",
              flush=True)
    finish()


if __name__ == "__main__":
    main()
