"""One rank of tests/integration/test_train_calls.py's world: `train(2)` then `train(2)` on one trainer (also with a
checkpoint directory and resume, as a script that resumes writes it) against `train(4)` on a fresh one; rank 0
writes each trainer's whole state and the steps each call returned.

    python tests/support/train_calls_worker.py RANK WORLD PORT DIR
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

from model_parallel import PipelineTrainer, RunOptions, TrainConfig  # noqa: E402
from model_parallel.models.mlp import StackedMLP  # noqa: E402
from support.worker_world import join  # noqa: E402


def trainer(options: RunOptions) -> PipelineTrainer:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 16, generator=gen), torch.randint(0, 4, (48,), generator=gen))
    return PipelineTrainer(StackedMLP(in_features=16, width=32, depth=4, num_classes=4),
                           lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), data,
                           TrainConfig(batch_size=8, num_microbatches=2, lr_schedule="warmup:4"), options=options)


def main() -> None:
    rank, _, out = join(sys.argv)
    runs: dict[str, list[int]] = {}
    states = {}
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("model_parallel.api.trainer").addHandler(handler)
    for name, options, calls in [
        ("once", RunOptions(progress=False, timeout=60), [4]),
        ("twice", RunOptions(progress=False, timeout=60), [2, 2]),
        ("twice_resume", RunOptions(progress=False, timeout=60, checkpoint_dir=str(out / "ck"), resume=True), [2, 2]),
    ]:
        run = trainer(options)
        runs[name] = [r.step for steps in calls for r in run.train(steps)]
        states[name] = run.state_dict(original_names=True)
        run.close()
    # After the resumable run's checkpoint (step 3): a first train(2) after a resume has nothing to train (it counts
    # to step 2), and says so; train(0) only resumes, and a loop on next_step then trains to its total.
    resume = RunOptions(progress=False, timeout=60, checkpoint_dir=str(out / "ck"), resume=True)
    run = trainer(resume)
    runs["resumed_chunk"] = [r.step for r in run.train(2)]
    run.close()
    runs["warned_chunk"] = [len(warned)]
    run = trainer(resume)
    runs["resumed_loop"] = [r.step for r in run.train(0)]
    while run.next_step < 6:
        runs["resumed_loop"] += [r.step for r in run.train(min(4, 6 - run.next_step))]
    run.close()
    if rank == 0:
        torch.save(states, out / "states.pt")
        (out / "steps.json").write_text(json.dumps({**runs, "warned": warned}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
