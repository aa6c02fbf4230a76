"""In a 2-rank world, the rank that runs out of memory says so in one line, and its peer names it (no
hint about mismatched flags): runtime/engine.train -> memory_probe.out_of_memory -> health."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from model_parallel.runtime.launch import free_port, launch

SCRIPT = textwrap.dedent("""
    import os, resource, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from model_parallel import PipelineTrainer, TrainConfig
    from model_parallel.models import StackedMLP
    from model_parallel.runtime.config import RunOptions
    from model_parallel.runtime.data.batches import SyntheticData

    def vmdata():
        for line in open("/proc/self/status"):
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024

    rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    with torch.device("meta"):
        model = StackedMLP(in_features=1024, width=1024, depth=6, num_classes=10)  # 4 MB a hidden layer
    def criterion(out, target):
        if mode == "raise":
            raise ValueError("the loss refused this batch")
        return torch.nn.functional.cross_entropy(out, target)

    trainer = PipelineTrainer(model, lambda p: torch.optim.Adam(p, lr=1e-3), SyntheticData(8, (1024,), 10, seed=0),
                              TrainConfig(batch_size=8, num_microbatches=2), options=RunOptions(timeout=20.0),
                              criterion=criterion)
    if rank == 1 and mode == "oom":  # its stage is in memory; its gradients and Adam's state (3x its weights) will not fit
        cap = vmdata() + 4 * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    try:
        trainer.train(2)
        print("TRAINED", flush=True)
    except Exception as error:
        print(f"ERROR {type(error).__name__}: {error}", flush=True)
    sys.stdout.flush()
    os._exit(0)
""")


def run_world(tmp_path, mode: str) -> tuple[dict, object]:
    script = tmp_path / "oom_world.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = launch([[sys.executable, str(script), str(r), port, mode] for r in range(2)], timeout=240, env=env)
    assert not result.timed_out, [w.output[-1500:] for w in result.workers]
    return {w.rank: [x for x in w.output.splitlines() if x.startswith(("ERROR", "TRAINED"))] for w in result.workers}, result


@pytest.mark.slow
def test_the_rank_out_of_memory_is_named_by_itself_and_its_peer(tmp_path):
    lines, result = run_world(tmp_path, "oom")
    assert lines[1] and lines[1][0].startswith("ERROR OutOfMemoryError: rank 1 (stage 1) ran out of memory: its stage "
                                                "held "), result.workers[1].output[-2000:]
    assert "limit: " in lines[1][0] and "(RLIMIT_DATA)" in lines[1][0]
    assert lines[0] and lines[0][0].startswith("ERROR PeerError"), result.workers[0].output[-2000:]
    assert "rank 1 failed: rank 1 (stage 1) ran out of memory" in lines[0][0]
    assert "same --steps" not in lines[0][0]


@pytest.mark.slow
def test_a_rank_whose_training_raises_is_named_with_its_error_not_as_finished(tmp_path):
    lines, result = run_world(tmp_path, "raise")
    assert lines[1] and lines[1][0] == "ERROR ValueError: the loss refused this batch", result.workers[1].output[-2000:]
    assert lines[0] and "rank 1 failed: ValueError: the loss refused this batch" in lines[0][0], result.workers[0].output[-2000:]
    assert "same --steps" not in lines[0][0]
