"""One rank of tests/integration/test_dropout_masks.py: a Hugging Face GPT-2 with dropout 0.1 (its default) trained
under each schedule; rank 0 writes the losses, its stages' parameters and the plan, for the test to compare with
one process.

    python tests/support/dropout_worker.py RANK WORLD PORT OUT
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

import model_parallel  # noqa: E402,F401  (before transformers: repairs its torchvision import on CPU-only torch)
from model_parallel import PipelineTrainer, RunOptions, TrainConfig  # noqa: E402
from model_parallel.fileio import atomic_write, atomic_write_text  # noqa: E402
from support.dropout_case import SCHEDULES, STEPS, Tokens, build, config, sgd  # noqa: E402
from support.worker_world import join  # noqa: E402


def main() -> None:
    rank, world, out = join(sys.argv)
    results: dict[str, torch.Tensor] = {}
    for schedule in SCHEDULES:
        trainer = PipelineTrainer(build(), sgd, Tokens(), config(schedule), options=RunOptions(timeout=120, progress=False))
        results[f"{schedule}/losses"] = torch.tensor([r.loss for r in trainer.train(STEPS)], dtype=torch.float64)
        results |= {f"{schedule}/{k}": v for k, v in trainer.runner.named_state().items()}
        if rank == 0:
            atomic_write_text(out / f"plan_{schedule}.json", json.dumps(trainer.plan.to_dict()))
        trainer.close()
    if rank == 0:
        from safetensors.torch import save

        atomic_write(str(out / "rank0.safetensors"), lambda f: f.write(save(results)), binary=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
