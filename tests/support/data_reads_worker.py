"""One rank of tests/integration/test_data_reads.py: the built-in MLP on 3 stages, the last replicated on ranks 2
and 3, trained and validated on a dataset that records who reads it; every activation message sent is recorded too.

    python tests/support/data_reads_worker.py RANK WORLD PORT DIR
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

from model_parallel import PipelineTrainer, RunOptions  # noqa: E402
from model_parallel.profiler.trace import trace_model  # noqa: E402
from model_parallel.runtime.build.stages import even_plan  # noqa: E402
from model_parallel.runtime.build.zoo import recipe  # noqa: E402
from model_parallel.runtime.wire import comm  # noqa: E402
from support.data_reads import BATCH, CONFIG, EVAL_SEED, EVAL_STEPS, STEPS, sgd  # noqa: E402


class RecordingData:
    """The recipe's synthetic data; every `batch` and `targets` call is recorded as (call, step)."""

    def __init__(self, seed: int) -> None:
        self.inner = recipe("mlp").data(BATCH, seed)
        self.batch_size = BATCH
        self.calls: list[tuple[str, int]] = []

    def batch(self, step: int):
        self.calls.append(("batch", step))
        return self.inner.batch(step)

    def targets(self, step: int) -> torch.Tensor:
        self.calls.append(("targets", step))
        return self.inner.batch(step)[1]


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    sent: list[dict] = []
    send = comm.send_values

    def recording_send(values, dst, tag, *args, **kwargs):  # what the executor puts on the wire, per message
        if tag == comm.TAG_ACTIVATION:
            sent.append({"dst": dst, "dtypes": [str(v.dtype) for v in values if isinstance(v, torch.Tensor)],
                         "shapes": [list(v.shape) for v in values if isinstance(v, torch.Tensor)]})
        return send(values, dst, tag, *args, **kwargs)

    comm.send_values = recording_send
    r = recipe("mlp")
    model = r.model(0)
    graph, _ = trace_model(model, r.example(2))
    plan = even_plan(graph, 3, {2: 2})
    train_data, eval_data = RecordingData(CONFIG.seed), RecordingData(EVAL_SEED)
    with PipelineTrainer(model, sgd, train_data, CONFIG, options=RunOptions(timeout=120, progress=False),
                         criterion=r.criterion, plan=plan, example_inputs=r.example(2)) as trainer:
        trainer.train(STEPS)
        loss = trainer.evaluate(eval_data, EVAL_STEPS).loss
        state = {k: v.detach() for k, v in trainer.state_dict().items()}
        stage = trainer.plan.stage_of_rank(rank)
        outputs = list(trainer.runner.stage.output_names)
    torch.save(state, out / f"state-rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "stage": stage, "outputs": outputs, "loss": loss, "sent": sent,
        "train_calls": train_data.calls, "eval_calls": eval_data.calls}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
