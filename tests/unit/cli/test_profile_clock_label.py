"""The profile command's summary line names the clock its ms were read on (`--clock wall|cpu`): it printed
"measured training step 55.56 ms, sum of layers 40.48 ms" and only the JSON said the clock."""
from __future__ import annotations

import pytest

from model_parallel.cli import profile as profile_cli


@pytest.mark.parametrize("clock, label", [("wall", "(wall clock)"), ("cpu", "(CPU clock)")])
def test_the_summary_line_names_the_clock(clock, label, monkeypatch, tmp_path, capsys):
    summary = {"num_nodes": 3, "device": "cpu", "measured_step_ms": 55.5, "sum_layer_ms": 40.4, "accuracy_ratio": 0.73,
               "profiling_seconds": 0.4, "overhead_ratio": 7.8, "clock": clock}
    monkeypatch.setattr(profile_cli, "profile_arch", lambda *args, **kwargs: (object(), summary))
    monkeypatch.setattr(profile_cli, "write_profile", lambda graph, summary, directory: {})
    assert profile_cli.main(["-a", "resnet18", "-b", "8", "--profile_directory", str(tmp_path), "--clock", clock]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if "measured training step" in l)
    assert f"sum of layers 40.40 ms {label}" in line
