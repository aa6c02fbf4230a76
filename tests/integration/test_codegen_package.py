"""The code generator's command line as a process: an error is one line and exit code 2."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from support import REPO


SCRIPT = REPO / "model_parallel" / "optimizer" / "convert_graph_to_model.py"


@pytest.mark.slow
def test_command_line_error_is_one_line_and_exit_2(run_dir: Path, reference_profiles: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "-f", str(reference_profiles / "gnmt.graph.txt"), "-n", "G", "-a", "gnmt",
         "-o", str(run_dir / "gnmt"), "--stage_to_num_ranks", "0:1"],
        capture_output=True, text=True, timeout=120, cwd=run_dir,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "error:" in result.stderr and "Traceback" not in result.stderr
