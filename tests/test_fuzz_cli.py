"""Command lines on malformed input: one line on stderr, exit code 2, no traceback, output directory untouched.

The command lines run in this process (`run_cli(main, argv)`), so each input costs milliseconds; one
subprocess per tool checks that the real entry point prints no traceback.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from model_parallel.cli.common import run_cli
from support import REFERENCE_PROFILES

REPO = Path(__file__).resolve().parents[1]
PARTITIONED = REFERENCE_PROFILES / "vgg16_partitioned_3stages.graph.txt"


CONVERT = "model_parallel.optimizer.convert_graph_to_model"
OPTIMIZE = "model_parallel.optimizer.optimizer_graph_hierarchical"


def _tool(module: str) -> Callable:
    return importlib.import_module(module).main


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def run_main(main: Callable, argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, argv)
    return int(exit_info.value.code or 0), capsys.readouterr().err


def assert_clean_failure(code: int, err: str, before: dict, after: dict) -> None:
    assert code == 2, f"expected exit code 2, got {code}: {err}"
    lines = [line for line in err.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1 and "error:" in lines[0], f"expected one error line, got:\n{err}"
    assert "Traceback" not in err
    assert before == after, "the output directory changed on a failed run (half-written output?)"


MUTATIONS = {
    "negative time": lambda t: t.replace("forward_compute_time=", "forward_compute_time=-", 1),
    "bad stage id": lambda t: t.replace(" -- stage_id=0", " -- stage_id=x", 1),
    "node without stage": lambda t: t.replace(" -- stage_id=2", "", 1),
    "truncated mid-line": lambda t: t[: len(t) // 2],
    "cycle": lambda t: t + "\tnode40 -- node1\n",
    "unknown node": lambda t: t + "\tnode1 -- ghost\n",
    "binary prefix": lambda t: "\x00\udcff" + t,
    "empty": lambda t: "",
    "duplicate id": lambda t: t.replace("node2 ", "node1 ", 1),
    "stage gap": lambda t: t.replace(" -- stage_id=1", " -- stage_id=7"),
}


@pytest.mark.parametrize("mutate", list(MUTATIONS.values()), ids=list(MUTATIONS))
def test_codegen_cli_malformed_graph(tmp_path: Path, capsys: pytest.CaptureFixture, mutate: Callable[[str], str]) -> None:
    work = tmp_path
    bad = work / "gpus=3.txt"
    bad.write_bytes(mutate(PARTITIONED.read_text()).encode("utf-8", "surrogateescape"))
    out = work / "out"
    out.mkdir()
    (out / "keep.txt").write_text("unchanged")
    before = snapshot(out)
    code, err = run_main(_tool(CONVERT), ["-f", str(bad), "-n", "VGG", "-a", "vgg16", "-o", str(out / "pkg")], capsys)
    assert_clean_failure(code, err, before, snapshot(out))
    assert not (out / "pkg").exists()


@pytest.mark.parametrize("ranks, message", [
    ("0:x", "not '<stage>:<replicas>'"),
    ("0:1,9:1", "stage"),
    ("0:0", "not '<stage>:<replicas>'"),
])
def test_codegen_cli_wrong_stage_to_num_ranks(tmp_path: Path, capsys: pytest.CaptureFixture, ranks: str, message: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    code, err = run_main(_tool(CONVERT), ["-f", str(PARTITIONED), "-n", "VGG", "-a", "vgg16", "-o", str(out / "pkg"),
                                          "--stage_to_num_ranks", ranks], capsys)
    assert_clean_failure(code, err, {}, snapshot(out))
    assert message in err


# Mutations that break a graph.txt for every reader (stage ids do not matter to the optimizer).
BROKEN_FOR_OPTIMIZER = [name for name in MUTATIONS if name not in ("node without stage", "stage gap")]


@pytest.mark.parametrize("name", BROKEN_FOR_OPTIMIZER)
def test_optimizer_cli_malformed_graph(tmp_path: Path, capsys: pytest.CaptureFixture, name: str) -> None:
    bad = tmp_path / "graph.txt"
    bad.write_bytes(MUTATIONS[name](PARTITIONED.read_text()).encode("utf-8", "surrogateescape"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("unchanged")
    before = snapshot(out)
    code, err = run_main(_tool(OPTIMIZE), ["-f", str(bad), "-n", "4", "-o", str(out)], capsys)
    assert_clean_failure(code, err, before, snapshot(out))


def test_optimizer_cli_infeasible_memory_says_what_fits(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    code, err = run_main(_tool(OPTIMIZE), ["-f", str(REFERENCE_PROFILES / "vgg16.graph.txt"), "-n", "4", "-s", "1000",
                                           "--use_memory_constraint", "--straight_pipeline", "-o", str(out)], capsys)
    assert_clean_failure(code, err, {}, snapshot(out))
    assert "no partition fits 1000 bytes per worker" in err and "at least" in err


def test_optimizer_cli_bandwidth_count_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    code, err = run_main(_tool(OPTIMIZE), ["-f", str(REFERENCE_PROFILES / "vgg16.graph.txt"), "-n", "4", "4", "-b", "1e9",
                                           "-o", str(out)], capsys)
    assert_clean_failure(code, err, {}, snapshot(out))
    assert "bandwidth" in err


@pytest.mark.slow
def test_real_entry_points_print_one_line(tmp_path: Path) -> None:
    """The scripts as users run them: exit 2, one line, no traceback."""
    bad = tmp_path / "bad.txt"
    bad.write_text("node1 -- Conv2d -- forward_compute_time=abc\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    commands = []
    if _tool(CONVERT) is not None:
        commands.append([sys.executable, str(REPO / "model_parallel/optimizer/convert_graph_to_model.py"),
                         "-f", str(bad), "-n", "M", "-a", "m", "-o", str(tmp_path / "pkg")])
    if _tool(OPTIMIZE) is not None:
        commands.append([sys.executable, str(REPO / "model_parallel/optimizer/optimizer_graph_hierarchical.py"),
                         "-f", str(bad), "-n", "2", "-o", str(tmp_path / "opt")])
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and "bad.txt:1" in result.stderr, result.stderr
        assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr
    assert not (tmp_path / "pkg").exists() and not (tmp_path / "opt").exists()
