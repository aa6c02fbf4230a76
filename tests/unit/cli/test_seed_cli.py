"""The seed's step 4 without flags: the last-job record, the token file, the `job` message, the served worker."""
from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from model_parallel.coordinator import jobfiles
from model_parallel.coordinator import protocol as p
from model_parallel.errors import ConfigError, PlanError, ProtocolError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.io import load_graph
from model_parallel.graph.json_format import graph_to_dict
from model_parallel.graph.plan import read_plan
from support.mlp import mlp_job

TOKEN = "seed-token"


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user whose cache lives in the test's directory, with nothing of ours in the environment."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in (p.TOKEN_ENV, jobfiles.COORDINATOR_ENV, "MASTER_ADDR", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_last_job_record_and_fresh_token_file(user: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert jobfiles.cache_dir() == user / "cache" / "model_parallel"
    with pytest.raises(PlanError, match="no job to serve: .*last_job.json does not exist.*convert_graph_to_model"):
        jobfiles.read_last_job()
    package = user / "pkg"
    package.mkdir()
    jobfiles.record_last_job(package, arch="mlp")
    with pytest.raises(PlanError, match="is gone or lacks graph.json/plan.json"):
        jobfiles.read_last_job()
    (package / "graph.json").write_text("{}")
    (package / "plan.json").write_text("{}")
    assert jobfiles.read_last_job() == package.resolve()
    token, path = jobfiles.write_fresh_token()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip() == token.decode()
    assert stat.S_IMODE(jobfiles.cache_dir().stat().st_mode) == 0o700
    assert jobfiles.write_fresh_token()[0] != token  # fresh per coordinator start
    # A worker on this machine finds it when nothing else gives the token; explicit sources win.
    assert p.read_token(None, None, str(path)) == path.read_text().strip().encode()
    monkeypatch.setenv(p.TOKEN_ENV, "from-env")
    assert p.read_token(None, None, str(path)) == b"from-env"
    monkeypatch.delenv(p.TOKEN_ENV)
    with pytest.raises(ProtocolError, match="no coordinator on this machine wrote .*missing"):
        p.read_token(None, None, str(user / "missing"))


def test_home_cache_when_xdg_is_unset(user: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(user / "home"))
    assert jobfiles.last_job_path() == user / "home" / ".cache" / "model_parallel" / "last_job.json"


