"""One rank of tests/integration/test_send_path.py's world: `PipelineTrainer.train(1)` on 2 stages; rank 0
records which project modules its first forward activation send passes and writes them as JSON.

    python tests/support/send_path_worker.py RANK WORLD PORT DIR

"Passes" = the `model_parallel` modules on the Python call stack when the message goes on the wire
(a `send` of a torch ProcessGroup: `dist.isend` and the engine's direct path both end there), plus
those whose functions were handed the activation on the way (the stage's forward outputs, alone or in a
list/tuple/dict): the modules that build the message (its flat values, structure and header).
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

from model_parallel import PipelineTrainer, RunOptions  # noqa: E402
from support.eval_cases import make_case  # noqa: E402


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _holds(value: Any, wanted: set[int], depth: int = 2) -> bool:
    """Whether `value` is one of the `wanted` tensors (by identity) or a container holding one."""
    if isinstance(value, torch.Tensor):
        return id(value) in wanted
    if depth and isinstance(value, (list, tuple)):
        return any(_holds(v, wanted, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return any(_holds(v, wanted, depth - 1) for v in value.values())
    return False


class SendPath:
    """A `sys.setprofile` hook: from the stage's first forward to the first ProcessGroup send after it."""

    def __init__(self) -> None:
        self.outputs: set[int] = set()  # ids of the first forward's output tensors (kept alive below)
        self.kept: Any = None
        self.handlers: list[str] = []  # modules handed the activation, in order of first call
        self.chain: list[str] = []  # project modules on the stack at the send, outermost first
        self.done = False

    def forward_hook(self, module: Any, inputs: Any, output: Any) -> None:
        if not self.outputs and not self.done:
            self.kept = output
            values = output if isinstance(output, (tuple, list)) else (output,)
            self.outputs = {id(v) for v in values if isinstance(v, torch.Tensor)}

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done or not self.outputs:
            return
        if event == "call" and _module(frame).startswith("model_parallel."):
            code = frame.f_code
            arguments = [frame.f_locals.get(name) for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
            if any(_holds(a, self.outputs) for a in arguments) and _module(frame) not in self.handlers:
                self.handlers.append(_module(frame))
        elif event == "c_call" and getattr(arg, "__name__", "") == "send" and \
                getattr(arg, "__module__", "") == "torch._C._distributed_c10d":  # ProcessGroup.send (pybind)
            frames: list[str] = []
            current: Any = frame
            while current is not None:
                if _module(current).startswith("model_parallel."):
                    frames.append(_module(current))
                current = current.f_back
            for name in reversed(frames):  # outermost first; a module re-entered shows again (a call back)
                if not self.chain or self.chain[-1] != name:
                    self.chain.append(name)
            self.done = True


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    case = make_case("mlp")
    trainer = PipelineTrainer(case.model, case.sgd, case.train_data, case.config, options=RunOptions(timeout=120, progress=False),
                              criterion=case.loss, num_stages=world, example_inputs=case.example)
    path = SendPath()
    if rank == 0:
        trainer.runner.stage.register_forward_hook(path.forward_hook)
        sys.setprofile(path)
    try:
        trainer.train(1)
    finally:
        sys.setprofile(None)
    if rank == 0:
        (out / "send_path.json").write_text(json.dumps({"chain": path.chain, "handlers": path.handlers}))
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
