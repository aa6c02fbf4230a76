"""One rank of tests/integration/test_offload_distributed.py's world: tiny GPT-2 with AdamW, trained STEPS steps
plainly, then again with its state offloaded to disk (`RunOptions.offload_optimizer`, chunks of CHUNK_MB): CUT steps
with a checkpoint, then resumed to STEPS with a live switch that moves a transformer block (its optimizer state read
from one rank's files into the other's).

    python tests/support/offload_worker.py RANK WORLD PORT DIR [SCHEDULE | replicas]

Another SCHEDULE than 1f1b trains both runs straight: zbh1 (zero bubble's I/W split), interleaved (two stages per
rank, one optimizer over both: the trainer's own loop plan), "replicas" (1f1b, plan.json one stage on both ranks).
Reads `DIR/plan.json` and `DIR/switch.json` (applied before SWITCH_STEP); writes `DIR/rank<R>.pt`.
"""
from __future__ import annotations

import datetime
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

from model_parallel import PipelineTrainer, RunOptions, TrainConfig  # noqa: E402
from model_parallel.graph.plan import read_plan  # noqa: E402
from model_parallel.messages import Command, NullChannel, ScriptedChannel  # noqa: E402
from model_parallel.runtime.observe.memory_probe import state_bytes  # noqa: E402
from support.hf_zoo import BATCH, CASES  # noqa: E402

STEPS, CUT, SWITCH_STEP, MICROBATCHES = 6, 3, 4, 2
CHUNK_MB = 0.02  # 20 KB of state at once: the tiny GPT-2's bigger matrices are stepped in slices
CONFIG = TrainConfig(batch_size=BATCH, num_microbatches=MICROBATCHES, lr_schedule=f"cosine:{STEPS}")


def adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-6)  # eps >= 1e-6: the house oracle rule


def train(rank: int, out: Path, steps: int, offload: bool, resume: bool = False, switch: bool = False,
          schedule: str = "1f1b") -> dict[str, Any]:
    case = CASES["gpt2"]
    channel = NullChannel()
    if switch and rank == 0:
        channel = ScriptedChannel({SWITCH_STEP: Command.switch(read_plan(out / "switch.json"), reason="test")})
    options = RunOptions(timeout=120, progress=False, checkpoint_dir=str(out / "checkpoints") if offload else None,
                         resume=resume, offload_optimizer=str(out / "offload") if offload else None,
                         offload_chunk_mb=CHUNK_MB)
    with PipelineTrainer(case.build(), adamw, case.data, replace(CONFIG, schedule=schedule), options=options, criterion=case.loss,
                         plan=None if schedule == "interleaved" else read_plan(out / "plan.json"),  # its loop plan example_inputs=case.example(BATCH // MICROBATCHES),
                         channel=channel) as trainer:
        losses = [r.loss for r in trainer.train(steps)]
        engine = trainer.runner
        resident = sum(v.numel() * v.element_size() for s in engine.optimizer.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"state": trainer.state_dict(), "losses": losses, "plan_version": engine.plan.version,
                "num_stages": engine.plan.num_stages,
                "resident_state_bytes": resident,
                "metered_state_bytes": state_bytes(engine.stage, engine.optimizer)["optimizer_state"],
                "files": sorted(p.name for p in (out / "offload" / f"rank{rank}").rglob("*.bin"))}


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    mode = sys.argv[5] if len(sys.argv) > 5 else "1f1b"
    schedule = "1f1b" if mode == "replicas" else mode  # replicas: plan.json is one stage on both ranks
    plain = train(rank, out, STEPS, offload=False, schedule=schedule)
    if mode == "1f1b":
        first = train(rank, out, CUT, offload=True)
        offloaded = train(rank, out, STEPS, offload=True, resume=True, switch=True)
        offloaded["losses"] = first["losses"] + offloaded["losses"]
    else:
        offloaded = train(rank, out, STEPS, offload=True, schedule=schedule)
    torch.save({"plain": plain, "offloaded": offloaded}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
