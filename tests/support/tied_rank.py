"""One rank of the tied-parameter tests: `python tests/support/tied_rank.py RANK WORLD PORT JOBS.json`.

Runs each job of the file (support.tied.TiedJob) with a PipelineEngine in one gloo world, then saves
this rank's stage state to `<job.out>/rank<RANK>.pt`, so the test can compare every copy of a tied
parameter with single-process training and with the other copies."""
from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `support`

import model_parallel  # noqa: E402,F401  (the torchvision repair transformers needs)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from model_parallel import jsonbound  # noqa: E402
from model_parallel.errors import TiedParameterError  # noqa: E402
from model_parallel.graph.json_format import read_graph_json  # noqa: E402
from model_parallel.graph.plan import read_plan  # noqa: E402
from model_parallel.messages import ScriptedChannel  # noqa: E402
from model_parallel.runtime.config import RunOptions  # noqa: E402
from model_parallel.runtime.engine import PipelineEngine  # noqa: E402
from support.tied import TiedJob  # noqa: E402

TIMEOUT = 60.0


def run(job: TiedJob, rank: int) -> None:
    channel = None
    if job.control_script and rank == 0:
        channel = ScriptedChannel.from_json(Path(job.control_script).read_text())
    # extra["seed_per_rank"]: every rank builds other weights (the copies of a tie differ: refused).
    model = job.build(seed=rank if job.extra.get("seed_per_rank") else 0)
    # extra["nan_on_rank_1"]: that parameter holds a NaN on rank 1 only (a diverged run: refused as one, on every rank).
    refusals = job.extra.get("seed_per_rank") or job.extra.get("nan_on_rank_1")
    if job.extra.get("nan_on_rank_1") and rank == 1:
        with torch.no_grad():
            model.get_parameter(job.extra["nan_on_rank_1"]).view(-1)[0] = float("nan")
    try:
        engine = PipelineEngine(
            graph=read_graph_json(job.graph), plan=read_plan(job.plan), model=model, criterion=job.criterion(),
            optimizer_factory=job.optimizer_factory(), dataset=job.data(), config=job.config(), channel=channel,
            options=RunOptions(timeout=TIMEOUT, checkpoint_dir=job.checkpoint_dir, resume=job.resume, progress=False))
    except TiedParameterError as error:
        if not refusals:
            raise
        print(f"rank {rank}: {job.name} refused: {error}", flush=True)
        return
    engine.train(job.steps)
    Path(job.out).mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone() for k, v in engine.named_state().items()}
    torch.save({"state": state, "plan_version": engine.plan.version}, Path(job.out) / f"rank{rank}.pt")
    print(f"rank {rank}: {job.name} done on plan v{engine.plan.version}", flush=True)


def main() -> None:
    rank, world, port, jobs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT))
    for data in jsonbound.load_file(jobs, error=ValueError, what="jobs file"):
        run(TiedJob.from_json(data), rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
