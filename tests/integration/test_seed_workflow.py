"""PipeDream's (and its dynamic descendant's) README workflow, word for word, from the directories it names.

Only the batch size, `--image-size 32` (so it finishes here) and the arch differ from the seed's text;
step 3 reads `gpus=3.txt` where the seed's text has the typo `gpus=4.txt` (step 2 with `-n 3` writes
gpus=3.txt in PipeDream as here) and `-a resnet18` where it has `-a vgg16`. Step 4 is the seed's exactly:
`python test_socket.py` and `python test_parallel_0.py --rank N --dist_addr <rank 0's address>`.

The workflow runs in a copy of the package (the steps write into model_parallel/...), with HOME in a
temporary directory (the converter records the last job, and the coordinator its token, under it).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import sys
from pathlib import Path

import pytest
from support.process import run_to_completion

from support import REPO, netns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PYTHON = sys.executable

STEPS = (  # (directory, command) as the README's "Set up and run" section writes them
    ("model_parallel/profiler/image_classification", "python main.py -a resnet18 -b 8 --image-size 32"),
    ("model_parallel/optimizer", "python optimizer_graph_hierarchical.py -f ../profiler/image_classification/profiles/"
                                 "resnet18/graph.txt -n 3 --activation_compression_ratio 1 -o resnet18_partitioned"),
    ("model_parallel/optimizer", "python convert_graph_to_model.py -f resnet18_partitioned/gpus=3.txt -n ResNet18Partitioned "
                                 "-a resnet18 -o ../runtime/image_classification/models/resnet18/gpus=3 "
                                 "--stage_to_num_ranks 0:1,1:1,2:1"),
)
STEP4_DIR = "model_parallel"
COORDINATOR = "python test_socket.py"
WORKER = "python test_parallel_0.py --rank {rank} --dist_addr {addr}"
PACKAGE = "model_parallel/runtime/image_classification/models/resnet18/gpus=3"


def argv(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "python"
    return [PYTHON, *words[1:]]


def seed_env(home: Path, **extra: str) -> dict[str, str]:
    """The user's environment: HOME in the test's directory, nothing of ours set but PYTHONPATH (the copy)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_CACHE_HOME", "MODEL_PARALLEL_TOKEN", "MODEL_PARALLEL_COORDINATOR", "MASTER_ADDR",
                        "MASTER_PORT", "RANK", "WORLD_SIZE")}
    # XDG_CACHE_HOME at its default under that HOME: a launcher that merges os.environ (LocalWorld) would
    # otherwise bring back the test session's own cache folder, and step 4 would look elsewhere than step 3 wrote.
    return {**env, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONPATH": str(home.parent),
            "OMP_NUM_THREADS": "1", **extra}


def run_step(cwd: Path, command: str, env: dict[str, str], timeout: float = 300) -> str:
    return run_to_completion(argv(command), cwd, env, timeout, what=f"[{cwd}] {command}")


@pytest.fixture(scope="module")
def seed_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package after steps 1-3; its HOME (root/home) holds the converter's last-job record."""
    root = tmp_path_factory.mktemp("seed")

    def skip(directory: str, names: list[str]) -> set[str]:
        here = Path(directory).relative_to(REPO).as_posix()
        generated = {"profiles"} if here.endswith("profiler/image_classification") else set()
        if here.endswith("model_parallel/runtime"):
            generated.add("image_classification")
        return {n for n in names if n == "__pycache__" or n.endswith("_partitioned") or n in generated}

    shutil.copytree(REPO / "model_parallel", root / "model_parallel", ignore=skip)
    (root / "home").mkdir()
    env = seed_env(root / "home")
    for directory, command in STEPS:
        run_step(root / directory, command, env)
    return root


def test_readme_shows_the_seed_commands() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Set up and run"):readme.index("## The workflow, step by step")]
    for directory, command in STEPS + ((STEP4_DIR + "/", COORDINATOR),):
        assert command in section and f"[from {directory}]" in section, (directory, command)
    for rank in range(3):
        assert WORKER.format(rank=rank, addr="127.0.0.1") in section


def test_seed_workflow_on_localhost(seed_tree: Path) -> None:
    """Steps 1-3 (the fixture), then step 4's four processes with no other flags: all train and exit 0."""
    from model_parallel.runtime.launch import LocalWorld, free_port

    record = seed_tree / "home" / ".cache" / "model_parallel" / "last_job.json"
    assert str(seed_tree / PACKAGE) in record.read_text()
    # Ports through the environment only (other test runs may hold the defaults on this machine).
    env = seed_env(seed_tree / "home", MASTER_PORT=str(free_port()), MODEL_PARALLEL_COORDINATOR=f"127.0.0.1:{free_port()}")
    commands = [argv(COORDINATOR)] + [argv(WORKER.format(rank=r, addr="127.0.0.1")) for r in range(3)]
    with LocalWorld(commands, env=env, cwd=seed_tree / STEP4_DIR) as world:
        result = world.wait(timeout=400)
    outputs = [w.output for w in result.workers]
    assert [w.returncode for w in result.workers] == [0, 0, 0, 0], result.summary()
    coordinator = outputs[0]
    assert f"serving {seed_tree / PACKAGE} (3 stage(s) on 3 rank(s))" in coordinator, coordinator
    assert "python test_parallel_0.py --rank 2 --dist_addr <rank 0's address>" in coordinator
    for rank in range(3):
        assert f"rank {rank} finished" in coordinator
        assert re.search(rf"\[rank {rank} stage \d\] done: 10 step\(s\)", outputs[rank + 1]), outputs[rank + 1][-2000:]
    token = seed_tree / "home" / ".cache" / "model_parallel" / "coordinator.token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert token.read_text().strip() not in "".join(outputs)


@pytest.mark.skipif(netns.unavailable_reason() is not None, reason=f"needs network namespaces: {netns.unavailable_reason()}")
def test_seed_workflow_across_three_hosts(seed_tree: Path, tmp_path: Path) -> None:
    """Step 4 on three network hosts with default ports: the coordinator beside rank 0 (the default
    address is rank 0's host), the other workers elsewhere; they share only the home directory's token file."""
    env = seed_env(seed_tree / "home")
    with netns.hosts(3) as net:
        rank0 = net[0].address
        logs = [tmp_path / name for name in ("coordinator.log", "rank0.log", "rank1.log", "rank2.log")]
        net.spawn(0, argv(COORDINATOR), env=env, log=logs[0], cwd=seed_tree / STEP4_DIR)
        for rank in range(3):
            net.spawn(rank, argv(WORKER.format(rank=rank, addr=rank0)), env=env, log=logs[rank + 1],
                      cwd=seed_tree / STEP4_DIR)
        try:
            codes = net.wait_all(timeout=400)
        finally:
            outputs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    assert codes == [0, 0, 0, 0], "\n".join(f"--- {log.name}\n{out[-2000:]}" for log, out in zip(logs, outputs))
    for rank in range(3):
        assert f"rank {rank} finished" in outputs[0]
        assert "done: 10 step(s)" in outputs[rank + 1]
