"""`model-parallel`: one command for every step, subcommands loaded on use, `ctl` without torch, seed shims."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from model_parallel.cli import main as entry
from model_parallel.coordinator.server import Coordinator
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.plan import Plan, StagePlan

REPO = Path(__file__).resolve().parents[2]
STEPS = ("profile", "partition", "generate", "worker", "coordinator", "ctl", "demo", "export", "calibrate")
TORCH_MODULES = "sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))"


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_help_lists_every_step(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        entry.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.split("commands:\n", 1)[1].splitlines() if line.startswith("  ")]
    assert set(STEPS) <= set(listed), out


def test_every_subcommand_module_has_a_main() -> None:
    """Each entry names a module with `main(argv)`."""
    for name, sub in entry.SUBCOMMANDS.items():
        path = REPO / Path(*sub.module.split(".")).with_suffix(".py")
        tree = ast.parse(path.read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), f"{path} has no main()"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture) -> None:
    for argv in ([], ["nosuch"], ["ctl"], ["partition", "--bogus"]):
        with pytest.raises(SystemExit) as info:
            entry.main(argv)
        assert info.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error:" in err[0] and "Traceback" not in err[0], (argv, err)


def test_verbose_is_passed_on_to_the_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr("model_parallel.cli.ctl.main", lambda argv: seen.append(argv) or 0)
    assert entry._main(["-vv", "ctl", "--address", "h:1", "status"]) == 0
    assert seen == [["-v", "-v", "--address", "h:1", "status"]]


def test_ctl_status_loads_no_torch() -> None:
    """A status from a live coordinator, through the console script's code, in a process that never imports torch."""
    nodes = [Node("input0", "Input0")] + [Node(f"n{i}", f"Linear({i})", forward_ms=0.5, backward_ms=0.5) for i in range(4)]
    graph = Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))
    plan = Plan((StagePlan(0, ("input0", "n0", "n1"), ranks=(0,)), StagePlan(1, ("n2", "n3"), ranks=(1,))))
    coordinator = Coordinator(graph, plan, b"tok", policy="manual")
    port = coordinator.start("127.0.0.1", 0)
    try:
        code = ("import sys\nfrom model_parallel.cli.main import main\ntry:\n    main(sys.argv[1:])\n"
                f"except SystemExit as e:\n    print('exit', e.code)\nprint('torch:', {TORCH_MODULES})\n")
        result = run_python(code, "ctl", "--address", f"127.0.0.1:{port}", "--token", "tok", "status")
    finally:
        coordinator.stop()
    assert "exit 0" in result.stdout, result.stdout + result.stderr
    assert "plan v0" in result.stdout
    assert "torch: []" in result.stdout, result.stdout


@pytest.mark.parametrize("module", ["model_parallel.cli.main", "model_parallel.cli.ctl", "model_parallel.coordinator",
                                    "model_parallel.coordinator.client"])
def test_light_modules_import_no_torch(module: str) -> None:
    result = run_python(f"import sys, {module}\nprint({TORCH_MODULES})")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("script", ["model_parallel/profiler/image_classification/main.py",
                                    "model_parallel/optimizer/optimizer_graph_hierarchical.py",
                                    "model_parallel/optimizer/convert_graph_to_model.py",
                                    "test_socket.py", "test_parallel_0.py",
                                    "model_parallel/test_socket.py", "model_parallel/test_parallel_0.py"])
def test_seed_scripts_are_shims(script: str) -> None:
    """The seed's scripts stay where PipeDream's README types them, a few lines over a cli module."""
    text = (REPO / script).read_text()
    code_lines = [line for line in text.split('"""', 2)[-1].splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(code_lines) <= 15, f"{script}: {len(code_lines)} lines of code"
    assert "model_parallel.cli." in text


@pytest.mark.slow
def test_seed_script_and_subcommand_share_flags_and_exit_codes(tmp_path: Path) -> None:
    """`python optimizer_graph_hierarchical.py` and `model-parallel partition`: same usage error, named for each."""
    script = [sys.executable, str(REPO / "model_parallel/optimizer/optimizer_graph_hierarchical.py"), "--bogus"]
    sub = [sys.executable, "-m", "model_parallel.cli.main", "partition", "--bogus"]
    messages = []
    for command, prog in ((script, "optimizer_graph_hierarchical.py"), (sub, "model-parallel partition")):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert result.returncode == 2
        assert result.stderr.startswith(f"{prog}: error: the following arguments are required: -f/--profile_filename")
        messages.append(result.stderr.removeprefix(prog))
    assert messages[0] == messages[1]
