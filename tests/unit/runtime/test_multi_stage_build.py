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
