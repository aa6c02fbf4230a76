"""The runtime's shape (issue 34): a small public face at the top, one subpackage per concern, one layer."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
RUNTIME = REPO / "model_parallel" / "runtime"
sys.path.insert(0, str(REPO / "tools"))

import check_layers  # noqa: E402  (tools/ is not a package)

SUBPACKAGES = {"step", "wire", "checkpoint", "build", "observe", "data"}
FACE = {"__init__.py", "engine.py", "run.py", "config.py", "trainer.py", "launch.py", "plancheck.py"}


def test_the_top_of_runtime_is_the_public_face_and_one_folder_per_concern() -> None:
    entries = {p.name for p in RUNTIME.iterdir() if p.name != "__pycache__"}
    assert entries == FACE | SUBPACKAGES, "a new runtime module belongs in the subpackage of its concern"
    for name in SUBPACKAGES:
        assert (RUNTIME / name / "__init__.py").is_file(), f"runtime/{name}/ has no __init__.py"


def test_every_runtime_subpackage_module_is_in_the_runtime_layer() -> None:
    modules = check_layers.module_files(REPO)
    inside = [m for m in modules if m.startswith("model_parallel.runtime.") and m.count(".") >= 3]
    assert {m.split(".")[2] for m in inside} == SUBPACKAGES
    assert {check_layers.layer_of(m) for m in inside} == {("runtime", 3)}


def test_no_module_of_the_old_flat_runtime_is_left_behind() -> None:
    # No compatibility shims: the old flat paths are gone, not re-exporting the new ones.
    for old in ("comm", "schedule", "executor", "checkpoint_commit", "engine_checkpoint", "metrics", "tracing",
                "materialize", "sources", "migration", "health"):
        assert not (RUNTIME / f"{old}.py").exists(), f"runtime/{old}.py came back"
