"""One rank of tests/integration/test_trainer_memory_report.py: train the zoo's MLP 3 steps with `PipelineTrainer`
(`measure_memory`), then write this rank's `trainer.memory_report` (stage rows and text) to DIR/rankR.json.

    python tests/support/memory_report_worker.py RANK WORLD PORT DIR
"""
from __future__ import annotations

import datetime
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

from model_parallel import PipelineTrainer, RunOptions  # noqa: E402
from support.eval_cases import make_case  # noqa: E402


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # rank 0 logs the table at INFO
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    case = make_case("mlp")
    options = RunOptions(timeout=120, progress=False, measure_memory=True)
    trainer = PipelineTrainer(case.model, case.sgd, case.train_data, case.config, options=options, criterion=case.loss,
                              num_stages=world, example_inputs=case.example)
    trainer.train(3)
    report = trainer.memory_report
    (out / f"rank{rank}.json").write_text(json.dumps({"rows": report.stage_rows(), "text": report.text}))
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
