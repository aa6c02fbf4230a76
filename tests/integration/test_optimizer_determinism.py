"""Two runs of the optimizer command on the same profile write byte-identical plans, one of them while
busy loops load every core: budgets count states, never seconds (a wall-clock cap once made a plan
depend on the machine's load)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import FIXTURES, REFERENCE_PROFILES, REPO

CASES = {
    # the core (PipeDream's DP and the prefix plans) on two levels
    "core": [str(REFERENCE_PROFILES / "resnet50.graph.txt"), "-n", "4", "2", "-b", "40e9", "1.25e9"],
    # the opt-in search on an in-situ profile whose plan the search does not prove on one level
    "search": [str(FIXTURES / "bert_insitu.graph.txt"), "-n", "4", "--search"],
}


def _optimize(args: list[str], out: Path) -> dict[str, bytes]:
    command = [sys.executable, "-m", "model_parallel.optimizer.optimizer_graph_hierarchical", "-f", args[0], *args[1:],
               "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return {path.name: path.read_bytes() for path in sorted(out.iterdir()) if path.suffix in (".json", ".txt")}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_same_profile_gives_the_same_plan_bytes_under_full_load(case: str, tmp_path: Path) -> None:
    quiet = _optimize(CASES[case], tmp_path / "quiet")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(2, os.cpu_count() or 2))]
    try:
        loaded = _optimize(CASES[case], tmp_path / "loaded")
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait(timeout=30)
    assert "plan.json" in quiet and sorted(quiet) == sorted(loaded)
    different = [name for name in quiet if quiet[name] != loaded[name]]
    assert not different, f"{case}: the loaded run wrote other bytes in {different}"
