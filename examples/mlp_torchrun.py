"""Profile, partition and pipeline-train an MLP of stacked linears, all in one script.

    torchrun --nproc_per_node=4 examples/mlp_torchrun.py

One stage per process; `--steps 2` for a quick try. Without torchrun (`python examples/mlp_torchrun.py`)
the same 4-stage plan runs in this one process, which is handy for debugging.

The data is a `torch.utils.data.TensorDataset` whose labels follow from the inputs (the argmax of a fixed
random projection), so the loss falls below ln(10) = 2.30 and the held-out accuracy rises above 10 %;
`SyntheticData` (random labels) would keep the loss at ln(10) whatever the model learns.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _common import finish, init_distributed
from model_parallel import Hierarchy, PartitionOptions, PipelineTrainer, RunOptions, TrainConfig, partition, profile
from torch.utils.data import TensorDataset

from model_parallel.models import StackedMLP


def learnable(num_samples: int, seed: int) -> TensorDataset:
    """Inputs and the labels a fixed projection gives them (the same projection for every seed)."""
    projection = torch.randn(64, 10, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(num_samples, 64, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ projection).argmax(dim=1))


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=1) == target).float().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    rank, world = init_distributed()
    num_stages = world if world > 1 else 4
    torch.manual_seed(0)  # every rank builds the same initial weights
    model = StackedMLP(in_features=64, width=args.width, depth=args.depth, num_classes=10)
    data, held_out = learnable(2048, seed=0), learnable(256, seed=1)

    plan = None
    if rank == 0:
        # 1. Profile one minibatch: per-layer forward/backward times, activation and parameter sizes.
        inputs, target = data.tensors[0][: args.batch_size], data.tensors[1][: args.batch_size]
        graph = profile(model, (inputs,), loss_fn=lambda out: F.cross_entropy(out, target))
        # 2. Partition into one stage per worker (PipeDream's optimizer, no replication).
        plan = partition(graph, Hierarchy.from_lists([num_stages]), PartitionOptions(straight_pipeline=True))
        print(plan.table(), flush=True)
    # Only rank 0 profiled and partitioned: the trainer hands its plan to every rank.

    # 3. Train: 1F1B with a flush per minibatch, so the result equals single-process training.
    config = TrainConfig(batch_size=args.batch_size, num_microbatches=args.microbatches)
    trainer = PipelineTrainer(model, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), data, config,
                              options=RunOptions(progress=False), criterion=F.cross_entropy, plan=plan)
    results = trainer.train(args.steps)
    validation = trainer.evaluate(held_out, steps=4, metric=accuracy)  # forward only, on data it never saw
    if rank == 0 and results:
        print(f"trained {len(results)} steps on {world} process(es); loss {results[0].loss:.4f} -> {results[-1].loss:.4f}; "
              f"held-out loss {validation.loss:.4f}, accuracy {validation.metric:.1%}", flush=True)
    finish()


if __name__ == "__main__":
    main()
