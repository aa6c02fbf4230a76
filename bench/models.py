"""Models benchmark: one row per Hugging Face / timm model (GPT-2, BERT-MLM, Llama, OPT, T5, ViT, EfficientNet-B0).

    python bench/models.py             # warmup 1, 5 timed replays per node, 9 measured steps
    python bench/models.py --quick     # 1 timed replay per node, 3 measured steps (about 2-3 minutes)
    python bench/models.py --models gpt2,vit --calibration calibration.json
    python bench/models.py --clock cpu --profile-only   # accuracy rows only, CPU time (a shared machine)
    python bench/models.py --size bench                 # width 256, 4 blocks, 64 tokens, 64x64 images

`--size test` (default) runs the tiny configurations of the exactness tests (tests/support/hf_zoo.py:
2 blocks, width 32, vocabulary 64, 8 tokens; timm at 32x32); their steps are ~2 ms, mostly per-operator
dispatch and module-call Python. `--size bench` runs the same models at width 256, 4 blocks (ViT 8),
64 tokens, vocabulary 1024, 64x64 images: steps of tens of ms where compute dominates, as in the
models people pipeline. Both at one microbatch of 2 samples (batch 8, 4 microbatches). Per row:
- nodes: graph nodes (torch.export: ATen operators);
- profile_accuracy: (sum of the per-node forward + backward times + the loss) / a measured plain
  training step (forward + backward, no optimizer) of the same microbatch of the unmodified model,
  on the same clock (`--clock`): the median over `--rounds` profiles of each one's sum / the median
  of the plain steps timed just before and after it (the profile with the median sum is kept for
  partitioning; sum_of_nodes_ms and measured_step_ms are the medians overall); the profile's
  timing method (`--timing`, default in situ on CPU) and its instrumented step are in the row too;
- graph_step_ms / profile_accuracy_vs_graph_step: the same plain step run by the traced graph's
  GraphModule (no eager Python between operators: what stage code runs), and the sum over it;
- partition_s: `partition` wall time on one level (2 workers, straight pipeline: the plan that runs)
  and on two levels (2 machines x 2 workers, default options);
- predicted_stage_ms / measured_stage_ms: each stage rank's busy time per step of the 2-stage run
  (`optimizer.fidelity.predict_stage_ms` with the machine's calibration on `--clock`; measured: the median
  `runtime.observe.metrics.measured_ms` on that clock (the rank's CPU ms, or wall busy ms) of its step records after 2 warm-up steps, 10 steps of PipelineTrainer on
  a 2-rank gloo world, one world for every model: tests/support/hf_worker.py).

Writes `bench/results/models.json` (`models_bench.json` with `--size bench`; atomically) with the 1-minute load average before and after.
Timings on a shared 2-core machine are noisy: compare numbers from the same run only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the model cases: tests/support/hf_zoo.py

import torch  # noqa: E402

from model_parallel.fileio import atomic_write_json  # noqa: E402
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import write_plan  # noqa: E402
from model_parallel.optimizer.options import PartitionOptions  # noqa: E402
from model_parallel.optimizer.partition import partition  # noqa: E402
from model_parallel.profiler.api import output_dicts, profile  # noqa: E402
from model_parallel.profiler.timing import time_training_step  # noqa: E402
from model_parallel.profiler.trace import flat_inputs, split_inputs, trace_model  # noqa: E402
from support import hf_worker  # noqa: E402
from support.hf_zoo import CASES, SIZES, cases  # noqa: E402

MICRO = hf_worker.BATCH // hf_worker.MICROBATCHES
WARMUP_STEPS = 2


def prepare(name: str, quick: bool, calibration: Any, workdir: Path, clock: str = "wall", timing: str = "auto",
            stages: bool = True, rounds: int = 5, size: str = "test") -> dict[str, Any]:
    """Profile, time plain steps, partition (1 and 2 levels), predict the 2-stage plan's stage times."""
    from model_parallel.optimizer.fidelity import predict_stage_ms

    case = cases(SIZES[size])[name]
    model, example = case.build(), case.example(MICRO)
    target = case.data.batch(0)[1][:MICRO]
    loss_fn = lambda out: case.loss(out, target)  # noqa: E731
    inputs = [example] if isinstance(example, dict) else list(example)
    count = 3 if quick else 9
    load_before = os.getloadavg()[0]
    # Rounds interleave plain steps and profiles: each profile is compared with the plain steps just
    # before and after it (load on a shared machine drifts within seconds), and the median of those
    # paired ratios is the accuracy. The profile whose sum is the rounds' median is kept whole.
    # The same steps of the traced graph (its GraphModule's generated code: no eager Python between
    # the operators, what stage code runs): sum / that step separates profiler error from the glue.
    traced, traced_inputs = _traced(model, example)
    chunks = [_plain_steps_ms(model, inputs, loss_fn, count, clock)]
    graph_chunks = [_plain_steps_ms(traced, traced_inputs, loss_fn, count, clock)]
    graphs, profile_s, ratios, graph_ratios = [], [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        graphs.append(profile(model, example, loss_fn, warmup=0 if quick else 1, iterations=1 if quick else 5,
                              clock=clock, timing=timing))
        profile_s.append(time.perf_counter() - started)
        chunks.append(_plain_steps_ms(model, inputs, loss_fn, count, clock))
        graph_chunks.append(_plain_steps_ms(traced, traced_inputs, loss_fn, count, clock))
        ratios.append(_sum_ms(graphs[-1]) / statistics.median(chunks[-2] + chunks[-1]))
        graph_ratios.append(_sum_ms(graphs[-1]) / statistics.median(graph_chunks[-2] + graph_chunks[-1]))
    steps = [t for chunk in chunks for t in chunk]
    step = statistics.median(steps)
    graph = sorted(graphs, key=_sum_ms)[len(graphs) // 2]
    meta = graph.metadata["profile"]
    nodes_ms = sum(n.forward_ms + n.backward_ms for n in graph.nodes)
    loss_ms = meta["loss_forward_ms"] + meta["loss_backward_ms"]
    row = {"model": name, "size": size, "nodes": len(graph.nodes), "clock": clock, "timing": meta["timing"],
           "profile_s": round(statistics.median(profile_s), 2), "rounds": rounds,
           "sum_of_nodes_ms_rounds": [round(_sum_ms(g), 3) for g in graphs], "sum_of_nodes_ms": round(nodes_ms + loss_ms, 3),
           "sum_forward_ms": round(sum(n.forward_ms for n in graph.nodes), 3),
           "sum_backward_ms": round(sum(n.backward_ms for n in graph.nodes), 3), "loss_ms": round(loss_ms, 3),
           "measured_step_ms": round(step, 3), "measured_step_ms_all": [round(t, 3) for t in steps],
           "instrumented_step_ms": round(meta.get("instrumented_step_ms", float("nan")), 3),
           "overhead_subtracted_ms": meta["overhead_subtracted_ms"],
           "profile_accuracy": round(statistics.median(ratios), 3),
           "profile_accuracy_rounds": [round(r, 3) for r in ratios],
           "graph_step_ms": round(statistics.median([t for c in graph_chunks for t in c]), 3),
           "profile_accuracy_vs_graph_step": round(statistics.median(graph_ratios), 3),
           "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    if not stages:
        return row
    started = time.perf_counter()
    plan = partition(graph, Hierarchy.from_lists([2]), PartitionOptions(straight_pipeline=True, cuts="topological"))
    one_level = time.perf_counter() - started
    started = time.perf_counter()
    partition(graph, Hierarchy.from_lists([2, 2]))
    two_levels = time.perf_counter() - started
    write_plan(plan, workdir / f"{name}.plan.json")
    predicted = predict_stage_ms(graph, plan, num_microbatches=hf_worker.MICROBATCHES, calibration=calibration,
                                 optimizer="sgd")
    return {**row, "partition_s": {"1_level": round(one_level, 3), "2_levels": round(two_levels, 3)},
            "stage_nodes": [len(s.node_ids) for s in plan.stages],
            "predicted_stage_ms": [round(p.total_ms, 3) for p in predicted]}


class _Traced(torch.nn.Module):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *values: Any) -> Any:
        return output_dicts(self.gm.forward(*values))  # .forward: export's input-spec pre-hook wants keywords


def _traced(model: torch.nn.Module, example: Any) -> tuple[torch.nn.Module, list]:
    args, kwargs = split_inputs(example)
    with torch.enable_grad():
        _, gm = trace_model(model, args, example_kwargs=kwargs)
    return _Traced(gm), list(flat_inputs(args, kwargs))


def _sum_ms(graph: Any) -> float:
    """Nodes' forward + backward and the loss: what a profile says one training step costs."""
    meta = graph.metadata["profile"]
    return sum(n.forward_ms + n.backward_ms for n in graph.nodes) + meta["loss_forward_ms"] + meta["loss_backward_ms"]


def _plain_steps_ms(model: torch.nn.Module, inputs: list, loss_fn: Any, count: int, clock: str) -> list[float]:
    if isinstance(inputs[0], dict):  # keyword inputs: time_training_step calls model(*inputs)
        kwargs = inputs[0]
        wrapped = _Keywords(model, list(kwargs))
        inputs = list(kwargs.values())
        model = wrapped
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    times = time_training_step(model, inputs, loss_fn, torch.device("cpu"), count + 1, clock)[1:]  # the first warms up
    model.load_state_dict(saved)
    model.zero_grad(set_to_none=True)
    return times


class _Keywords(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *values: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, values)))


