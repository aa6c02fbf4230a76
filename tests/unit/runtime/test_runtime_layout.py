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
# README's PipeDream step 3 writes its package to runtime/image_classification/models/ (git-ignored): a tree that
# had followed the README failed these tests.
WORKFLOW_OUTPUT = "image_classification"


def runtime_entries(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.name not in ("__pycache__", WORKFLOW_OUTPUT)}


def test_the_top_of_runtime_is_the_public_face_and_one_folder_per_concern() -> None:
    entries = runtime_entries(RUNTIME)
    assert entries == FACE | SUBPACKAGES, "a new runtime module belongs in the subpackage of its concern"
    for name in SUBPACKAGES:
        assert (RUNTIME / name / "__init__.py").is_file(), f"runtime/{name}/ has no __init__.py"


def test_every_runtime_subpackage_module_is_in_the_runtime_layer() -> None:
    modules = check_layers.module_files(REPO)
    inside = [m for m in modules if m.startswith("model_parallel.runtime.") and m.count(".") >= 3
              and not m.startswith(f"model_parallel.runtime.{WORKFLOW_OUTPUT}.")]
    assert {m.split(".")[2] for m in inside} == SUBPACKAGES
    assert {check_layers.layer_of(m) for m in inside} == {("runtime", 3)}


def test_no_module_of_the_old_flat_runtime_is_left_behind() -> None:
    # No compatibility shims: the old flat paths are gone, not re-exporting the new ones.
    for old in ("comm", "schedule", "executor", "checkpoint_commit", "engine_checkpoint", "metrics", "tracing",
                "materialize", "sources", "migration", "health"):
        assert not (RUNTIME / f"{old}.py").exists(), f"runtime/{old}.py came back"


def test_the_readme_workflow_s_generated_package_is_not_a_runtime_module(tmp_path) -> None:
    for name in FACE:
        (tmp_path / name).write_text("")
    (tmp_path / WORKFLOW_OUTPUT / "models" / "resnet18" / "gpus=3").mkdir(parents=True)
    assert runtime_entries(tmp_path) == FACE
