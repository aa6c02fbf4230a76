"""One rank of tests/test_data_resume.py's world: for each adapter, train STEPS steps uninterrupted, then the same
in two runs (checkpoint at CUT, mid-epoch; resume to STEPS); each rank saves its stage state of both.

    python tests/support/resume_worker.py RANK WORLD PORT DIR
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

from model_parallel import PipelineTrainer, RunOptions  # noqa: E402
from model_parallel.codegen.naming import original_state_from_stage  # noqa: E402
from support.resume_cases import CUT, STEPS, case_names, make_case  # noqa: E402


def train(name: str, world: int, directory: Path, steps: int, resume: bool) -> dict:
    case = make_case(name)
    options = RunOptions(timeout=120, progress=False, checkpoint_dir=str(directory), resume=resume)
    with PipelineTrainer(case.model, case.sgd, case.data, case.config, options=options, criterion=case.loss,
                         num_stages=world, example_inputs=case.example, collate_fn=case.collate) as trainer:
        trainer.train(steps)
        return original_state_from_stage(trainer.graph, trainer.state_dict())  # the model's own names


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    for name in case_names():
        whole = train(name, world, out / name / "whole", STEPS, resume=False)
        train(name, world, out / name / "part", CUT, resume=False)
        resumed = train(name, world, out / name / "part", STEPS, resume=True)
        torch.save({"whole": whole, "resumed": resumed}, out / f"{name}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
