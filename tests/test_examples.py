"""Every script in examples/ runs, in a reduced mode, and says what it trained; each docstring holds its command."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PYTHON = sys.executable
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def run(argv: list[str], timeout: float = 180) -> str:
    """Run an example to completion (killed at the deadline); returns its output, failing on a non-zero exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(argv, cwd=EXAMPLES.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(argv)} still running after {timeout} s:\n{output[-3000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    assert process.returncode == 0, f"{' '.join(argv)} exited {process.returncode}:\n{output[-3000:]}"
    return output


@pytest.mark.parametrize("script, command", [
    ("mlp_torchrun.py", "torchrun --nproc_per_node=4 examples/mlp_torchrun.py"),
    ("gpt_pipeline.py", "torchrun --nproc_per_node=2 examples/gpt_pipeline.py"),
    ("torchvision_pipeline.py", "torchrun --nproc_per_node=3 examples/torchvision_pipeline.py"),
])
def test_docstring_has_the_exact_command(script: str, command: str) -> None:
    source = (EXAMPLES / script).read_text()
    assert source.startswith('"""') and command in source.split('"""')[1]


def test_mlp_example_under_torchrun() -> None:
    output = run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                  str(EXAMPLES / "mlp_torchrun.py"), "--steps", "2", "--depth", "2", "--width", "64"])
    assert "trained 2 steps on 2 process(es)" in output, output[-3000:]
    assert "time per minibatch" in output  # the plan table rank 0 printed


def test_gpt_example_single_process() -> None:
    output = run([PYTHON, str(EXAMPLES / "gpt_pipeline.py"), "--steps", "2", "--layers", "2", "--dim", "32"])
    assert "trained 2 steps on 1 process(es)" in output, output[-3000:]


def test_torchvision_example_single_process() -> None:
    output = run([PYTHON, str(EXAMPLES / "torchvision_pipeline.py"), "--steps", "1", "--batch_size", "8", "--microbatches", "2"])
    assert "trained 1 steps of resnet18 on 1 process(es)" in output, output[-3000:]


def test_readme_python_snippet_under_torchrun(tmp_path: Path) -> None:
    """The README's "The same in Python" block, as written, under `torchrun --nproc_per_node=2`: progress and a result."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme[readme.index("### The same in Python"):]
    snippet = section[section.index("```python\n") + len("```python\n"):section.index("\n```", section.index("```python"))]
    script = tmp_path / "readme_snippet.py"
    script.write_text(snippet.replace("trainer.train(100)", "trainer.train(5)") + "\n")
    output = run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)])
    assert "trained 5 steps; loss" in output, output[-3000:]
    assert "train: 100%" in output  # rank 0's progress bar
