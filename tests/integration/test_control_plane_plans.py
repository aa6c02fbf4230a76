"""Plans a coordinator is asked to issue: checked as the workers check them, bounded before anything is allocated.

Issue 33 item 3 (a bad `ctl set-plan` must not end a healthy job) and item 6 (absurd replica counts).
"""
import json
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from model_parallel.cli.common import run_cli
from model_parallel.cli.main import SUBCOMMANDS, build_parser
from model_parallel.coordinator import policy as pol
from model_parallel.coordinator.client import CoordinatorChannel, CtlClient
from model_parallel.coordinator.server import Coordinator
from model_parallel.coordinator.solver import default_solver
from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph, Node
from model_parallel.graph.io import save_graph
from model_parallel.graph.plan import MAX_RANKS, PLAN_SCHEMA, Plan, StagePlan, write_plan
from model_parallel.messages import Command, ScriptedChannel, StepReport
from support import wait_for

TOKEN = b"plan-token"


def chain_graph(n=6):
    nodes = [Node("input0", "Input0")] + [Node(f"n{i}", f"Linear({i})", forward_ms=0.5, backward_ms=0.5) for i in range(n)]
    return Graph(tuple(nodes), tuple((a.node_id, b.node_id) for a, b in zip(nodes, nodes[1:])))


def split(graph, at=3, ranks=((0,), (1,))):
    ids = list(graph.topological_order)
    return Plan((StagePlan(0, tuple(ids[:at]), ranks=ranks[0]), StagePlan(1, tuple(ids[at:]), ranks=ranks[1])))


def cli_main(argv):
    """The console script minus its logging set-up (which would outlive capsys)."""
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args)


