"""One rank of tests/integration/test_collective_on_one_rank.py's world: train a tiny GPT-2, then call a collective
(`save_pretrained` or `state_dict(original_names=True)`) on rank 0 only, the common mistake, while rank 1 closes and
leaves; rank 0 writes what it raised.

    python tests/support/rank0_only_worker.py RANK WORLD PORT DIR {save|state}
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import model_parallel  # noqa: F401  (before transformers: repairs its torchvision import on CPU-only torch)
from model_parallel import PipelineTrainer, RunOptions, TrainConfig


def main() -> None:
    import transformers

    rank, world, port, out, what = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 50, (16, 9))
    trainer = PipelineTrainer(transformers.GPT2LMHeadModel(config), lambda p: torch.optim.SGD(p, lr=0.1),
                              TensorDataset(ids[:, :-1], ids[:, 1:]), TrainConfig(batch_size=4, num_microbatches=2),
                              options=RunOptions(timeout=20, progress=False))
    trainer.train(1)
    if rank == 0:
        try:
            if what == "save":
                trainer.save_pretrained(out / "saved")
            else:
                trainer.state_dict(original_names=True)
            raised = {"type": None, "message": ""}
        except Exception as error:  # noqa: BLE001 - the test reads what it was
            raised = {"type": type(error).__name__, "message": str(error)}
        (out / f"{what}.json").write_text(json.dumps(raised))
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
