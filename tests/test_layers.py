"""The layer rule (tools/check_layers.py): the package's imports match tools/layer_exceptions.txt exactly,
and the checker finds an upward import, a hidden (function-level) one, a peer import and a circle."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from support import REPO

TOOL = REPO / "tools" / "check_layers.py"
_spec = importlib.util.spec_from_file_location("check_layers", TOOL)
check_layers = sys.modules["check_layers"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(check_layers)


def _main(argv: list[str]) -> SimpleNamespace:
    """The checker's command line, run in this process (`make test-fast` starts no process)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = check_layers.main(argv)
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_the_package_keeps_the_layer_rule_up_to_the_listed_exceptions() -> None:
    result = _main([])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layer rule holds" in result.stdout


def make_package(root: Path, files: dict[str, str]) -> Path:
    """A synthetic `model_parallel` under `root` with the given modules (relative path -> source)."""
    for rel, source in {"__init__.py": "", **files}.items():
        path = root / "model_parallel" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if parent != Path(".") and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("")
        path.write_text(textwrap.dedent(source))
    return root


def found(root: Path) -> dict[tuple[str, str], str]:
    violations, _, _ = check_layers.check(root)
    return {v.key: v.kind for v in violations}


def test_upward_import_at_module_level_is_found(tmp_path: Path) -> None:
    make_package(tmp_path, {
        "graph/core.py": "import torch\nimport model_parallel.runtime.engine\n",
        "runtime/engine.py": "from model_parallel.graph.core import Graph\n",
        "runtime/stages.py": "from model_parallel.runtime import engine\n",
    })
    violations, num_modules, _ = check_layers.check(tmp_path)
    upward = [v for v in violations if v.kind == "upward"]
    assert [(v.key, v.detail, v.where) for v in upward] == [
        (("model_parallel.graph.core", "model_parallel.runtime.engine"), "base -> runtime", ("model_parallel/graph/core.py:2",))]
    # The two modules also import each other: that edge pair is a circle as well.
    assert {v.key for v in violations if v.kind == "cycle"} == {
        ("model_parallel.graph.core", "model_parallel.runtime.engine"),
        ("model_parallel.runtime.engine", "model_parallel.graph.core")}


def test_function_level_and_importlib_imports_count(tmp_path: Path) -> None:
    make_package(tmp_path, {
        "runtime/worker.py": """\
            import importlib

            def main():
                from model_parallel.cli.common import ArgumentParser
                return importlib.import_module("model_parallel.coordinator.client")
            """,
        "cli/common.py": "",
        "coordinator/client.py": "",
    })
    violations, _, _ = check_layers.check(tmp_path)
    got = {(v.key, v.kind, v.detail, v.where) for v in violations}
    assert got == {
        (("model_parallel.runtime.worker", "model_parallel.cli.common"), "upward", "runtime -> cli",
         ("model_parallel/runtime/worker.py:4",)),
        (("model_parallel.runtime.worker", "model_parallel.coordinator.client"), "upward", "runtime -> coordinator",
         ("model_parallel/runtime/worker.py:5",)),
    }


def test_peers_may_not_import_each_other_but_may_import_below(tmp_path: Path) -> None:
    make_package(tmp_path, {
        "codegen/build.py": "from model_parallel.profiler import trace\nfrom model_parallel.graph.core import Graph\n",
        "profiler/trace.py": "from ..errors import ProfileError\nfrom model_parallel.models import TinyGPT\n",
        "graph/core.py": "from model_parallel import errors\n",
        "errors.py": "",
        "models/__init__.py": "",
    })
    assert found(tmp_path) == {("model_parallel.codegen.build", "model_parallel.profiler.trace"): "peer"}


def test_the_runtime_may_not_import_the_profiler_although_it_lies_below(tmp_path: Path) -> None:
    make_package(tmp_path, {
        "runtime/worker.py": "def load():\n    from model_parallel.profiler.trace import trace_model\n"
                             "from model_parallel.codegen import build\n",
        "profiler/trace.py": "",
        "codegen/build.py": "",
    })
    violations, _, _ = check_layers.check(tmp_path)
    assert [(v.key, v.kind, v.detail, v.where) for v in violations] == [
        (("model_parallel.runtime.worker", "model_parallel.profiler.trace"), "forbidden",
         "runtime -> profiler (forbidden: see FORBIDDEN)", ("model_parallel/runtime/worker.py:2",))]


