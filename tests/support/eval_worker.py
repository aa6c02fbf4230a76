"""One rank of tests/test_evaluate.py's world: for each case, train a few steps with `PipelineTrainer`, then
`evaluate` (with a metric) on held-out minibatches; rank 0 writes the results.

    python tests/support/eval_worker.py RANK WORLD PORT DIR [interleaved]

With `interleaved`: the MLP and the ViT with dropout (the GPTs tie weights across stages), 2 stages per rank in a loop:
a rank's stages themselves must go to eval mode (their traced dropout follows the stage module's own mode).
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

from model_parallel import PipelineTrainer, RunOptions  # noqa: E402
from support.eval_cases import EVAL_STEPS, STEPS, case_names, make_case  # noqa: E402
from support.worker_world import join  # noqa: E402


def main() -> None:
    rank, world, out = join(sys.argv)
    interleaved = sys.argv[5:] == ["interleaved"]
    results = {}
    for name in ["mlp", "vit_dropout"] if interleaved else case_names():
        case = make_case(name)
        config = replace(case.config, schedule="interleaved") if interleaved else case.config
        trainer = PipelineTrainer(case.model, case.sgd, case.train_data, config, options=RunOptions(timeout=120, progress=False),
                                  criterion=case.loss, num_stages=2 * world if interleaved else world,
                                  example_inputs=case.example)
        trainer.train(STEPS)
        result = trainer.evaluate(case.eval_data, EVAL_STEPS, metric=case.metric)
        results[name] = {"loss": result.loss, "metric": result.metric}
        trainer.close()
        if name == "gpt2":  # after close, until destroy_process_group: saving still works (on the default group)
            saved = trainer.save_pretrained(out / f"gpt2_closed_w{world}")
            results[name]["saved_after_close"] = None if saved is None else str(saved)
    try:
        trainer.train(1)
        after_close = "trained"
    except RuntimeError as error:
        after_close = str(error)
    if rank == 0:
        (out / f"world{world}{'_interleaved' if interleaved else ''}.json").write_text(json.dumps(results))
    dist.barrier()
    loops_before = _gloo_loop_threads()
    dist.destroy_process_group()  # with the trainer still referenced: close() let go of its groups, so they go now
    teardown = {"loops_before_destroy": loops_before, "loops_after_destroy": _gloo_loop_threads(), "train_after_close": after_close}
    (out / f"teardown{world}_{rank}.json").write_text(json.dumps(teardown))


def _gloo_loop_threads() -> int:
    """gloo's event-loop threads in this process, one per live process group (Linux names them in /proc)."""
    count = 0
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            count += comm.read_text().strip() == "gloo_tcp_loop"
        except OSError:  # a thread that ended while we looked
            pass
    return count


if __name__ == "__main__":
    main()
