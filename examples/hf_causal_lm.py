"""Pipeline-train an unmodified Hugging Face causal LM (`AutoModelForCausalLM.from_config`, tiny GPT-2 or Llama).

    torchrun --standalone --nproc_per_node=2 examples/hf_causal_lm.py --model gpt2

Profiles the model (torch.export), partitions it into one stage per process, trains it with
`PipelineTrainer` on synthetic token sequences (keyword inputs `{"input_ids", "attention_mask"}`), prints a progress
bar with the loss on rank 0 and the final loss. `--check` also trains the original model in one process
and compares every parameter (relative 1e-5). `--nproc_per_node=4` for 4 stages; without torchrun every
stage runs in this process. Weights are random (nothing is downloaded).
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _common import finish, init_distributed
import model_parallel  # noqa: F401  (before transformers: repairs its torchvision import on CPU-only torch)
from model_parallel import Hierarchy, PartitionOptions, PipelineTrainer, TrainConfig, partition, profile
from model_parallel.codegen.naming import stage_state_from_original
from model_parallel.runtime.trainer import single_process_reference

import transformers  # noqa: E402


def build(name: str, args: argparse.Namespace) -> torch.nn.Module:
    """A tiny causal LM with dropout off. GPT-2 keeps its tied embedding and head (HF's default): they sit
    at both ends of the pipeline, and the two stages that hold them keep one logical weight."""
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.dim, n_head=4, vocab_size=args.vocab,
                                         n_positions=args.seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.dim, intermediate_size=2 * args.dim,
                                          num_attention_heads=4, num_key_value_heads=4, vocab_size=args.vocab,
                                          max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0,
                                          pad_token_id=0, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config)


class RandomTokens:
    """Minibatch `step`: token ids (batch, seq_len), a padding mask, and next-token targets (the same on every rank)."""

    def __init__(self, batch_size: int, seq_len: int, vocab: int) -> None:
        self.batch_size, self.seq_len, self.vocab = batch_size, seq_len, vocab

    def batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        # Counting sequences (start, start + stride, ...) mod vocab: the next token is learnable from two before it.
        start = torch.randint(0, self.vocab, (self.batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (self.batch_size, 1), generator=gen)
        ids = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        mask = torch.ones(self.batch_size, self.seq_len, dtype=torch.long)
        mask[1::2, -2:] = 0  # every other sequence is two tokens shorter
        return {"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:]


def lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # (batch, seq_len, vocab); `out` is the model's output (an OutputDict of its fields)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--check", action="store_true", help="compare with training in one process (relative 1e-5)")
    args = parser.parse_args()

    rank, world = init_distributed()
    num_stages = world if world > 1 else 2
    torch.manual_seed(0)  # every rank builds the same initial weights
    model = build(args.model, args)
    original = copy.deepcopy(model) if args.check else None
    data = RandomTokens(args.batch_size, args.seq_len, args.vocab)
    inputs, targets = data.batch(0)
    micro = args.batch_size // args.microbatches
    example = {k: v[:micro] for k, v in inputs.items()}  # one microbatch: what each stage runs at a time

    plan = None
    if rank == 0:
        graph = profile(model, example, lambda out: lm_loss(out, targets[:micro]))
        # Prefix cuts: a transformer's graph has too many antichain states for the exact search to be quick.
        plan = partition(graph, Hierarchy.from_lists([num_stages]),
                         PartitionOptions(straight_pipeline=True, cuts="topological"))
        print(plan.table(), flush=True)
    # Only rank 0 profiled and partitioned: the trainer hands its plan to every rank.

    config = TrainConfig(batch_size=args.batch_size, num_microbatches=args.microbatches)
    # eps 1e-6, not 1e-8: GPT-2's attention key bias has a gradient that is zero in exact arithmetic (softmax
    # ignores a per-query constant); with eps 1e-8 Adam turns its rounding noise into lr-sized steps, so the
    # summation order of the tied embedding's two gradients (one per stage) would show in --check.
    optimizer = lambda params: torch.optim.AdamW(params, lr=3e-3, eps=1e-6)  # noqa: E731
    with PipelineTrainer(model, optimizer, data, config, criterion=lm_loss, plan=plan, example_inputs=example) as trainer:
        results = trainer.train(args.steps)
        if rank == 0 and results:
            print(f"trained {len(results)} steps of {args.model} on {world} process(es); "
                  f"loss {results[0].loss:.4f} -> {results[-1].loss:.4f}", flush=True)
        if original is not None:
            check(trainer, original, data, config, optimizer, args.steps, rank)
    finish()


def check(trainer: PipelineTrainer, original: torch.nn.Module, data: RandomTokens, config: TrainConfig,
          optimizer: object, steps: int, rank: int) -> None:
    """Train the original model in this process and compare this rank's stage with its part of it; the
    largest relative difference over all ranks is printed by rank 0 (and fails the run above 1e-5)."""
    single_process_reference(original, lm_loss, optimizer, data, config, steps)
    want = stage_state_from_original(trainer.graph, original.state_dict(), strict=False)
    worst = 0.0
    for key, value in trainer.state_dict().items():
        if value.is_floating_point():
            worst = max(worst, float((value - want[key]).norm() / want[key].norm().clamp_min(1e-12)))
    worst_all = torch.tensor(worst, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"max relative difference to single-process training: {float(worst_all):.2e}", flush=True)
    if float(worst_all) > 1e-5:
        raise SystemExit(f"rank {rank}: parameters differ from single-process training by {float(worst_all):.2e} (> 1e-5)")


if __name__ == "__main__":
    main()
