"""A demo that learns (issue 35 item 8): `model-parallel demo-lm` in a reduced mode trains a tiny GPT-2 on Python's own
sources through the command lines, exports it, and its export loads with `from_pretrained` and generates a line; the
README's "Train your own model" snippet is examples/train_your_own.py's code, line for line."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from support import REPO
from support.process import run_to_completion

SECTION = "### Train your own model"


def _readme_snippet() -> str:
    readme = (REPO / "README.md").read_text()
    assert SECTION in readme, f"README.md lost its {SECTION!r} section"
    found = re.search(r"```python\n(.*?)```", readme[readme.index(SECTION):], re.S)
    assert found, f"no ```python block under {SECTION!r}"
    return found.group(1).strip("\n")


def test_readme_snippet_is_the_example_and_fits_25_lines() -> None:
    source = (REPO / "examples" / "train_your_own.py").read_text()
    assert source.startswith('"""')
    body = source[source.index('"""', 3) + 3:].strip("\n")  # the code after the module docstring
    assert _readme_snippet() == body
    assert len([line for line in body.splitlines() if line.strip()]) <= 25


def test_write_tokens_is_deterministic_bytes_of_python_sources(tmp_path: Path) -> None:
    import numpy as np

    from model_parallel.cli.demo_lm import VAL_FRACTION, write_tokens

    train, val = write_tokens(tmp_path / "a")
    again = write_tokens(tmp_path / "b")
    assert [p.read_bytes() for p in (train, val)] == [p.read_bytes() for p in again]
    ids = np.concatenate([np.fromfile(train, np.uint16), np.fromfile(val, np.uint16)])
    assert ids.max() < 256 and len(np.fromfile(val, np.uint16)) == len(ids) // VAL_FRACTION
    assert b"class ArgumentParser" in ids.astype(np.uint8).tobytes()  # real text: argparse.py's source


def test_judge_passes_only_a_falling_validation_loss() -> None:
    from model_parallel.cli.demo_lm import judge

    assert judge([(9, 3.0), (19, 3.5), (29, 2.5)]) == (True, "validation loss fell: 3.0000 at step 9 -> 2.5000 at step 29")
    assert judge([(9, 3.0), (19, 3.0)]) == (False, "validation loss did not fall: 3.0000 at step 9 -> 3.0000 at step 19")
    assert judge([(9, 3.0)])[0] is False and "need two" in judge([(9, 3.0)])[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_lm_learns_exports_and_generates(tmp_path: Path) -> None:
    import model_parallel  # noqa: F401  (before transformers: repairs its torchvision import on CPU-only torch)
    import transformers

    out = tmp_path / "run"
    output = run_to_completion([sys.executable, "-m", "model_parallel.cli.main", "demo-lm", "--steps", "30",
                                "--eval-every", "10", "--eval-steps", "2", "--out", str(out)], REPO, timeout=540)
    assert "validation loss fell" in output, output[-3000:]
    summary = json.loads((out / "demo_lm.json").read_text())
    losses = [v["val_loss"] for v in summary["validation_loss"]]
    assert [v["step"] for v in summary["validation_loss"]] == [9, 19, 29] and losses[-1] < losses[0]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert summary["generated"].startswith(summary["prompt"]) and len(summary["generated"]) > len(summary["prompt"])
    assert f"{summary['generated']!r}" in output


def _readme_commands() -> str:
    readme = (REPO / "README.md").read_text()
    found = re.search(r"```bash\n(.*?)```", readme[readme.index(SECTION):], re.S)
    assert found, f"no ```bash block under {SECTION!r}"
    return found.group(1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_python_and_command_lines_run_as_written(tmp_path: Path) -> None:
    """The example (= the README's Python) under torchrun, then the README's command lines on the token files it wrote."""
    import os

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    output = run_to_completion([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                str(REPO / "examples" / "train_your_own.py")], tmp_path, env, timeout=400)
    first, last = (float(x) for x in re.search(r"validation loss ([0-9.]+) -> ([0-9.]+): def parse_args\(", output).groups())
    assert last < first, output[-3000:]
    run_to_completion(["bash", "-ec", _readme_commands()], tmp_path, env, timeout=400, what="the README's command lines")
    import model_parallel  # noqa: F401  (before transformers: repairs its torchvision import on CPU-only torch)
    import transformers

    for directory in ("my-gpt", "my-gpt-cli"):
        _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / directory, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (directory, info)