def exit_code_and_error(argv, capsys):
    """Run a command line as its console script does: (exit code, the one stderr line)."""
    with pytest.raises(SystemExit) as exited:
        run_cli(cli_main, argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return exited.value.code, err


def report(rank, step):
    return StepReport(rank=rank, step=step, plan_version=0, stage=rank, step_ms=20.0, compute_ms=4.0, comm_ms=1.0,
                      idle_ms=0.0, samples_per_s=400.0)


@pytest.fixture
def running(tmp_path):
    """A coordinator with two registered, reporting workers (in this process)."""
    graph = chain_graph()
    coord = Coordinator(graph, split(graph), TOKEN, policy="manual", config=pol.PolicyConfig(window=3),
                        heartbeat_timeout=30, solver=default_solver)
    address = f"127.0.0.1:{coord.start('127.0.0.1', 0)}"
    ch0 = CoordinatorChannel(address, TOKEN, rank=0, world_size=2)
    ch1 = CoordinatorChannel(address, TOKEN, rank=1, world_size=2)
    try:
        for step in range(3):
            ch0.report(report(0, step))
            ch1.report(report(1, step))
        wait_for(lambda: all(w.step == 2 for w in coord.workers.values()), what="reports")
        yield coord, address, ch0
    finally:
        ch0.close()
        ch1.close()
        coord.stop()


def test_set_plan_with_swapped_stages_is_refused_and_the_job_goes_on(running, tmp_path, capsys) -> None:
    coord, address, ch0 = running
    graph = coord.graph
    ids = list(graph.topological_order)
    swapped = Plan((StagePlan(0, tuple(ids[3:]), ranks=(0,)), StagePlan(1, tuple(ids[:3]), ranks=(1,))))
    write_plan(swapped, tmp_path / "swapped.json")
    code, err = exit_code_and_error(["ctl", "--address", address, "--token", TOKEN.decode(), "set-plan",
                                     str(tmp_path / "swapped.json")], capsys)
    assert code == 2
    assert "coordinator refused set-plan" in err and "edge n1 -> n2 goes from stage 1 back to stage 0" in err, err
    # Nothing was issued: no command for rank 0, plan v0 still live, the run is not stopping.
    assert ch0.poll() is None and coord.plan.version == 0 and coord.rebalancer.pending is None
    assert coord.stop_reason is None and all(w.status == "running" for w in coord.workers.values())
    # A plan the workers accept still goes through, as v1.
    write_plan(split(graph, at=4), tmp_path / "good.json")
    assert cli_main(["ctl", "--address", address, "--token", TOKEN.decode(), "set-plan", str(tmp_path / "good.json")]) == 0
    assert wait_for(ch0.poll, what="switch").plan.version == 1


def test_a_switch_the_workers_refuse_is_rolled_back_and_the_coordinator_told(running) -> None:
    coord, address, ch0 = running
    with CtlClient(address, TOKEN) as ctl:
        ctl.request("scale", workers=1)
    assert wait_for(ch0.poll, what="switch").plan.version == 1
    ch0.switch_refused(1, "the plan places stages on rank(s) [1] but the world has ranks 0..0")  # what engine.apply sends
    wait_for(lambda: coord.rebalancer.pending is None, what="the pending switch forgotten")
    assert coord.plan.version == 0 and coord.rebalancer.history[-1]["refused"].startswith("the plan places")
    with CtlClient(address, TOKEN) as ctl:  # the next plan gets a fresh version (v1 is spent on the workers' side)
        assert ctl.request("scale", workers=1)["version"] == 2


def test_a_switch_rolled_back_after_it_started_is_forgotten_and_logged(running, caplog) -> None:
    coord, address, ch0 = running
    with CtlClient(address, TOKEN) as ctl:
        ctl.request("scale", workers=1)
    assert wait_for(ch0.poll, what="switch").plan.version == 1
    ch0.switch_failed(1, {1: "RuntimeError: DefaultCPUAllocator: can't allocate memory"})  # what apply_switch sends
    wait_for(lambda: coord.rebalancer.pending is None, what="the rolled-back switch forgotten")
    assert coord.plan.version == 0 and coord.stop_reason is None
    assert coord.rebalancer.history[-1]["rolled_back"] == "rank 1: RuntimeError: DefaultCPUAllocator: can't allocate memory"
    assert "plan v1 failed on rank 1 after the switch started (rank 1: RuntimeError" in caplog.text
    assert "every rank rolled back, the job goes on with plan v0" in caplog.text
    with CtlClient(address, TOKEN) as ctl:  # v1 is spent: the next plan is v2
        assert ctl.request("scale", workers=1)["version"] == 2


class RefusalRecorder(ScriptedChannel):
    """A scripted controller that also records what the runtime says about refused switches."""

    def __init__(self, script):
        super().__init__(script)
        self.refused = []

    def switch_refused(self, version, reason):
        self.refused.append((version, reason))


@pytest.mark.slow
def test_the_runtime_refuses_a_bad_switch_before_moving_anything_and_trains_on(tmp_path) -> None:
    from model_parallel.profiler.trace import trace_model
    from model_parallel.runtime.build.stages import even_plan
    from model_parallel.runtime.build.zoo import recipe
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.engine import PipelineEngine
    from model_parallel.runtime.launch import free_port

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        r = recipe("mlp")
        graph, _ = trace_model(r.model(0), r.example(2))

        def run(channel):
            model = r.model(0)
            engine = PipelineEngine(graph=graph, plan=even_plan(graph, 1), model=model, criterion=r.criterion,
                                    optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.05), dataset=r.data(8, 0),
                                    config=TrainConfig(batch_size=8, num_microbatches=2),
                                    options=RunOptions(progress=False), channel=channel)
            engine.train(4)
            engine.metrics.close()
            return engine, {k: v.detach().clone() for k, v in engine.stage.state_dict().items()}

        too_wide = Plan(tuple(even_plan(graph, 2).stages), version=1)  # 2 stages on ranks 0, 1: the world is rank 0
        channel = RefusalRecorder({2: Command.switch(too_wide, "test: a plan the world cannot run")})
        engine, params = run(channel)
        assert engine.plan.version == 0 and len(engine.history) == 4  # every step ran, on the old plan
        assert [v for v, _ in channel.refused] == [1] and "the world has 1 rank(s)" in channel.refused[0][1]
        _, oracle = run(ScriptedChannel({}))
        for name, value in oracle.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=f"parameter {name}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("replicas, in_file", [(10**15, "replicas exceed 65536"),
                                               (int("9" * 3000), "an integer of 3000 digits (at most 64 are accepted)"),
                                               (30_000_000, "replicas exceed 65536")], ids=["1e15", "3000-digits", "30M"])
