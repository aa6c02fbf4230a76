"""One rank of tests/integration/test_hf_distributed.py's world: trains every listed case on its plan and saves this rank's
stage state, one world for all cases (a process start with transformers and timm costs seconds).

    python tests/support/hf_worker.py RANK WORLD PORT DIR CASE[,CASE...] [metrics] [size=test|bench]
                                      [zoo=families] [save_pretrained] [schedule=interleaved]

Reads `DIR/<case>.plan.json` (and, for a case with a live rebalance, `DIR/<case>.switch.json`, the plan
rank 0's scripted controller switches to before step SWITCH_STEP); writes `DIR/<case>-rank<R>.pt`, with
`save_pretrained` also the trained model as `DIR/<case>-hf/` (a collective: each rank writes its stage's shards)
and a save that fails on rank 1 (`DIR/<case>-broken.rank<R>.txt`: each rank's error), and with
`metrics` each rank's per-step records to `DIR/<case>.metrics.<R>.jsonl` (bench/models.py reads them).
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

from model_parallel import PipelineTrainer, RunOptions, TrainConfig  # noqa: E402
from model_parallel.graph.plan import read_plan  # noqa: E402
from model_parallel.messages import Command, NullChannel, ScriptedChannel  # noqa: E402
from support.hf_zoo import BATCH, SIZES, cases  # noqa: E402

STEPS, MICROBATCHES, SWITCH_STEP = 10, 4, 5


TIED = "+tied"  # a case name with this suffix runs the tied variant (embedding = output head)


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def config(schedule: str = "1f1b") -> TrainConfig:
    return TrainConfig(batch_size=BATCH, num_microbatches=MICROBATCHES, schedule=schedule)


def _no_gather(*args: object) -> None:
    raise AssertionError("save_pretrained on several ranks gathered the whole model")


def _save_failing_on_rank_1(trainer: PipelineTrainer, rank: int, target: Path) -> None:
    """A save whose shard write fails on rank 1 (every rank must raise naming rank 1), then one every rank refuses
    (a bad max_shard_size); the errors go to `target`.rank<R>.txt (the test reads it); nothing may appear at `target`."""
    from model_parallel.api import shard_export
    from model_parallel.errors import CheckpointError, ConfigError

    original = shard_export._write_shards
    if rank == 1:
        shard_export._write_shards = lambda *args: "OSError: [Errno 28] No space left on device (injected)"
    try:
        trainer.save_pretrained(target, max_shard_size=20_000)
        message = "no error"
    except CheckpointError as error:
        message = f"CheckpointError: {error}"
    finally:
        shard_export._write_shards = original
    try:  # refused alike on every rank: the error itself, not a CheckpointError
        trainer.save_pretrained(target, max_shard_size="5 parsecs")
    except ConfigError as error:
        message += f"\nConfigError: {error}"
    target.with_name(f"{target.name}.rank{rank}.txt").write_text(message)


def main() -> None:
    rank, world, port, out, names = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    flags = sys.argv[6:]
    metrics = "metrics" in flags
    schedule = next((f.split("=", 1)[1] for f in flags if f.startswith("schedule=")), "1f1b")  # interleaved: loop plans
    sized = cases(SIZES[next((f.split("=", 1)[1] for f in flags if f.startswith("size=")), "test")])
    if "zoo=families" in flags:  # tests/support/hf_families.py: constants in forward, MoE, Swin
        from support import hf_families

        sized = hf_families.cases(SIZES["test"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    for name in names.split(","):
        case = sized[name.split("+")[0]]  # "gpt2+rebalance": with a live plan switch; "gpt2+tied": its tied variant
        channel = NullChannel()
        switch = out / f"{name}.switch.json"
        if rank == 0 and switch.is_file():
            channel = ScriptedChannel({SWITCH_STEP: Command.switch(read_plan(switch), reason="test: move a block")})
        options = RunOptions(timeout=120, progress=False,
                             metrics=str(out / f"{name}.metrics.{{rank}}.jsonl") if metrics else None)
        trainer = PipelineTrainer(case.build(tie=name.endswith(TIED)), sgd, case.data, config(schedule), options=options,
                                  criterion=case.loss, plan=read_plan(out / f"{name}.plan.json"),
                                  example_inputs=case.example(BATCH // MICROBATCHES), channel=channel)
        results = trainer.train(STEPS)
        report = trainer.memory_report  # the end-of-train memory table's rows (None: not reported)
        torch.save({"state": trainer.state_dict(), "losses": [r.loss for r in results],
                    "plan_version": trainer.runner.plan.version,
                    "memory": report.stage_rows() if report is not None else None}, out / f"{name}-rank{rank}.pt")
        if "save_pretrained" in flags:
            from model_parallel.api import export

            gather, export.gather_state = export.gather_state, _no_gather  # no rank may hold another's stage
            try:
                trainer.save_pretrained(out / f"{name}-hf", max_shard_size=20_000)
            finally:
                export.gather_state = gather
            _save_failing_on_rank_1(trainer, rank, out / f"{name}-broken")
        trainer.close()
        print(f"[rank {rank}] {name}: trained {len(results)} steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
