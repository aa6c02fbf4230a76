"""The profiler command line (a process) profiles at bf16."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import model_parallel as mp
from model_parallel.graph.precision import precision_of
from model_parallel.optimizer.partition import partition


@pytest.mark.slow
def test_the_profiler_command_line_profiles_at_bf16(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from model_parallel.cli.common import run_cli
    from model_parallel.graph.io import load_graph
    from model_parallel.profiler.image_classification import main as cli

    with pytest.raises(SystemExit) as exit_info:
        run_cli(cli.main, ["-a", "resnet18", "-b", "2", "--image-size", "32", "--warmup", "0", "--iterations", "1",
                           "--step-iterations", "1", "--num-classes", "10", "--bf16", "--profile_directory", str(tmp_path)])
    assert exit_info.value.code == 0, capsys.readouterr().err
    graph = load_graph(tmp_path / "resnet18" / "graph.txt")
    assert graph.metadata["profile"]["precision"] == "bf16" and precision_of(graph) == "bf16"
    assert graph["conv1"].layer.outputs[0].dtype == "bfloat16"  # a convolution under autocast
    assert graph["conv1"].activation_bytes == 2 * 64 * 16 * 16 * 2
