"""The optimizer command line as a process: bad input, worker speeds on a hierarchy."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from model_parallel.errors import PlanError
from model_parallel.graph.plan import read_plan
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.solve import solve
from support import REPO


SCRIPT = REPO / "model_parallel" / "optimizer" / "optimizer_graph_hierarchical.py"


@pytest.mark.slow
def test_cli_bad_input_is_one_line_and_exit_2(reference_profiles, tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "-f", str(reference_profiles / "vgg16.graph.txt"), "-n", "4", "2", "-b", "1e9"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "1 bandwidth(s); give one bandwidth per level" in result.stderr


@pytest.mark.slow
def test_cli_worker_speeds_on_a_hierarchy(reference_profiles, tmp_path, capsys):
    from model_parallel.optimizer.optimizer_graph_hierarchical import main

    profile = str(reference_profiles / "resnet50.graph.txt")
    flags = ["-f", profile, "-n", "2", "2", "-b", "40e9", "1.25e9", "--activation_compression_ratio", "1"]
    assert main([*flags, "--worker_speeds", "1", "1", "0.5", "1", "-o", str(tmp_path / "slow")]) == 0
    assert main([*flags, "-o", str(tmp_path / "even")]) == 0
    slow, even = read_plan(tmp_path / "slow" / "plan.json"), read_plan(tmp_path / "even" / "plan.json")
    assert sorted(r for s in slow.stages for r in s.ranks) == [0, 1, 2, 3]
    assert slow.extra["worker_speeds"] == [1.0, 1.0, 0.5, 1.0]
    assert slow.time_per_minibatch_s > even.time_per_minibatch_s  # a slower worker cannot help
    with pytest.raises(PlanError, match=r"worker_speeds has 3 value\(s\) but the hierarchy \[2, 2\] has 4 worker\(s\)"):
        main([*flags, "--worker_speeds", "1", "1", "0.5"])  # the script's entry point turns it into exit code 2
