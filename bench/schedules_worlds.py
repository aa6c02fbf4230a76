"""The ranks of bench/schedules.py's worlds: every schedule of both runtimes on emulated devices, alternating.

A rank builds, for one (p, m), torch.distributed.pipelining's stages and schedule for each torch
schedule and our `PipelineEngine` for each of ours (`SCHEDULE_NAMES`), all on the same emulated
model (bench/emulated.py), then every side trains chunks of steps in turn, the order flipping every
chunk, each chunk timed between barriers (`runtime_worlds.SideRunner`). Besides wall time per step,
each chunk records the emulated busy ms this rank waited, from which the bubble is measured, and the
process's CPU ms (every thread): with compute a sleep, that is the runtime's own cost per step.
"""
from __future__ import annotations

import json
import statistics
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from emulated import BUSY, EmulatedModel  # bench/ is the script's directory: first on sys.path
from runtime_worlds import SideRunner

# torch schedule -> (stages per rank, placement): "loop" puts stages r, r + p, ... on rank r; "v" puts r and 2p-1-r.
TORCH_SCHEDULES = {
    "ScheduleGPipe": (1, "loop"), "Schedule1F1B": (1, "loop"), "ScheduleInterleaved1F1B": (2, "loop"),
    "ScheduleLoopedBFS": (2, "loop"), "ScheduleInterleavedZeroBubble": (2, "loop"),
    "ScheduleZBVZeroBubble": (2, "v"), "ScheduleDualPipeV": (2, "v"),
}


def stage_indices(rank: int, p: int, v: int, placement: str) -> list[int]:
    """The pipeline stages rank `rank` of `p` holds with `v` stages per rank."""
    if placement == "v":
        return [rank, 2 * p - 1 - rank] if v == 2 else [rank]
    return [rank + k * p for k in range(v)]


def layer_counts(graph: Any, plan: Any) -> list[int]:
    """Emulated layers per stage of `plan` (the model input, not a layer, rides with stage 0)."""
    return [sum(1 for n in st.node_ids if graph[n].layer is not None and graph[n].layer.op == "call_module")
            for st in plan.stages]


def build_model(spec: dict[str, Any]) -> EmulatedModel:
    e = spec["emulation"]
    return EmulatedModel(spec["num_layers"], e["width"], e["forward_ms"], e["input_ms"], e["weight_ms"])


def _data(spec: dict[str, Any]) -> Any:
    from model_parallel.runtime.data.batches import SyntheticData

    width = spec["emulation"]["width"]
    return SyntheticData(spec["batch_size"], (width,), width, "dense", spec["seed"])


def _loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    # Stage modules return the tuple of their boundary outputs; the model output is its one element.
    return torch.nn.functional.cross_entropy(output[0] if isinstance(output, tuple) else output, target)


class BusyRun:
    """A side's `run(first, end)` that also records the emulated busy ms of each call (call 0: the warm-up)."""

    def __init__(self, run: Callable[[int, int], None]) -> None:
        self.inner, self.busy_ms = run, []

    def __call__(self, first: int, end: int) -> None:
        before = BUSY.busy_ms
        self.inner(first, end)
        self.busy_ms.append((BUSY.busy_ms - before) / (end - first))


