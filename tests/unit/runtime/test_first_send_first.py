"""A stage whose step begins with a forward sends that activation before it posts anything it needs only later
(its gradient receives, the loop's reduction part: `started`), and still posts each receive before
it waits on it (executor.py, `_Receives.release`; docs/runtime.md "Fixed cost per step")."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.observe.metrics import MetricsRecorder
from model_parallel.runtime.step.executor import StepData, StepExecutor
from model_parallel.runtime.step.schedule import make_schedule
from model_parallel.runtime.wire import comm


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.linear(x),)


class _Pending:
    def __init__(self, events: list[str], j: int) -> None:
        self.events, self.j, self.structure = events, j, None

    def wait(self, timeout: float) -> list[Any]:
        self.events.append(f"wait B{self.j}")
        return [torch.full((2, 4), float(self.j + 1))]


def _run(schedule: str, after: Optional[list[str]]) -> tuple[list[str], StepExecutor]:
    torch.manual_seed(0)
    config = TrainConfig(batch_size=8, num_microbatches=4, schedule=schedule)
    actions = [a for row in make_schedule(schedule, 2, 4).grid for a in row if a is not None and a.stage == 0]
    executor = StepExecutor(stage=_Stage(), stage_id=0, num_stages=2, actions=actions, route=lambda k, j: k,
                            config=config, criterion=lambda out, target: out.sum(), decode=lambda outs: outs[0],
                            device=torch.device("cpu"), header_cache=comm.HeaderCache(),
                            metrics=MetricsRecorder(rank=0), timeout=5.0)
    events: list[str] = []

    def recv(src: int, tag: int, stream: Any) -> _Pending:
        events.append(f"post B{stream}")
        return _Pending(events, stream)

    def send(values: list[Any], dst: int, tag: int, stream: Any, structure: Any = None) -> comm.SendHandle:
        events.append(f"send {'F' if tag == comm.TAG_ACTIVATION else 'B'}{stream}")
        return comm.SendHandle(works=[], buffers=[], peer=dst)

    executor.recv = recv  # type: ignore[method-assign]
    executor._send = send  # type: ignore[method-assign]
    data = StepData(inputs=[[torch.randn(2, 4)] for _ in range(4)])
    executor.run(0, data, lambda kind, j, fn, span=None, **trace_args: fn(),
                 started=None if after is None else lambda: events.append("after"))
    return events, executor


def test_first_activation_leaves_before_the_gradient_receives_and_the_hook() -> None:
    for schedule in ("1f1b", "gpipe"):
        events, _ = _run(schedule, after=[])
        assert events[:4] == ["send F0", "post B0", "post B1", "after"], (schedule, events)
        assert events.count("after") == 1
        for j in range(4):  # every gradient receive posted before its wait, each once
            assert events.count(f"post B{j}") == 1
            assert events.index(f"post B{j}") < events.index(f"wait B{j}")


def test_gradients_are_the_received_ones() -> None:
    _, executor = _run("1f1b", after=None)
    torch.manual_seed(0)
    expected = _Stage()  # the executor's stage and inputs, drawn in the same order from the same seed
    inputs = [torch.randn(2, 4) for _ in range(4)]
    for j, x in enumerate(inputs):
        torch.autograd.backward(expected(x)[0], torch.full((2, 4), float(j + 1)))
    for got, want in zip(executor.stage.parameters(), expected.parameters()):
        assert got.grad is not None and torch.allclose(got.grad, want.grad)