def measure(names: list[str], workdir: Path, timeout: float, size: str = "test", clock: str = "wall") -> dict[str, list[float]]:
    """One 2-rank world trains every model on its plan; each stage rank's median busy ms per step."""
    from model_parallel.runtime.launch import free_port, launch
    from model_parallel.runtime.observe.metrics import measured_ms

    port = free_port()
    result = launch([[sys.executable, str(REPO / "tests" / "support" / "hf_worker.py"), str(rank), "2", str(port),
                      str(workdir), ",".join(names), "metrics", f"size={size}"] for rank in range(2)], timeout=timeout)
    if not result.ok:
        raise SystemExit(f"the 2-rank world failed:\n{result.summary()}")
    measured = {}
    for name in names:
        per_rank = []
        for rank in range(2):
            lines = (workdir / f"{name}.metrics.{rank}.jsonl").read_text().splitlines()
            records = [r for r in map(json.loads, lines) if "compute_ms" in r and r.get("step", 0) >= WARMUP_STEPS]
            per_rank.append(round(statistics.median(measured_ms(r, clock) for r in records), 3))
        measured[name] = per_rank
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--calibration", default=None, help="a calibration JSON (model-parallel calibrate); default: measure one")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="'cpu' counts this process's CPU time only (profile and plain steps): for a shared machine")
    parser.add_argument("--timing", choices=("auto", "insitu", "replay"), default="auto", help="the profiler's timing method")
    parser.add_argument("--rounds", type=int, default=5, help="profiles per model, interleaved with plain steps")
    parser.add_argument("--profile-only", action="store_true",
                        help="accuracy rows only: no partitioning and no 2-rank training run")
    parser.add_argument("--size", choices=tuple(SIZES), default="test",
                        help="the models' size (tests/support/hf_zoo.py): 'test' (width 32, 2 blocks, 8 tokens: the "
                             "exactness tests' cases, steps of ~2 ms, mostly per-operator dispatch) or 'bench' "
                             "(width 256, 4 blocks, 64 tokens, 64x64 images)")
    parser.add_argument("--out", default=None,
                        help="the report (default bench/results/models.json; models_bench.json with --size bench)")
    args = parser.parse_args()
    args.out = args.out or str(REPO / "bench" / "results" / ("models.json" if args.size == "test" else "models_bench.json"))
    names = args.models.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"bench/models.py: unknown model(s) {unknown}; use {', '.join(CASES)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # as every worker runs
    from model_parallel.allocator import keep_freed_memory

    keep_freed_memory()  # the allocation cost workers and the profiler CLI pay (docs/profiler.md, page faults)
    from model_parallel.cli.calibrate import calibrate
    from model_parallel.optimizer.fidelity import Calibration

    load_before = os.getloadavg()[0]
    if args.profile_only:
        rows = [prepare(name, args.quick, None, Path("."), args.clock, args.timing, stages=False, rounds=args.rounds,
                        size=args.size) for name in names]
        atomic_write_json(Path(args.out), {"rows": rows, "quick": args.quick, "profile_only": True, "size": args.size,
                                           "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                                           "cpus": os.cpu_count(), "torch": torch.__version__})
        print(f"{'model':13s} {'nodes':>5s} {'timing':>7s} {'clock':>5s} {'nodes ms':>9s} {'step ms':>8s} {'accuracy':>8s} "
              f"{'graph step':>10s} {'vs graph':>8s}  load")
        for row in rows:
            print(f"{row['model']:13s} {row['nodes']:5d} {row['timing']:>7s} {row['clock']:>5s} {row['sum_of_nodes_ms']:9.3f} "
                  f"{row['measured_step_ms']:8.3f} {row['profile_accuracy']:8.3f} {row['graph_step_ms']:10.3f} "
                  f"{row['profile_accuracy_vs_graph_step']:8.3f}  {row['load_average_1min']}")
        print(f"wrote {args.out}")
        return 0
    if args.calibration:
        calibration = Calibration.from_json(json.loads(Path(args.calibration).read_text()), args.calibration)
    else:
        calibration = calibrate(timeout=args.timeout, clock=args.clock)
    with tempfile.TemporaryDirectory(prefix="bench_models_") as tmp:
        rows = [prepare(name, args.quick, calibration, Path(tmp), args.clock, args.timing, rounds=args.rounds,
                        size=args.size) for name in names]
        measured = measure(names, Path(tmp), args.timeout, args.size, args.clock)
    for row in rows:
        row["measured_stage_ms"] = measured[row["model"]]
        row["predicted_over_measured"] = [round(p / m, 3) for p, m in zip(row["predicted_stage_ms"], row["measured_stage_ms"])]
    result = {"rows": rows, "quick": args.quick, "size": args.size, "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "cpus": os.cpu_count(), "torch": torch.__version__, "calibration": calibration.to_json()}
    atomic_write_json(Path(args.out), result)
    print(f"{'model':13s} {'nodes':>5s} {'accuracy':>8s} {'part 1L s':>9s} {'part 2L s':>9s}  predicted / measured stage ms")
    for row in rows:
        pairs = ", ".join(f"{p:.1f}/{m:.1f}" for p, m in zip(row["predicted_stage_ms"], row["measured_stage_ms"]))
        print(f"{row['model']:13s} {row['nodes']:5d} {row['profile_accuracy']:8.2f} {row['partition_s']['1_level']:9.3f} "
              f"{row['partition_s']['2_levels']:9.3f}  {pairs}")
    print(f"load average {result['load_average_1min']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
