"""The ranks of bench/runtime.py's worlds: the benchmark's models, each rank's isolated stage time, and
both runtimes driven side by side in one world (`worker`).

A rank builds torch.distributed.pipelining's stage and schedule (`torch_side`) and our engine
(`ours_side`) for the same graph, plan and data, then the two alternate chunks of steps, each chunk
timed between barriers (`SideRunner`), with its wall time, the process's CPU time and that CPU time
split by thread. bench/runtime.py starts the worlds (`--_worker`) and writes the report.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}

# ----------------------------------------------------------------------------- models and shared set-up


def _bench_mlp() -> torch.nn.Module:
    from model_parallel.models import StackedMLP

    # 8 hidden 1024-wide layers: about 50 ms per fwd+bwd+SGD step at batch 64 on one core (ENV.md).
    return StackedMLP(in_features=256, width=1024, depth=8, num_classes=10)


def _bench_tiny() -> torch.nn.Module:
    from model_parallel.models import StackedMLP

    # Stages of a few microseconds of compute: a step is the runtime's fixed cost (issue #37 item 4).
    return StackedMLP(in_features=16, width=32, depth=2, num_classes=10)


def _bench_resnet50() -> torch.nn.Module:
    from model_parallel.compat import import_torchvision

    return import_torchvision().models.resnet50(num_classes=10)


def _bench_gpt2() -> torch.nn.Module:
    import transformers

    # Scaled to a 2-core machine: 4 blocks of width 128, 64 tokens of a 512-token vocabulary.
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False))


def _lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Token cross entropy of logits (B, T, V), or of a Hugging Face output's "logits", against ids (B, T)."""
    logits = output if isinstance(output, torch.Tensor) else output["logits"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def recipes() -> dict[str, Any]:
    """The benchmark's models, as worker-zoo recipes (seeded builder, loss, input shape)."""
    import torch.nn.functional as F

    from model_parallel.runtime.build.zoo import Recipe, recipe

    return {"mlp": Recipe("mlp", _bench_mlp, F.cross_entropy, (256,), 10), "resnet18": recipe("resnet18"),
            "tiny": Recipe("tiny", _bench_tiny, F.cross_entropy, (16,), 10),
            "resnet50": Recipe("resnet50", _bench_resnet50, F.cross_entropy, (3, 32, 32), 10),
            "gpt2": Recipe("gpt2", _bench_gpt2, _lm_loss, (64,), 512, kind="tokens")}


class AutocastStage(torch.nn.Module):
    """A stage module whose forward runs under bf16 autocast (torch's side of --bf16), as our
    `StepExecutor.forward` runs it; the parameters stay the inner module's (float32)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(*args)


def _float(output: Any) -> Any:
    """The model output in float32 for the criterion (runtime/step/output.py `float_output`)."""
    return output.float() if isinstance(output, torch.Tensor) and output.is_floating_point() else output


def _build(model_name: str, spec: dict[str, Any]):
    """(recipe, model, graph, plan, stage modules) exactly as every process of this benchmark builds them."""
    from model_parallel.codegen.build import build_stages
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import read_plan
    from model_parallel.runtime.build.stages import layer_modules

    entry = spec["models"][model_name]
    rec = recipes()[model_name]
    model = rec.model(spec["seed"])
    graph = load_graph(entry["graph"])
    plan = read_plan(entry["plan"])
    stages = build_stages(graph, plan, modules=layer_modules(graph, model))
    return rec, model, graph, plan, stages


def isolated_stage_ms(rec: Any, stages: Sequence[torch.nn.Module], micro: int, reps: int,
                      only: Optional[int] = None, bf16: bool = False) -> list[float]:
    """Best-of-`reps` forward+backward time of each stage (or of stage `only`) on one microbatch, no communication.

    The minimum, not the median: on a shared machine other processes only ever add time, so the
    fastest repetition is the closest to the stage's own cost. Repetitions alternate between stages.
    """
    inputs, target = rec.data(micro, 0).batch(0)
    stages = [AutocastStage(stage) for stage in stages] if bf16 else list(stages)
    stage_inputs: list[tuple[Any, ...]] = []
    boundary: tuple[Any, ...] = inputs
    with torch.no_grad():
        for stage in stages:
            stage_inputs.append(boundary)
            boundary = tuple(stage(*boundary))

    def fwd_bwd(index: int) -> float:
        stage, last = stages[index], index == len(stages) - 1
        args = tuple(x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                     for x in stage_inputs[index])
        start = time.perf_counter()
        out = stage(*args)
        if last:
            rec.criterion(_float(out[0]), target).backward()
        else:
            tensors = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        return (time.perf_counter() - start) * 1000.0

    indices = range(len(stages)) if only is None else [only]
    samples: list[list[float]] = [[] for _ in stages]
    for rep in range(reps + 2):  # two untimed warm-up rounds
        for index in indices:
            elapsed = fwd_bwd(index)
            if rep >= 2:
                samples[index].append(elapsed)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    return [min(samples[i]) for i in indices]


# ----------------------------------------------------------------------------- workers


def _cpu_ms_by_thread() -> dict[str, float]:
    """CPU ms of each thread of this process so far (/proc/self/task: utime + stime), keyed "tid:name";
    empty where /proc is missing. Tells the main thread's work from gloo's receive thread."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) * 1000.0 / tick
    return out


def _thread_split(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """CPU ms per step: "main" (the training thread: compute, packing, Python), "gloo" (gloo's receive
    threads), "other" (anything else: autograd, prefetch)."""
    split = {"main": 0.0, "gloo": 0.0, "other": 0.0}
    main = f"{threading.get_native_id()}:"
    for key, value in after.items():
        delta = (value - before.get(key, 0.0)) / steps
        kind = "main" if key.startswith(main) else "gloo" if "gloo" in key else "other"
        split[kind] += delta
    return split


class SideRunner:
    """One runtime's side of a world for one schedule: `run(first, end)` trains steps [first, end)."""

    def __init__(self, run: Any, report: Any = None) -> None:
        self.run, self.report = run, report or dict
        self.seconds: list[float] = []  # wall seconds per step of each timed chunk
        self.cpu_ms: list[float] = []  # this process's CPU ms per step of each timed chunk
        self.threads: list[dict[str, float]] = []
        self.steps_done = 0

    def timed_chunk(self, steps: int) -> None:
        """`steps` steps between two barriers (every rank), wall and CPU time per step recorded."""
        import torch.distributed as dist

        first = self.steps_done
        dist.barrier()
        threads, cpu, start = _cpu_ms_by_thread(), time.process_time(), time.perf_counter()
        self.run(first, first + steps)
        dist.barrier()
        self.seconds.append((time.perf_counter() - start) / steps)
        self.cpu_ms.append((time.process_time() - cpu) * 1000.0 / steps)
        self.threads.append(_thread_split(threads, _cpu_ms_by_thread(), steps))
        self.steps_done += steps

    def warm_up(self, steps: int) -> None:
        self.run(self.steps_done, self.steps_done + steps)
        self.steps_done += steps

    def result(self) -> dict[str, Any]:
        return {"step_s": statistics.median(self.seconds), "chunk_step_s": self.seconds,
                "cpu_ms": statistics.median(self.cpu_ms),
                "threads_cpu_ms": {k: statistics.median(t[k] for t in self.threads) for k in self.threads[0]},
                **self.report()}


def torch_side(model_name: str, schedule_name: str, rank: int, world_size: int, spec: dict[str, Any]) -> SideRunner:
    """torch.distributed.pipelining: PipelineStage (manual construction) + Schedule1F1B / ScheduleGPipe."""
    from torch.distributed import pipelining

    rec, _, _, _, stages = _build(model_name, spec)
    entry = spec["models"][model_name]
    module = AutocastStage(stages[rank]) if spec["precision"] == "bf16" else stages[rank]
    last = rank == world_size - 1
    data = rec.data(entry["batch_size"], spec["seed"])

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        # Stage modules return the tuple of their boundary outputs; the model output is its one element.
        return rec.criterion(_float(output[0] if isinstance(output, tuple) else output), target)

    stage = pipelining.PipelineStage(module, rank, world_size, torch.device("cpu"))
    schedule = getattr(pipelining, SCHEDULES[schedule_name])(stage, entry["microbatches"], loss_fn=loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=spec["lr"], momentum=0.9)

    def run_steps(first: int, end: int) -> None:
        for step in range(first, end):
            inputs, target = data.batch(step)
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(*inputs)
            elif last:
                schedule.step(target=target, losses=[])
            else:
                schedule.step()
            optimizer.step()

    return SideRunner(run_steps)


def ours_side(model_name: str, schedule_name: str, rank: int, world_size: int, spec: dict[str, Any],
              control_group: Any) -> SideRunner:
    """Our runtime's worker API (`PipelineEngine`) with the same graph, plan, model, data and optimizer."""
    from model_parallel.runtime.config import RunOptions, TrainConfig
    from model_parallel.runtime.engine import PipelineEngine
    from model_parallel.runtime.observe.metrics import busy_ms, measured_ms

    rec, model, graph, plan, _ = _build(model_name, spec)
    entry = spec["models"][model_name]
    config = TrainConfig(batch_size=entry["batch_size"], num_microbatches=entry["microbatches"], schedule=schedule_name,
                         seed=spec["seed"], bf16=spec["precision"] == "bf16")
    engine = PipelineEngine(
        graph=graph, plan=plan, model=model, criterion=rec.criterion,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=spec["lr"], momentum=0.9),
        dataset=rec.data(entry["batch_size"], spec["seed"]), config=config, control_group=control_group,
        options=RunOptions(timeout=spec["op_timeout"], progress=False),
    )

    def report() -> dict[str, Any]:
        # The engine's own per-step split (runtime.observe.metrics), for the report: where did the time go?
        timed = [r for r in engine.metrics.records if r.step >= spec["warmup"]]
        split = {key: statistics.mean(getattr(r, key) for r in timed) for key in ("step_ms", "compute_ms", "comm_ms", "idle_ms")}
        split["busy_ms"] = statistics.median(busy_ms(r) for r in timed)
        # What predict_stage_ms predicts on the calibration's clock (CPU ms or busy ms per step), and the
        # measured breakdown to hold its terms against (wall ms, medians over the timed steps).
        split["measured_ms"] = statistics.median(measured_ms(r, spec["clock"]) for r in timed)
        split["cpu_ms"] = statistics.median(r.cpu_ms for r in timed)
        split["breakdown_ms"] = {key: statistics.median(getattr(r, key) for r in timed)
                                 for key in ("forward_ms", "backward_ms", "optimizer_ms", "send_ms", "recv_ms", "allreduce_ms")}
        return {"split": split}

    return SideRunner(lambda first, end: engine.train(end, start_step=first), report)


def worker(side: str, model_name: str, rank: int, world_size: int, port: int, spec_path: str, result_path: str) -> int:
    """One rank of one world: every schedule of one model, each on `side` ("torch", "ours" or "both":
    the two runtimes in the same processes, alternating chunks of steps, the order flipping every chunk)."""
    import torch.distributed as dist

    from model_parallel.allocator import keep_freed_memory
    from model_parallel.fileio import atomic_write_json

    torch.set_num_threads(1)
    keep_freed_memory()  # both sides: our workers tune the allocator, so the baseline gets it too
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=spec["op_timeout"]))
    results: dict[str, Any] = {}
    try:
        # Each rank times its own stage alone (no communication), one rank after the other: with more
        # ranks than cores, ranks timing at once would share a core and read up to 2x (wall clock).
        rec, _, _, _, stages = _build(model_name, spec)
        micro = spec["models"][model_name]["batch_size"] // spec["models"][model_name]["microbatches"]
        for turn in range(world_size):
            dist.barrier()
            if turn == rank:
                results["stage_ms"] = isolated_stage_ms(rec, stages, micro, spec["isolated_reps"], only=rank,
                                                        bf16=spec["precision"] == "bf16")[0]
        dist.barrier()
        control_group = dist.new_group(backend="gloo") if side != "torch" else None
        names = ["torch", "ours"] if side == "both" else [side]
        for schedule_name in spec["schedules"]:
            runners = {name: torch_side(model_name, schedule_name, rank, world_size, spec) if name == "torch"
                       else ours_side(model_name, schedule_name, rank, world_size, spec, control_group) for name in names}
            for runner in runners.values():
                runner.warm_up(spec["warmup"])
            for chunk in range(spec["chunks"]):
                for name in (names if chunk % 2 == 0 else names[::-1]):
                    runners[name].timed_chunk(spec["chunk_steps"])
            for name, runner in runners.items():
                result = results.setdefault("schedules", {}).setdefault(schedule_name, {})[name] = runner.result()
                print(f"rank {rank}: {name} {model_name} {schedule_name}: {1.0 / result['step_s']:.2f} steps/s", flush=True)
    finally:
        dist.destroy_process_group()
    atomic_write_json(result_path, results)
    return 0
