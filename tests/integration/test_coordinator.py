"""The coordinator and ctl command lines as processes, and SIGTERM."""
import pytest
from model_parallel.graph.plan import write_plan
from support.coordinators import chain_graph, two_stage_plan




@pytest.mark.slow
def test_command_lines_coordinator_ctl_and_sigterm(tmp_path):
    """`python test_socket.py` + `model-parallel ctl` as processes; bad token -> one line, exit 2; SIGTERM -> exit 0."""
    import os
    import signal
    import subprocess
    import sys

    from model_parallel.coordinator.local import CoordinatorProcess

    graph = chain_graph(8)
    from model_parallel.graph.io import save_graph

    save_graph(graph, tmp_path / "graph.json")
    write_plan(two_stage_plan(graph), tmp_path / "plan.json")
    ctl = [sys.executable, "-m", "model_parallel.cli.main", "ctl"]
    with CoordinatorProcess(tmp_path / "graph.json", tmp_path / "plan.json", "tok", workdir=tmp_path / "c") as coord:
        ok = subprocess.run(ctl + ["--address", coord.address, "--token", "tok", "status"],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        assert "plan v0" in ok.stdout and "time per minibatch" in ok.stdout
        bad = subprocess.run(ctl + ["--address", coord.address, "--token", "wrong", "status"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        assert bad.stderr.count("\n") == 1 and "closed the connection" in bad.stderr
        os.killpg(coord.proc.pid, signal.SIGTERM)
        assert coord.proc.wait(timeout=20) == 0
    assert "dropped client" in coord.output() and "authentication failed" in coord.output()
