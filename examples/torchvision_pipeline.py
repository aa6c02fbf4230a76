"""Pipeline-train a torchvision model (default resnet18 at 32x32 images) split into stages.

    torchrun --nproc_per_node=3 examples/torchvision_pipeline.py --arch resnet18

`--steps 2` for a quick try; `python examples/torchvision_pipeline.py` runs the same 3-stage plan in one
process. Any `torchvision.models` constructor name works for `--arch` (resnet50, vgg11, mobilenet_v2...).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _common import finish, init_distributed
from model_parallel import Hierarchy, PartitionOptions, PipelineTrainer, RunOptions, TrainConfig, import_torchvision, partition, profile
from model_parallel.runtime.data.batches import SyntheticData


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--num_classes", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    rank, world = init_distributed()
    num_stages = world if world > 1 else 3
    torchvision = import_torchvision()  # works on CPU-only torch too (see docs)
    torch.manual_seed(0)  # every rank builds the same initial weights
    model = getattr(torchvision.models, args.arch)(num_classes=args.num_classes)
    data = SyntheticData(batch_size=args.batch_size, shape=(3, args.image_size, args.image_size), num_classes=args.num_classes)

    plan = None
    if rank == 0:
        images, labels = data.batch(0)
        graph = profile(model, images, loss_fn=lambda logits: F.cross_entropy(logits, labels))
        plan = partition(graph, Hierarchy.from_lists([num_stages]), PartitionOptions(straight_pipeline=True))
        print(plan.table(), flush=True)
    # Only rank 0 profiled and partitioned: the trainer hands its plan to every rank.

    config = TrainConfig(batch_size=args.batch_size, num_microbatches=args.microbatches)
    trainer = PipelineTrainer(model, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), data, config,
                              options=RunOptions(progress=False), criterion=F.cross_entropy, plan=plan)
    results = trainer.train(args.steps)
    if rank == 0 and results:
        print(f"trained {len(results)} steps of {args.arch} on {world} process(es); "
              f"loss {results[0].loss:.4f} -> {results[-1].loss:.4f}", flush=True)
    finish()


if __name__ == "__main__":
    main()
