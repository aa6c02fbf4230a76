"""A live plan switch that fails on one rank after it started is rolled back on every rank, and the job trains on
exactly as if it had never been tried (issue 33 item 3; runtime/wire/migration.py, "Failures").

A 2-rank world of a StackedMLP built on meta; at step 3 a scripted switch moves two 4 MB layers from rank 0 to
rank 1 (which held only the 40 KB output layer). The failure is real, not a hook in the package:
- `memory`: rank 1 runs under RLIMIT_DATA = what it holds after step 2 + 2 MB, so it cannot allocate the arriving
  layers (the failure before any byte moves);
- `optimizer`: rank 1's optimizer factory (the user's code) refuses the new stage's parameters, after the layers
  and their momentum arrived (the failure after the move).
The oracle is the same world run without the switch: the final checkpoints must be bitwise equal.
"""
from __future__ import annotations

import os
import re
import sys
import textwrap

import pytest
import torch

from model_parallel.runtime.checkpoint.store import load_checkpoint
from model_parallel.runtime.launch import free_port, launch

pytestmark = pytest.mark.slow  # every test runs a 2-rank world

STEPS = 6
SCRIPT = textwrap.dedent("""
    import logging, os, resource, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from model_parallel import PipelineTrainer, TrainConfig
    from model_parallel.allocator import return_freed_memory
    from model_parallel.graph.plan import Plan, StagePlan
    from model_parallel.messages import Command, ScriptedChannel
    from model_parallel.models import StackedMLP
    from model_parallel.runtime.config import RunOptions
    from model_parallel.runtime.data.batches import SyntheticData

    rank, port, mode, checkpoints, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))

    def vmdata():
        for line in open("/proc/self/status"):
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024

    _, HARD = resource.getrlimit(resource.RLIMIT_DATA)

    class Channel(ScriptedChannel):
        def report(self, report):
            super().report(report)
            if rank == 1 and mode == "memory" and report.step == 2:
                # Its stage, gradients and momentum are allocated: room for 2 MB more, not for two 4 MB layers
                # (freed heap memory goes back to the OS first, so none of it is counted as room).
                return_freed_memory()
                resource.setrlimit(resource.RLIMIT_DATA, (vmdata() + 2 * 1024 * 1024, HARD))
                print("CAPPED", flush=True)
            if rank == 1 and mode == "memory" and report.step == 3:  # a step trained under the cap; the checkpoint needs more
                resource.setrlimit(resource.RLIMIT_DATA, (HARD, HARD))

    builds = []

    def optimizer(params):
        builds.append(len(params))
        if mode == "optimizer" and rank == 1 and len(builds) > 1:
            raise ValueError(f"no parameter-group rule for a stage of {len(params)} parameters")
        if mode == "die" and rank == 1 and len(builds) > 1:
            os._exit(9)  # the process dies in the middle of the switch, its layers received
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    with torch.device("meta"):
        model = StackedMLP(in_features=256, width=1024, depth=6, num_classes=10)  # 4 MB a hidden layer
    # Nodes input_1, _0 .. _14 (Linear, ReLU, ...; hidden Linears _2 .. _12). Rank 1 starts with the last ReLU and
    # the output layer (40 KB): nothing its steps free can hold the two 4 MB hidden layers _10 and _12 the switch moves.
    ids = ["input_1"] + [f"_{i}" for i in range(15)]
    def split(at, version):
        return Plan((StagePlan(0, tuple(ids[:at]), ranks=(0,)), StagePlan(1, tuple(ids[at:]), ranks=(1,))), version=version)
    channel = Channel({3: Command.switch(split(10, 1), "test: two layers to rank 1")} if mode != "plain" else {})
    trainer = PipelineTrainer(model, optimizer, SyntheticData(8, (256,), 10, seed=0),
                              TrainConfig(batch_size=8, num_microbatches=2), plan=split(14, 0),
                              options=RunOptions(timeout=30.0, checkpoint_dir=checkpoints, progress=False), channel=channel)
    code = 1
    try:
        trainer.train(steps)
        print("TRAINED", flush=True)
        code = 0
    except Exception as error:
        print(f"ERROR {type(error).__name__}: {error}", flush=True)
    trainer.close()
    sys.stdout.flush()
    os._exit(code)
""")


def run_world(root, mode: str):
    """Run the world in `mode`; returns ({rank: output}, {rank: exit code}, the checkpoint's parameters)."""
    root.mkdir(parents=True, exist_ok=True)
    script = root / "world.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "HOME": str(root),
           "XDG_CACHE_HOME": str(root / "cache")}
    checkpoints = root / "checkpoints"
    result = launch([[sys.executable, str(script), str(r), port, mode, str(checkpoints), str(STEPS)] for r in range(2)],
                    timeout=240, env=env)
    assert not result.timed_out, [w.output[-2000:] for w in result.workers]
    outputs = {w.rank: w.output for w in result.workers}
    codes = {w.rank: w.returncode for w in result.workers}
    params = load_checkpoint(checkpoints).params() if all(c == 0 for c in codes.values()) else {}
    return outputs, codes, params


@pytest.fixture(scope="module")
def never_switched(tmp_path_factory):
    outputs, codes, params = run_world(tmp_path_factory.mktemp("plain"), "plain")
    assert codes == {0: 0, 1: 0}, outputs
    return params


def assert_bitwise_equal(params, oracle) -> None:
    assert params.keys() == oracle.keys() and oracle
    for name, value in oracle.items():
        assert torch.equal(params[name], value), f"parameter {name} differs from the run that never switched"


@pytest.mark.parametrize("mode, cause", [
    ("memory", "rank 1: allocating 4 arriving layer(s) for plan v1 failed: RuntimeError: "),
    ("optimizer", "rank 1: building the stage of plan v1 failed: ValueError: no parameter-group rule for a stage of"),
])
def test_a_switch_that_fails_on_one_rank_is_rolled_back_and_training_is_exact(tmp_path, never_switched, mode, cause):
    outputs, codes, params = run_world(tmp_path, mode)
    assert codes == {0: 0, 1: 0}, {r: o[-3000:] for r, o in outputs.items()}
    for rank in (0, 1):
        out = outputs[rank]
        assert "TRAINED" in out, out[-3000:]
        assert "the switch to plan v1 failed on rank 1: " in out and "every rank rolled back to plan v0" in out, out[-3000:]
        assert re.search(r"\(test: two layers to rank 1\) after [0-9.]+ ms; training goes on with plan v0", out), out[-3000:]
        assert "switched to plan v1" not in out
    assert cause in outputs[1], outputs[1][-3000:]
    if mode == "memory":
        assert "CAPPED" in outputs[1]
    assert_bitwise_equal(params, never_switched)


def test_a_rank_that_dies_in_the_middle_of_a_switch_is_named_by_its_peer_not_rolled_back(tmp_path):
    """A dead peer is not a failed switch (issue 36's recovery): the run ends, naming it, as before."""
    outputs, codes, _ = run_world(tmp_path, "die")
    assert codes == {0: 1, 1: 9}, {r: o[-3000:] for r, o in outputs.items()}
    last = outputs[0].strip().splitlines()[-1]
    assert last.startswith("ERROR PeerError: [rank 0 stage 0] ") and "rank 1" in last, outputs[0][-3000:]
    assert "rolled back" not in outputs[0]