def test_coordinator_address_defaults(user: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert jobfiles.coordinator_address(None, "10.0.0.1") == "10.0.0.1:29600"  # rank 0's host, default port
    assert jobfiles.coordinator_address(None, None) is None
    assert jobfiles.coordinator_port() == 29600
    monkeypatch.setenv(jobfiles.COORDINATOR_ENV, "10.0.0.9:31000")
    assert jobfiles.coordinator_address(None, "10.0.0.1") == "10.0.0.9:31000"
    assert jobfiles.coordinator_address("h:1", "10.0.0.1") == "h:1"  # the flag wins
    assert jobfiles.coordinator_port() == 31000  # the coordinator listens where its workers look


def test_job_frame_may_exceed_1_mib_only_for_a_job_reply() -> None:
    big = {"nodes": ["x" * 1000] * 1500}  # about 1.5 MB
    job = p.make_message("job", 1, graph=big, plan={}, plan_version=0, train={})
    frame = p.encode_frame(job, b"k", p.S2C, "n" * 32)
    assert len(frame) > p.MAX_FRAME_BYTES
    assert p.decode_payload(frame[4:], b"k", p.S2C, "n" * 32, 0, max_bytes=p.MAX_JOB_FRAME_BYTES)["graph"] == big
    with pytest.raises(ProtocolError, match="exceeds the 1048576-byte limit"):
        p.parse_length(frame[:4])  # everyone else refuses such a frame before reading it
    with pytest.raises(ProtocolError, match="exceeds the 1048576-byte frame limit"):
        p.encode_frame(p.make_message("ctl", 1, op="status", args={"x": big}), b"k", p.C2S, "n" * 32)
    assert p.make_message("job-request", 1)["type"] == "job-request"
    with pytest.raises(ProtocolError, match="field 'graph' must be dict"):
        p.make_message("job", 1, graph=[], plan={}, plan_version=0, train={})


@pytest.fixture
def served(user: Path):
    """A coordinator in this process serving an MLP job (2 stages) with `--lr 0.5 --steps 3`."""
    from model_parallel.coordinator.server import Coordinator

    graph_path, plan_path = mlp_job(user / "job", 2)
    graph, plan = load_graph(graph_path), read_plan(plan_path)
    job = {"graph": graph_to_dict(graph), "plan": plan.to_dict(), "plan_version": 0, "train": {"lr": 0.5, "steps": 3}}
    coordinator = Coordinator(graph, plan, TOKEN.encode(), job=job)
    port = coordinator.start("127.0.0.1", 0)
    try:
        yield coordinator, f"127.0.0.1:{port}", plan
    finally:
        coordinator.stop()


def test_worker_without_a_model_gets_the_job_and_its_own_flags_win(served, monkeypatch: pytest.MonkeyPatch) -> None:
    from model_parallel.cli.worker import ask_coordinator, build_parser, wants_served_job
    from model_parallel.cli.worker_job import job_spec

    coordinator, address, plan = served
    monkeypatch.setenv(jobfiles.COORDINATOR_ENV, address)
    monkeypatch.setenv(p.TOKEN_ENV, TOKEN)
    argv = ["--rank", "1", "--dist_addr", "127.0.0.1", "--steps", "7"]
    args = build_parser().parse_args(argv)
    assert wants_served_job(args)
    merged, job = ask_coordinator(argv, args)
    assert (merged.lr, merged.steps) == (0.5, 7)  # lr from the coordinator, steps from the worker's command line
    assert merged.world_size == plan.num_ranks == 2 and merged.coordinator == address
    assert job.plan == plan and [n.node_id for n in job.graph.nodes] == [n.node_id for n in coordinator.graph.nodes]
    assert job.token == TOKEN.encode()
    spec = job_spec(merged, job)
    assert spec.graph is job.graph and spec.plan == plan
    assert not wants_served_job(build_parser().parse_args(["--model", "mlp"]))


def test_served_flags_are_checked_like_the_command_line(served, monkeypatch: pytest.MonkeyPatch) -> None:
    from model_parallel.cli.worker import ask_coordinator, build_parser

    coordinator, address, _ = served
    monkeypatch.setenv(p.TOKEN_ENV, TOKEN)
    argv = ["--rank", "0", "--coordinator", address]
    coordinator.job = {**coordinator.job, "train": {"schedule": "zigzag"}}
    with pytest.raises(ProtocolError, match="argument --schedule: invalid choice: 'zigzag'.*coordinator's training flags"):
        ask_coordinator(argv, build_parser().parse_args(argv))
    coordinator.job = {**coordinator.job, "train": {"checkpoint_dir": "/etc"}}
    with pytest.raises(ProtocolError, match="'checkpoint_dir' .* is not one a coordinator may set"):
        ask_coordinator(argv, build_parser().parse_args(argv))
    coordinator.job = None
    with pytest.raises(ProtocolError, match="serves no job"):
        ask_coordinator(argv, build_parser().parse_args(argv))


def test_worker_with_a_wrong_token_gives_up_at_its_timeout(served, monkeypatch: pytest.MonkeyPatch) -> None:
    from model_parallel.cli.worker import ask_coordinator, build_parser

    _, address, _ = served
    monkeypatch.setenv(p.TOKEN_ENV, "wrong")
    argv = ["--rank", "0", "--coordinator", address, "--timeout", "1"]
    with pytest.raises(ProtocolError, match=f"could not get the job from the coordinator at {address} within 1 s"):
        ask_coordinator(argv, build_parser().parse_args(argv))


def test_coordinator_job_flags(user: Path) -> None:
    from model_parallel.cli.coordinator import _coordinator_job

    def args(**given: str) -> SimpleNamespace:
        return SimpleNamespace(**{"graph": None, "plan": None, "package": None, **given})

    with pytest.raises(ConfigError, match="--graph needs --plan as well"):
        _coordinator_job(args(graph="g.json"))
    with pytest.raises(ConfigError, match="give --package or --graph/--plan, not both"):
        _coordinator_job(args(package="pkg", graph="g.json", plan="p.json"))
    with pytest.raises(PlanError, match="no job to serve"):
        _coordinator_job(args())
    graph_path, plan_path = mlp_job(user / "job", 2)
    graph, plan, source = _coordinator_job(args(graph=str(graph_path), plan=str(plan_path)))
    assert plan.num_stages == 2 and str(graph_path) in source


def test_converter_recuts_a_straight_pipeline_the_seed_flags_ask_for() -> None:
    """PipeDream's README runs step 3 with `--stage_to_num_ranks 0:1,1:1,2:1` whatever shape step 2 chose."""
    from model_parallel.graph.plan import plan_from_graph
    from model_parallel.cli.generate import straight_recut

    nodes = [Node("input0", "Input0", stage_id=0)] + [
        Node(f"n{i}", f"Linear({i})", forward_ms=1.0, backward_ms=1.0, stage_id=0 if i < 6 else 1) for i in range(9)]
    graph = Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))
    two = plan_from_graph(graph)
    assert two.num_stages == 2
    three = straight_recut(graph, two, {0: 1, 1: 1, 2: 1}, "gpus=3.txt")
    assert three.num_stages == 3 and [s.ranks for s in three.stages] == [(0,), (1,), (2,)]
    assert [len([n for n in s.node_ids if n != "input0"]) for s in three.stages] == [3, 3, 3]
    assert straight_recut(graph, two, {0: 2, 1: 1}, "gpus=3.txt") is two  # the plan's own shape: as is
    assert straight_recut(graph, two, {0: 1, 1: 2, 2: 1}, "gpus=3.txt") is two  # not a straight pipeline: refused later
