"""Command lines on malformed input: one line on stderr, exit code 2, no traceback, output directory untouched.

The command lines run in this process (`run_cli(main, argv)`), so each input costs milliseconds; one
subprocess per tool checks that the real entry point prints no traceback.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Callable

import pytest

from model_parallel.cli.common import run_cli
from support import REFERENCE_PROFILES
from support.images import corrupt_image_folder

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


# ---- the worker command line: its input files are checked before it joins a world ------------------------
WORKER = "model_parallel.cli.worker"
DEEP_JSON = "[" * 5000 + "]" * 5000
HUGE_INT = "1" * 5000  # more digits than CPython converts (ValueError) and than jsonbound accepts


def _worker_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """case -> (worker arguments, text the one error line must contain); files are written here."""
    def write(name: str, text: str) -> str:
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    (tmp_path / "a_file").write_text("not a directory")
    return {
        "missing control script": (["--control_script", str(tmp_path / "absent.json")], "absent.json: no such file"),
        "control script not JSON": (["--control_script", write("script.json", "{1: stop")], "script.json"),
        "control script huge integer": (["--control_script", write("big.json", '{"1": {"kind": "stop", "rank": ' + HUGE_INT + "}}")],
                                        "big.json: control script:1: an integer of 5000 digits"),
        "control script nested": (["--control_script", write("deep.json", DEEP_JSON)], "deep.json: control script: nested deeper"),
        "missing jobs file": (["--jobs", str(tmp_path / "nojobs.json")], "nojobs.json: cannot read jobs file"),
        "jobs not JSON": (["--jobs", write("jobs1.json", '[["--model", "mlp"]')], "jobs1.json:1: not valid JSON"),
        "jobs not a list": (["--jobs", write("jobs2.json", '{"--model": "mlp"}')], "jobs2.json: the jobs file holds dict"),
        "jobs with a bad job": (["--jobs", write("jobs3.json", '[["--model", "mlp"], ["--steps", "x"]]')],
                                "jobs3.json: job [1]: argument --steps: invalid int value"),
        "jobs huge integer": (["--jobs", write("jobs4.json", "[[" + HUGE_INT + "]]")], "jobs4.json:1: an integer of 5000 digits"),
        "jobs nested": (["--jobs", write("jobs5.json", DEEP_JSON)], "jobs5.json: nested deeper than 64 levels"),
        "jobs with a missing file": (["--jobs", write("jobs6.json", json.dumps([["--control_script", "gone.json"]]))],
                                     "jobs6.json: job [0]: --control_script gone.json: no such file"),
        "checkpoint dir is a file": (["--checkpoint_dir", str(tmp_path / "a_file")], "a_file: is a file, not a directory"),
        "data is not a directory": (["--data", str(tmp_path / "a_file")], "a_file: not a directory"),
        "missing token file": (["--token-file", str(tmp_path / "token")], "token: no such file"),
    }


CASES = ["missing control script", "control script not JSON", "control script huge integer", "control script nested",
         "missing jobs file", "jobs not JSON", "jobs not a list", "jobs with a bad job", "jobs huge integer", "jobs nested",
         "jobs with a missing file", "checkpoint dir is a file", "data is not a directory", "missing token file"]


@pytest.mark.parametrize("case", CASES)
def test_worker_cli_bad_input_file_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture, case: str) -> None:
    argv, expected = _worker_inputs(tmp_path)[case]
    code, err = run_main(_tool(WORKER), ["--model", "mlp", "--steps", "1", *argv], capsys)
    assert_clean_failure(code, err, {}, {})
    assert expected in err, f"{case}: expected {expected!r} in the error line, got:\n{err}"


def test_corrupt_image_is_a_data_error_naming_it(tmp_path: Path) -> None:
    from model_parallel.errors import DataError
    from model_parallel.runtime.data.batches import ImageFolderData

    broken = corrupt_image_folder(tmp_path / "images")
    data = ImageFolderData(tmp_path / "images", batch_size=3)  # one batch holds all three samples
    with pytest.raises(DataError, match=rf"{broken}: cannot decode this image .*replace or delete it"):
        data.batch(0)