def torch_side(name: str, rank: int, spec: dict[str, Any], plan_key: Any = None) -> tuple[SideRunner, BusyRun]:
    """torch.distributed.pipelining: this rank's PipelineStage(s) and the schedule `name`, on the equal plan of its
    stage count or on `spec["plans"][plan_key]` (the straggler world's rebalanced loop plan: stage k on rank k % p)."""
    from torch.distributed import pipelining

    from model_parallel.codegen.build import build_stages
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import read_plan
    from model_parallel.runtime.build.stages import layer_modules

    cls = getattr(pipelining, name, None)
    if cls is None:  # an older torch (a lent GPU machine brings its own): a row that says so, not a failed world
        raise ValueError(f"torch {torch.__version__} has no torch.distributed.pipelining.{name}")
    p = spec["p"]
    v, placement = TORCH_SCHEDULES[name]
    if placement == "v" and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13):
        # Seen on a lent GPU machine's torch 2.11: stage p-1 sends to stage p on its own rank through gloo, which
        # has no pair to itself ("Pair is not connected"), and the whole world dies. A row that says so instead.
        raise ValueError(f"torch {torch.__version__}'s V-placement schedules send to their own rank over gloo "
                         "(failed on 2.11); this project's torch 2.13 runs them")
    graph, model = load_graph(spec["graph"]), build_model(spec)
    modules = build_stages(graph, read_plan(spec["plans"][plan_key or str(p * v)]), modules=layer_modules(graph, model))
    mine = stage_indices(rank, p, v, placement)
    # Static shapes (every boundary is one [microbatch, width] tensor): no shape inference over the wire, which
    # an older torch on a lent GPU machine failed in (`recv_object_list` in torch 2.11).
    # requires_grad as in training: torch decides from these which gradients travel back.
    stages = []
    for k in mine:
        example = torch.zeros(spec["batch_size"] // spec["m"], spec["emulation"]["width"], requires_grad=k > 0)
        stages.append(pipelining.PipelineStage(modules[k], k, p * v, torch.device("cpu"), input_args=(example,),
                                               output_args=modules[k](example)))
    schedule = cls(stages if v > 1 else stages[0], spec["m"], loss_fn=_loss)
    params = [q for k in mine for q in modules[k].parameters()]
    optimizer = torch.optim.SGD(params, lr=spec["lr"], momentum=0.9)
    first_stage, last_stage = 0 in mine, p * v - 1 in mine
    data = _data(spec)

    def run_steps(first: int, end: int) -> None:
        for step in range(first, end):
            inputs, target = data.batch(step)
            optimizer.zero_grad(set_to_none=True)
            kwargs = {"target": target, "losses": []} if last_stage else {}
            schedule.step(*(inputs if first_stage else ()), **kwargs)
            optimizer.step()

    busy = BusyRun(run_steps)
    return SideRunner(busy), busy


def ours_side(name: str, rank: int, spec: dict[str, Any], control_group: Any, plan_key: str,
              channel: Any = None, order: str = "list") -> tuple[SideRunner, BusyRun, Any]:
    """Our `PipelineEngine` with schedule `name` on the plan `spec["plans"][plan_key]`; with `channel`
    (a coordinator's), the live rebalancer may switch its plan while it trains."""
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import read_plan
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.engine import PipelineEngine

    config = TrainConfig(batch_size=spec["batch_size"], num_microbatches=spec["m"], schedule=name, seed=spec["seed"],
                         schedule_order=order)  # zero bubble: list-built from the plan's stage times, or torch's
    engine = PipelineEngine(
        graph=load_graph(spec["graph"]), plan=read_plan(spec["plans"][plan_key]), model=build_model(spec),
        criterion=_loss, optimizer_factory=lambda params: torch.optim.SGD(params, lr=spec["lr"], momentum=0.9),
        dataset=_data(spec), config=config, control_group=control_group,
        options=RunOptions(timeout=spec["op_timeout"], progress=False), channel=channel,
    )
    busy = BusyRun(lambda first, end: engine.train(end, start_step=first))
    return SideRunner(busy), busy, engine


def worker(rank: int, port: int, spec_path: str, result_path: str) -> int:
    """One rank of one world: every side of the spec, alternating timed chunks, the order flipping every chunk."""
    import torch.distributed as dist

    from model_parallel.allocator import keep_freed_memory
    from model_parallel.fileio import atomic_write_json
    from model_parallel.graph.loader import register_layer_classes
    from emulated import EmulatedLayer

    torch.set_num_threads(1)
    keep_freed_memory()
    register_layer_classes(EmulatedLayer)  # this process built the model the graph was traced from
    spec = json.loads(Path(spec_path).read_text())
    if rank == spec.get("slow_rank"):
        BUSY.scale = spec["slowdown"]  # both runtimes alike: every wait of this rank is stretched
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=spec["p"],
                            timeout=timedelta(seconds=spec["op_timeout"]))
    results: dict[str, Any] = {}
    try:
        control_group = dist.new_group(backend="gloo")
        runners: dict[str, Any] = {}  # key -> [SideRunner, BusyRun]
        engines: dict[str, Any] = {}
        channels: dict[str, Any] = {}
        for side in spec["sides"]:  # {"key", "runtime", "schedule", "plan"}
            if side["runtime"] == "torch":
                try:
                    runners[side["key"]] = torch_side(side["schedule"], rank, spec, side.get("plan"))
                except ValueError as refused:  # e.g. DualPipeV with fewer microbatches than stages: every rank alike
                    results[side["key"]] = {"refused": str(refused)}
            else:
                if "coordinator" in side:
                    from model_parallel.coordinator.client import CoordinatorChannel

                    # re-planned under its schedule's rules; m: the plans it issues carry per-microbatch stage times
                    channels[side["key"]] = CoordinatorChannel(side["coordinator"], side["token"].encode(), rank, spec["p"],
                                                               schedule=side["schedule"], num_microbatches=spec["m"])
                *runners[side["key"]], engines[side["key"]] = ours_side(
                    side["schedule"], rank, spec, control_group, side["plan"], channels.get(side["key"]),
                    side.get("order", "list"))
        for key, (runner, _) in runners.items():
            # A live side first trains `settle_steps` more: the coordinator sees the straggler and switches there.
            runner.warm_up(spec["warmup"] + next((s.get("settle_steps", 0) for s in spec["sides"] if s["key"] == key), 0))
        keys = list(runners)
        for chunk in range(spec["chunks"]):
            for key in (keys if chunk % 2 == 0 else keys[::-1]):
                runners[key][0].timed_chunk(spec["chunk_steps"])
        for key, (runner, busy) in runners.items():
            results[key] = {"chunk_step_s": runner.seconds, "chunk_busy_ms": busy.busy_ms[1:],
                            "step_s": statistics.median(runner.seconds), "chunk_cpu_ms": runner.cpu_ms,
                            "chunk_main_cpu_ms": [t["main"] for t in runner.threads]}
        for key, engine in engines.items():
            versions = [(r.step, r.plan_version) for r in engine.metrics.records]
            switches = [step for (step, v), (_, before) in zip(versions[1:], versions) if v != before]
            results[key] |= {"switch_steps": switches, "switch_pauses_ms": list(engine.switch_pauses_ms),
                             "layers": layer_counts(engine.graph, engine.plan),
                             "schedule_order": engine.schedule.order}  # "list": zero bubble's order list-built (its times)
        for channel in channels.values():
            channel.close("benchmark finished")
    finally:
        dist.destroy_process_group()
    atomic_write_json(result_path, results)
    return 0
