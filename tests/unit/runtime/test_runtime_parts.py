"""Runtime pieces that need no process group: control messages, value encoding, health diagnosis,
the launcher, plans and transfers, options in single-process mode, and the Python API."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import pytest
import torch

from model_parallel.api.trainer import PipelineTrainer
from model_parallel.errors import ModelParallelError, PeerError, ProtocolError
from model_parallel.graph.plan import Plan
from model_parallel.messages import Command, ControlChannel, NullChannel, ScriptedChannel, StepReport
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan, layer_owners
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import launch
from model_parallel.runtime.step.update import clip_coefficient, lr_factor
from model_parallel.runtime.trainer import SingleProcessRunner, single_process_reference
from model_parallel.runtime.wire import structure
from model_parallel.runtime.wire.health import Health
from model_parallel.runtime.wire.migration import plan_transfers
from support.stores import DictStore


@pytest.fixture(scope="module")
def mlp_graph():
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    return graph


# ---- control -------------------------------------------------------------------------------------
def test_command_round_trip_and_errors():
    plan = Plan.from_dict(even_plan(trace_model(recipe("mlp").model(0), recipe("mlp").example(2))[0], 2).to_dict())
    for command in (Command.proceed(), Command.stop("done"), Command.slowdown(2, 2.0), Command.switch(plan, "faster")):
        assert Command.from_json(command.to_json()) == command
    with pytest.raises(ProtocolError, match="unknown command kind 'pause'"):
        Command("pause")
    with pytest.raises(ProtocolError, match="'switch' command needs the new plan"):
        Command("switch")
    with pytest.raises(ProtocolError, match="slowdown factor must be >= 1.0"):
        Command.slowdown(1, 0.5)
    with pytest.raises(ProtocolError, match="not valid JSON"):
        Command.from_json("{nope")
    assert isinstance(NullChannel(), ControlChannel)


def test_switch_command_carries_a_plan_and_refuses_a_bad_one():
    plan = even_plan(trace_model(recipe("mlp").model(0), recipe("mlp").example(2))[0], 2)
    command = Command.from_json(Command.switch(plan, "faster").to_json())
    assert isinstance(command.plan, Plan) and command.plan == plan
    with pytest.raises(ProtocolError, match="needs the new plan \\(a Plan\\)"):
        Command("switch", plan=plan.to_dict())  # a dict is not a plan: parse it with Plan.from_dict
    with pytest.raises(ProtocolError, match="switch command's plan: not a model_parallel plan"):
        Command.from_dict({"kind": "switch", "plan": {"stages": []}})
    with pytest.raises(ProtocolError, match="malformed command"):  # a stage that is not an object
        Command.from_dict({"kind": "switch", "plan": {**plan.to_dict(), "stages": [1]}})


def step_report(step, **changes):
    values = dict(rank=0, step=step, plan_version=0, stage=0, step_ms=20.0, compute_ms=12.0, comm_ms=3.0, idle_ms=5.0,
                  samples_per_s=400.0, loss=2.5)
    return StepReport(**{**values, **changes})


def test_step_report_round_trips_in_milliseconds():
    report = step_report(3, stage=None, loss=None)
    assert StepReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert report.to_dict()["compute_ms"] == 12.0 and "compute_s" not in report.to_dict()
    assert StepReport.from_dict({**report.to_dict(), "idle_ms": -0.5}).idle_ms == -0.5  # rounding slack


@pytest.mark.parametrize("changes, match", [
    ({"compute_ms": float("nan")}, r"compute_ms=nan is not finite"),
    ({"comm_ms": -3.0}, r"comm_ms=-3 is negative"),
    ({"step_ms": 1e308}, r"step_ms=1e\+308 exceeds 8.64e\+07"),
    ({"samples_per_s": 1e12}, r"samples_per_s=1e\+12 exceeds"),
    ({"idle_ms": -50.0}, r"idle_ms=-50 is negative"),
    ({"step": -1}, r"step=-1 is negative"),
    ({"rank": True}, r"rank=True is not an integer"),
    ({"stage": "1"}, r"stage='1' is not an integer"),
    ({"compute_ms": "4"}, r"compute_ms='4' is not a number"),
    ({"loss": float("inf")}, r"loss=inf is not a finite number"),
])
def test_step_report_rejects_absurd_values_naming_the_field(changes, match):
    with pytest.raises(ProtocolError, match=r"step report of rank \S+ for step \S+: .*" + match):
        StepReport.from_dict({**step_report(3).to_dict(), **changes})


def test_step_report_names_every_problem_and_missing_fields():
    with pytest.raises(ProtocolError, match=r"comm_ms=1e\+300 exceeds .*; idle_ms=-50 is negative"):
        StepReport.from_dict({**step_report(3).to_dict(), "comm_ms": 1e300, "idle_ms": -50.0})
    partial = step_report(3).to_dict()
    del partial["step_ms"]
    with pytest.raises(ProtocolError, match=r"missing field\(s\) \['step_ms'\]"):
        StepReport.from_dict(partial)
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        StepReport.from_dict([1, 2])


def test_scripted_channel_plays_commands_before_their_step():
    channel = ScriptedChannel.from_json(json.dumps({"2": {"kind": "stop", "reason": "scripted"}}))
    channel.report(step_report(0))
    assert channel.poll() is None
    channel.report(step_report(1))
    assert channel.poll() == Command.stop("scripted")
    assert len(channel.reports) == 2
    with pytest.raises(ProtocolError, match=r"apply before step >= 1, got step\(s\) \[0\]"):
        ScriptedChannel({0: Command.stop()})


# ---- values on the wire --------------------------------------------------------------------------
def test_boundary_values_encode_as_json():
    values = [3, 2.5, True, None, (1, 2), torch.Size([4, 5]), torch.float16, torch.device("cpu"), [1, (2,)]]
    encoded = json.loads(json.dumps([structure.encode_value(v) for v in values]))
    assert [structure.decode_value(e) for e in encoded] == values
    header = structure.make_header([torch.zeros(2, 3, requires_grad=True), torch.Size([2])])
    assert header == [{"t": "tensor", "shape": [2, 3], "dtype": "float32", "grad": True},
                      {"t": "json", "v": {"size": [2]}}]
    with pytest.raises(PeerError, match="cannot send a value of type object"):
        structure.encode_value(object())


# ---- health --------------------------------------------------------------------------------------
class FakeStore(DictStore):
    """A dict with the TCPStore calls Health uses."""

    def set_timeout(self, timeout) -> None:
        pass


def test_health_names_the_rank_whose_heartbeat_stopped():
    store = FakeStore()
    beating = [Health(store, r, 3, interval=0.05).start() for r in (0, 1)]
    store.set("mp/hb/2", f"{time.time() - 5:.3f}")  # rank 2 beat once, 5 s ago
    try:
        error = beating[0].diagnose(RuntimeError("Connection reset by peer"))
    finally:
        for h in beating:
            h.stop()
    assert isinstance(error, PeerError)
    assert str(error).startswith("rank 2 stopped responding (last heartbeat 5.")
    assert "Connection reset by peer" in str(error)
    # rank 1 later fails too and reuses rank 0's conclusion instead of blaming rank 0
    again = Health(store, 1, 3, interval=0.05).diagnose(RuntimeError("closed"))
    assert str(again).startswith("rank 2 stopped responding (last heartbeat 5.")
    assert "(found by rank 0); closed" in str(again)


def test_a_reused_cause_names_the_rank_that_found_it_first_once():
    store = FakeStore()
    store.set("mp/status/1", json.dumps({"state": "failed", "blame": 2,
                                         "cause": "rank 2 stopped responding (last heartbeat 1.5 s ago) (found by rank 3)"}))
    error = Health(store, 0, 4, interval=0.05).diagnose(RuntimeError("Connection closed by peer"))
    assert "(last heartbeat 1.5 s ago) (found by rank 3); Connection closed by peer" in str(error), str(error)
    assert str(error).count("found by") == 1, str(error)


def test_health_blames_the_store_host_when_the_store_is_gone():
    class DeadStore(FakeStore):
        def check(self, keys):
            raise RuntimeError("Connection refused")

    error = Health(DeadStore(), 1, 2, interval=0.05).diagnose(RuntimeError("recv failed"))
    assert str(error).startswith("rank 0 stopped responding (it hosts the rendezvous store")


def test_health_blames_its_own_memory_when_it_cannot_start_a_thread():
    # Under RLIMIT_DATA a rank at its limit cannot start the thread a store call needs: the store is fine.
    class NoThreads(FakeStore):
        def check(self, keys):
            raise RuntimeError("can't start new thread")

    error = Health(NoThreads(), 1, 2, interval=0.05).diagnose(RuntimeError("recv failed"))
    assert str(error).startswith("rank 1 could not ask the rendezvous store who failed: this process is out of memory")
    assert "stopped responding" not in str(error) and "recv failed" in str(error)


def test_health_gives_up_on_a_store_that_never_answers():
    # A cut link sends no reset: TCPStore.check would block forever. The diagnosis must not.
    import threading

    release = threading.Event()

    class SilentStore(FakeStore):
        def check(self, keys):
            release.wait(30)  # "forever"; released at the end so the abandoned thread ends too
            return False

    health = Health(SilentStore(), 1, 2, interval=0.05, store_timeout=0.5, store_address="10.200.0.1:29500")
    result: list = []

    def diagnose() -> None:
        result.append(health.diagnose(RuntimeError("barrier timed out after 5 s")))
        health.stop("failed")  # must not wait on the dead store again

    worker = threading.Thread(target=diagnose, daemon=True)
    try:
        worker.start()
        worker.join(timeout=20)  # the silent store answers after 30 s: still waiting means it waited on it
        assert not worker.is_alive(), "diagnose or stop waited on the dead store beyond its 0.5 s timeout"
    finally:
        release.set()
    error = result[0]
    assert str(error).startswith("rank 0 stopped responding (it hosts the rendezvous store at 10.200.0.1:29500, "
                                 "which is unreachable: store check of 'mp/status/0' got no answer within 0.5 s)")
    assert str(error).endswith("; barrier timed out after 5 s")  # no "rank -1": a collective is not a rank


# ---- plans and transfers ----------------------------------------------------------------------------
def test_even_plan_is_contiguous_and_balanced(mlp_graph):
    plan = even_plan(mlp_graph, 3, {1: 2})
    assert [s.ranks for s in plan.stages] == [(0,), (1, 2), (3,)]
    order = list(mlp_graph.topological_order)
    flat = [n for s in plan.stages for n in s.node_ids]
    assert flat == order  # contiguous ranges in topological order, inputs in stage 0
    with pytest.raises(ModelParallelError, match="cannot split 15 layer node"):
        even_plan(mlp_graph, 99)


def test_transfers_move_only_changing_layers(mlp_graph):
    old = even_plan(mlp_graph, 2)
    new = replace(even_plan(mlp_graph, 2), stages=tuple(replace(s, ranks=(s.stage_id + 2,)) for s in old.stages))
    moves = plan_transfers(mlp_graph, old, new)
    owners = layer_owners(mlp_graph, old)
    assert moves and all(src == owners[layer][0] and dst == src + 2 for src, dst, layer in moves)
    assert plan_transfers(mlp_graph, old, old) == []
    replicated = even_plan(mlp_graph, 2, {0: 2})  # stage 0 on ranks 0,1; stage 1 on rank 2
    moves = plan_transfers(mlp_graph, old, replicated)
    assert {(src, dst) for src, dst, _ in moves} == {(0, 1), (1, 2)}


# ---- options -------------------------------------------------------------------------------------------
def test_lr_schedules_and_clip_coefficient():
    assert lr_factor("constant", 7) == 1.0
    assert lr_factor("cosine:10", 0) == 1.0 and lr_factor("cosine:10", 10) == pytest.approx(0.0)
    assert lr_factor("warmup:4", 0) == 0.25 and lr_factor("warmup:4", 9) == 1.0
    assert lr_factor("step:2:0.5", 5) == 0.25  # 0.5 ** (5 // 2)
    with pytest.raises(ModelParallelError, match="bad --lr_schedule 'linear'"):
        lr_factor("linear", 0)
    assert clip_coefficient(2.0, 1.0) == pytest.approx(0.5, rel=1e-5) and clip_coefficient(0.5, 1.0) == 1.0


def test_train_config_checks():
    with pytest.raises(ModelParallelError, match="unknown schedule 'zb'"):
        TrainConfig(schedule="zb")
    with pytest.raises(ModelParallelError, match="--clip_grad needs a flush schedule"):
        TrainConfig(schedule="pipedream", clip_grad=1.0)
    with pytest.raises(ModelParallelError, match="clip_grad must be > 0"):
        TrainConfig(clip_grad=0.0)
    assert TrainConfig(recompute=(1,)).recompute_stage(1) and not TrainConfig(recompute=(1,)).recompute_stage(0)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def test_single_process_bf16_and_recompute_train(mlp_graph):
    r = recipe("mlp")
    config = TrainConfig(batch_size=8, num_microbatches=2, bf16=True, recompute=True, clip_grad=1.0)
    model = r.model(0)
    before = [p.detach().clone() for p in model.parameters()]
    runner = SingleProcessRunner(mlp_graph, even_plan(mlp_graph, 2), model, r.criterion, _sgd, r.data(8, 0), config)
    results = runner.train(2)
    assert all(torch.isfinite(torch.tensor(x.loss)) for x in results)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_python_api_single_process_matches_reference():
    r = recipe("gpt")
    data = r.data(8, 0)
    config = TrainConfig(batch_size=8, num_microbatches=4, clip_grad=0.5)
    trainer = PipelineTrainer(r.model(0), _sgd, data, config, criterion=r.criterion, num_stages=3)
    assert trainer.single_process and trainer.plan.num_stages == 3
    losses = [x.loss for x in trainer.train(3)]
    reference_model = r.model(0)
    want = single_process_reference(reference_model, r.criterion, _sgd, data, config, 3)
    assert losses == pytest.approx(want, rel=1e-6)
    from model_parallel.codegen.naming import state_key

    got = trainer.state_dict()
    for name, value in reference_model.named_parameters():
        torch.testing.assert_close(got[state_key(name)], value.detach(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_graph_file_and_imagefolder_in_single_process_mode(tmp_path, capsys):
    from PIL import Image

    from model_parallel.cli.worker import main
    from model_parallel.graph.io import save_graph
    from model_parallel.runtime.data.batches import ImageFolderData

    for label in ("cat", "dog"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (40, 36), (40 * i, 100 if label == "cat" else 200, 7)).save(tmp_path / "images" / label / f"{i}.png")
    data = ImageFolderData(tmp_path / "images", batch_size=4, image_size=32, seed=1)
    (x,), y = data.batch(1)
    assert x.shape == (4, 3, 32, 32) and data.num_classes == 2
    assert torch.equal(ImageFolderData(tmp_path / "images", 4, 32, 1).batch(1)[1], y)  # keyed by (seed, step)

    r = recipe("resnet18")
    graph, _ = trace_model(r.model(0), r.example(2))
    save_graph(graph, tmp_path / "graph.json")
    assert main(["--single_process", "--graph", str(tmp_path / "graph.json"), "--num_stages", "2", "--steps", "1",
                 "--batch_size", "4", "--num_microbatches", "2", "--data", str(tmp_path / "images")]) == 0
    assert "step 0 loss" in capsys.readouterr().out
    with pytest.raises(ModelParallelError, match="not a directory"):
        ImageFolderData(tmp_path / "missing", 4)


def test_generated_package_runs_in_single_process_mode(tmp_path, mlp_graph, capsys):
    from model_parallel.cli.worker import main
    from model_parallel.codegen.package import generate_package

    generate_package(mlp_graph, even_plan(mlp_graph, 3), tmp_path / "pkg", "StackedMLPPipe", "mlp")
    assert main(["--single_process", "--package", str(tmp_path / "pkg"), "--steps", "2"]) == 0
    assert "step 1 loss" in capsys.readouterr().out


def test_hybrid_conf_places_package_stages(tmp_path, mlp_graph):
    from model_parallel.api.job import ranks_from_hybrid_conf
    from model_parallel.errors import PlanError

    plan = even_plan(mlp_graph, 2)
    conf = tmp_path / "hybrid_conf.json"
    conf.write_text(json.dumps({"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0, 1, 2], "1": [3]}}))
    placed = ranks_from_hybrid_conf(plan, conf)
    assert [s.ranks for s in placed.stages] == [(0, 1, 2), (3,)] and placed.stages[0].num_replicas == 3
    assert ranks_from_hybrid_conf(plan, tmp_path / "missing.json") is plan
    conf.write_text(json.dumps({"stage_to_rank_map": {"0": [0]}}))
    with pytest.raises(PlanError, match=r"names stages \[0\], the plan has 0..1"):
        ranks_from_hybrid_conf(plan, conf)
    # Ranks are JSON integers: 0.7, true and "01" used to read as 0, 1 and (0, 1).
    for ranks, words in (([0.7], r"stage_to_rank_map\['0'\]: 0.7 is not an integer"),
                         ([True], r"stage_to_rank_map\['0'\]: true is not an integer"),
                         ("01", r"stage_to_rank_map\['0'\] must be a list of ranks, found \"01\"")):
        conf.write_text(json.dumps({"stage_to_rank_map": {"0": ranks, "1": [1]}}))
        with pytest.raises(PlanError, match=words):
            ranks_from_hybrid_conf(plan, conf)
    conf.write_text(json.dumps({"stage_to_rank_map": {"00": [0], "1": [1]}}))
    with pytest.raises(PlanError, match=r"key '00' is not a stage number"):
        ranks_from_hybrid_conf(plan, conf)


def test_health_names_ranks_started_with_different_step_counts():
    # Both alive and beating, one past its last step: "slow peer? raise --timeout" was the advice, which cannot help.
    store = FakeStore()
    ranks = [Health(store, r, 2, interval=0.05).start() for r in (0, 1)]
    try:
        ranks[0].announce_end_step(10)
        ranks[1].announce_end_step(20)
        error = ranks[1].diagnose(RuntimeError("Timed out waiting"))
    finally:
        for health in ranks:
            health.stop()
    assert str(error).startswith("the ranks were started with different step counts (rank 0 trains to step 10, "
                                 "rank 1 trains to step 20)"), str(error)
    assert "give every worker the same --steps" in str(error) and "raise --timeout" not in str(error)
    # The same end step everywhere: not the cause.
    store = FakeStore()
    ranks = [Health(store, r, 2, interval=0.05).start() for r in (0, 1)]
    try:
        for health in ranks:
            health.announce_end_step(10)
        assert "step counts" not in str(ranks[0].diagnose(RuntimeError("Timed out waiting")))
    finally:
        for health in ranks:
            health.stop()


def test_health_reports_a_peer_that_failed_on_its_own():
    store = FakeStore()
    Health(store, 1, 2, interval=0.05).start().stop("failed", None, "PlanError: bad plan")
    error = Health(store, 0, 2, interval=0.05).diagnose(RuntimeError("Connection closed by peer"))
    assert str(error).startswith("rank 1 failed: PlanError: bad plan; Connection closed by peer")
