"""step/multi_stage.build_stages without processes: what a rank with several stages refuses before it builds any."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from model_parallel.errors import ConfigError
from model_parallel.runtime.observe.memory_probe import NO_METER
from model_parallel.runtime.step import multi_stage


def _engine(schedule: str, meter: Any) -> Any:
    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("built a stage although the build is refused")

    return SimpleNamespace(rank=0, config=SimpleNamespace(schedule=schedule, num_microbatches=4), meter=meter,
                           stage_module=unreachable, make_optimizer=unreachable, make_executor=unreachable)


def test_nccl_is_refused_naming_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multi_stage.dist, "get_backend", lambda: "nccl")
    with pytest.raises(ConfigError, match="NCCL ignores.*--backend gloo"):
        multi_stage.build_stages(_engine("interleaved", NO_METER), None, None)


def test_a_stage_group_puts_its_stages_themselves_in_eval_and_back() -> None:
    """A stage's own `training` decides its traced dropout (codegen/modes.py): `StageGroup.eval()` must reach the
    stage modules, not only the layers they share with the group (evaluate dropped out on interleaved and zbv)."""
    import torch
    from torch import nn

    class Stage(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name
            self.add_module(name, nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(getattr(self, self.name)(x), 0.5, self.training)  # as a trace's literal becomes

    stages = [Stage("fc0"), Stage("fc1")]
    group = multi_stage.StageGroup(stages)
    assert sorted(group.state_dict()) == ["fc0.bias", "fc0.weight", "fc1.bias", "fc1.weight"]  # no stage's own keys
    group.eval()
    assert not any(s.training for s in stages) and not any(m.training for m in group.modules())
    x = torch.ones(2, 4)
    assert torch.equal(stages[0](x), stages[0].fc0(x))  # no dropout in eval
    group.train()
    assert all(s.training for s in stages) and all(m.training for m in group.modules())