def test_absurd_replica_counts_are_refused_in_one_line_before_allocation(replicas, in_file, tmp_path, capsys) -> None:
    graph = chain_graph()
    ids = list(graph.topological_order)
    data = {"schema": PLAN_SCHEMA, "schema_version": 1, "stages": [{"stage_id": 0, "node_ids": ids, "num_replicas": replicas}]}
    started = time.process_time()
    with pytest.raises(PlanError, match=f"exceed {MAX_RANKS}, the most ranks a plan may place"):
        Plan.from_dict(data, "plan.json")
    assert time.process_time() - started < 1.0  # refused, not allocated (a 10**15-entry tuple would never return)
    save_graph(graph, tmp_path / "graph.json")
    (tmp_path / "plan.json").write_text(json.dumps(data))
    code, err = exit_code_and_error(["coordinator", "--graph", str(tmp_path / "graph.json"), "--plan",
                                     str(tmp_path / "plan.json"), "--token", "t", "--port", "0", "--timeout", "5"], capsys)
    assert code == 2 and "plan.json" in err and in_file in err, err


def test_set_plan_replicas_are_bounded_by_the_world_size(running, tmp_path) -> None:
    coord, address, ch0 = running
    ids = list(coord.graph.topological_order)
    for replicas, match in ((20_000_000, "exceed 65536"), (3, "places 3 replica.*world has 2 rank")):
        data = {"schema": PLAN_SCHEMA, "schema_version": 1,
                "stages": [{"stage_id": 0, "node_ids": ids, "num_replicas": replicas}]}
        with CtlClient(address, TOKEN) as ctl, pytest.raises(PlanError, match=match):
            ctl.request("set-plan", plan=data)
    assert coord.handle_ctl("status", {})["plan_version"] == 0  # the lock is free, nothing changed
    assert ch0.poll() is None


def test_plans_are_checked_under_the_schedule_the_workers_run(tmp_path) -> None:
    graph = chain_graph()
    coord = Coordinator(graph, split(graph), TOKEN, policy="manual", heartbeat_timeout=30, solver=default_solver,
                        world_size=3)
    address = f"127.0.0.1:{coord.start('127.0.0.1', 0)}"
    channels = [CoordinatorChannel(address, TOKEN, rank=r, world_size=3, schedule="pipedream") for r in range(3)]
    try:
        for rank, channel in enumerate(channels):
            channel.report(report(rank, 0))
        wait_for(lambda: all(w.reports for w in coord.workers.values()) and len(coord.workers) == 3, what="reports")
        ids = list(graph.topological_order)
        replicated = Plan((StagePlan(0, tuple(ids[:3]), num_replicas=2, ranks=(0, 1)), StagePlan(1, tuple(ids[3:]), ranks=(2,))))
        with CtlClient(address, TOKEN) as ctl, pytest.raises(PlanError, match="pipedream schedule does not support "
                                                                                 "replicated stages"):
            ctl.request("set-plan", plan=replicated.to_dict())
        assert channels[0].poll() is None and coord.plan.version == 0
    finally:
        for channel in channels:
            channel.close()
        coord.stop()


@pytest.mark.slow
def test_two_workers_refuse_a_swapped_plan_together_and_finish_exactly(tmp_path) -> None:
    """Issue 33 item 3 on real processes: before, both workers exited 2 and the work was lost."""
    from model_parallel.graph.plan import read_plan
    from model_parallel.runtime.checkpoint.store import load_checkpoint
    from model_parallel.runtime.launch import launch_workers
    from support.mlp import assert_params_close, mlp_job, reference_params

    graph_path, plan_path = mlp_job(tmp_path, 2)
    plan = read_plan(plan_path)
    swapped = Plan((StagePlan(0, plan.stages[1].node_ids, ranks=(0,)), StagePlan(1, plan.stages[0].node_ids, ranks=(1,))),
                   version=1)
    script = tmp_path / "control.json"
    script.write_text(json.dumps({"2": Command.switch(swapped, "test: stages swapped").to_dict()}), encoding="utf-8")
    steps = 4
    result = launch_workers(["--graph", str(graph_path), "--plan", str(plan_path), "--steps", str(steps),
                             "--control_script", str(script), "--checkpoint_dir", str(tmp_path / "ck"),
                             "--batch_size", "8", "--num_microbatches", "4", "--lr", "0.01", "--timeout", "30"],
                            2, timeout=150)
    assert result.ok, result.summary()  # both exit 0: the switch was refused, not fatal
    for rank in (0, 1):
        assert "refusing the switch to plan v1 (test: stages swapped)" in result.output(rank), result.output(rank)[-2000:]
        assert "goes from stage 1 back to stage 0" in result.output(rank)
    assert_params_close(load_checkpoint(tmp_path / "ck").params(), reference_params(steps), "run after a refused switch")
