"""Every script in examples/ runs, in a reduced mode, and says what it trained; each docstring holds its command."""
from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Optional

import pytest
from support import REPO
from support.process import run_to_completion

EXAMPLES = REPO / "examples"
PYTHON = sys.executable
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def run(argv: list[str], timeout: float = 180, env: Optional[dict[str, str]] = None) -> str:
    """Run an example to completion (killed at the deadline); returns its output, failing on a non-zero exit."""
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return run_to_completion(argv, EXAMPLES.parent, env, timeout)


@pytest.mark.parametrize("script, command", [
    ("mlp_torchrun.py", "torchrun --nproc_per_node=4 examples/mlp_torchrun.py"),
    ("gpt_pipeline.py", "torchrun --nproc_per_node=2 examples/gpt_pipeline.py"),
    ("torchvision_pipeline.py", "torchrun --nproc_per_node=3 examples/torchvision_pipeline.py"),
    ("hf_causal_lm.py", "torchrun --standalone --nproc_per_node=2 examples/hf_causal_lm.py --model gpt2"),
    ("profile_timm.py", "python examples/profile_timm.py -a vit_tiny_patch16_224 -b 8 --image-size 32"),
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


@pytest.mark.parametrize("model, processes", [("gpt2", 2), ("llama", 4)])
def test_hugging_face_example_under_torchrun_trains_exactly_like_one_process(model: str, processes: int) -> None:
    output = run([PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                  str(EXAMPLES / "hf_causal_lm.py"), "--model", model, "--steps", "3", "--layers", str(processes),
                  "--dim", "32", "--check"], timeout=220)
    assert f"trained 3 steps of {model} on {processes} process(es); loss" in output, output[-3000:]
    found = re.search(r"max relative difference to single-process training: (\S+)", output)
    assert found and float(found.group(1)) <= 1e-5, output[-3000:]
    assert output.count("time per minibatch") == 1  # rank 0 alone profiled and partitioned


def test_timm_vit_through_the_command_line_workflow(tmp_path: Path) -> None:
    """examples/timm_vit_cli.sh: profile -> optimizer -> converter -> coordinator + 2 workers, all exit 0."""
    from model_parallel.runtime.launch import free_port

    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHON": PYTHON, "WORK": str(tmp_path / "work"), "STEPS": "3",
           "MASTER_PORT": str(free_port()), "MODEL_PARALLEL_COORDINATOR": f"127.0.0.1:{free_port()}"}
    env.pop("XDG_CACHE_HOME", None)
    output = run(["bash", str(EXAMPLES / "timm_vit_cli.sh"), "2"], timeout=220, env=env)
    assert "timm_vit_cli.sh: vit_tiny_patch16_224 on 2 process(es) exited 0" in output, output[-3000:]
    losses = re.findall(r"\[rank (\d) stage \d\] done: 3 step\(s\), last loss (\S+),", output)
    assert sorted(rank for rank, _ in losses) == ["0", "1"], output[-3000:]
    assert all(math.isfinite(float(loss)) for _, loss in losses), losses  # was nan: uninitialised weights
    assert (tmp_path / "work" / "package" / "graph.json").is_file()


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