def test_the_api_layer_wires_every_layer_below_it_and_only_the_command_line_imports_it(tmp_path: Path) -> None:
    make_package(tmp_path, {
        "api/job.py": "from model_parallel.profiler import trace\nfrom model_parallel.runtime import run\n"
                      "from model_parallel.cli import common\n",
        "cli/worker.py": "from model_parallel.api.job import build_job\n",
        "coordinator/server.py": "from model_parallel.api import job\n",
        "profiler/trace.py": "",
        "runtime/run.py": "",
        "cli/common.py": "",
    })
    assert found(tmp_path) == {("model_parallel.api.job", "model_parallel.cli.common"): "upward",
                               ("model_parallel.coordinator.server", "model_parallel.api.job"): "upward"}


def test_a_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    make_package(tmp_path, {
        "optimizer/a.py": "from model_parallel.optimizer.b import f\n",
        "optimizer/b.py": "from . import c\n",
        "optimizer/c.py": "def g():\n    from model_parallel.optimizer import a\n",
    })
    violations, _, _ = check_layers.check(tmp_path)
    assert {v.key for v in violations} == {
        ("model_parallel.optimizer.a", "model_parallel.optimizer.b"),
        ("model_parallel.optimizer.b", "model_parallel.optimizer.c"),
        ("model_parallel.optimizer.c", "model_parallel.optimizer.a"),
    }
    assert {v.kind for v in violations} == {"cycle"}
    closing = next(v for v in violations if v.importer.endswith(".c"))
    assert closing.detail == "import circle c -> a -> b -> c" and closing.where == ("model_parallel/optimizer/c.py:2",)


def test_entry_point_scripts_and_the_facade_count_as_the_command_line_layer(tmp_path: Path) -> None:
    make_package(tmp_path, {
        "optimizer/optimizer_graph_hierarchical.py": "from model_parallel.cli.common import run_cli\n",
        "cli/common.py": "",
        "runtime/zoo.py": "import model_parallel\n",  # the facade re-exports every layer: importing it is upward
    })
    (tmp_path / "test_socket.py").write_text("from model_parallel.coordinator.server import Coordinator\n")
    assert found(tmp_path) == {("model_parallel.runtime.zoo", "model_parallel"): "upward"}


def test_a_module_outside_every_layer_is_reported(tmp_path: Path) -> None:
    make_package(tmp_path, {"newthing.py": ""})
    assert found(tmp_path) == {("model_parallel.newthing", "model_parallel.newthing"): "unlayered"}


def run_tool(root: Path, exceptions: str) -> SimpleNamespace:
    (root / "exceptions.txt").write_text(exceptions)
    return _main(["--root", str(root), "--exceptions", str(root / "exceptions.txt")])


def test_exceptions_are_enforced_both_ways(tmp_path: Path) -> None:
    make_package(tmp_path, {"graph/core.py": "def f():\n    from model_parallel.cli import main\n", "cli/main.py": ""})
    edge = "model_parallel.graph.core -> model_parallel.cli.main"

    new = run_tool(tmp_path, "")
    assert new.returncode == 1
    assert "model_parallel/graph/core.py:2: upward: base -> cli" in new.stdout and f"{edge}  # ..." in new.stdout

    assert run_tool(tmp_path, f"{edge}  # until the issue lands\n").returncode == 0

    stale = run_tool(tmp_path, f"{edge}  # reason\nmodel_parallel.graph.core -> model_parallel.runtime.x  # gone\n")
    assert stale.returncode == 1
    assert "no longer occur" in stale.stdout and "exceptions.txt:2: model_parallel.graph.core -> model_parallel.runtime.x" \
        in stale.stdout


@pytest.mark.parametrize("line, message", [
    ("a -> b\n", "has no '# reason'"),
    ("a b  # why\n", "expected 'importer -> imported  # reason'"),
])
def test_a_malformed_exceptions_line_is_one_line_and_exit_2(tmp_path: Path, line: str, message: str) -> None:
    make_package(tmp_path, {})
    result = run_tool(tmp_path, line)
    assert result.returncode == 2 and message in result.stderr and "exceptions.txt:1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
