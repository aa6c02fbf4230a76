"""The optimizer's speed on every real model at hand: `python bench/optimizer.py --zoo [--quick]`.

Models: every torchvision classifier (`torchvision.models.list_models(module=torchvision.models)`, 80 in
0.28), traced with torch.fx at 64x64 (inception_v3 at 80x80: it needs 75 px; maxvit_t at 224: its windows
need it; ViTs built for a 64 px image, vit_h_14 for 70 px: patch 14), batch 2, 10 classes, random weights,
**synthetic costs** (`synthetic.traced_costs`: compute proportional to activation bytes; profiling the
largest, regnet_y_128gf with 644M parameters, would take minutes and gigabytes each); and the Hugging Face /
timm cases of tests/support/hf_zoo.py at both sizes ("test": width 32, 2 blocks, 8 tokens; "bench": width
256, 4 blocks, 64 tokens), **profiled** in situ (`profile(..., warmup=0, iterations=1)`, one thread).

Each graph is partitioned with default options (as `model_parallel.partition` is called) on `-n 4` (one
level) and `-n 4 2`, `-n 2 2` (two levels, default bandwidths); `seconds` is the wall time of one
`partition` call. The bar (issue 26): under 1 s on one level and 3 s on two. Writes
bench/results/optimizer_zoo.json atomically with the load average before and after.
"""
from __future__ import annotations

import os
import time
from typing import Any, Iterator, Optional, Sequence

from model_parallel.graph.core import Graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.partition import partition

LEVELS = ((4,), (4, 2), (2, 2))
BAR_S = {1: 1.0, 2: 3.0}  # seconds, by number of levels
# A subset for --quick: the ones that were slowest, and one of each family.
QUICK_TORCHVISION = ("efficientnet_b0", "efficientnet_b7", "inception_v3", "googlenet", "densenet121", "resnet50",
                     "mobilenet_v3_large", "regnet_y_400mf", "convnext_tiny", "swin_t", "maxvit_t", "vit_b_16")
QUICK_HF = ("gpt2", "bert", "t5")


def _torchvision_input(name: str) -> tuple[int, dict[str, Any]]:
    """The image side a classifier is traced at, and its constructor's extra arguments."""
    if name == "inception_v3":
        return 80, {"aux_logits": False, "init_weights": False}
    if name == "googlenet":
        return 64, {"aux_logits": False, "init_weights": False}
    if name == "maxvit_t":
        return 224, {}
    if name.startswith("vit_"):
        return (70, {"image_size": 70}) if name == "vit_h_14" else (64, {"image_size": 64})
    return 64, {}


def torchvision_graphs(names: Optional[Sequence[str]] = None) -> Iterator[tuple[str, Graph]]:
    """Every torchvision classifier (or `names`), traced, with synthetic costs; one model in memory at a time."""
    import torch

    from model_parallel.compat import import_torchvision
    from model_parallel.profiler.trace import trace_model

    torchvision = import_torchvision()
    torch.set_num_threads(1)
    for name in names or torchvision.models.list_models(module=torchvision.models):
        torch.manual_seed(0)
        size, kwargs = _torchvision_input(name)
        with torch.no_grad():
            model = torchvision.models.get_model(name, num_classes=10, **kwargs)
        graph, _ = trace_model(model, (torch.randn(2, 3, size, size),))
        del model
        yield f"{name} (torchvision {size}px, synthetic)", synthetic.traced_costs(graph)


def hf_graphs(size_names: Sequence[str] = ("test", "bench"), names: Optional[Sequence[str]] = None) -> Iterator[tuple[str, Graph]]:
    """The cases of tests/support/hf_zoo.py at each size, profiled in situ (one step, no warmup, one thread)."""
    import sys

    import torch

    from model_parallel.profiler.api import profile

    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from support import hf_zoo

    torch.set_num_threads(1)
    for size_name in size_names:
        for name, case in hf_zoo.cases(hf_zoo.SIZES[size_name]).items():
            if names and name not in names:
                continue
            model, example = case.build(), case.example(2)
            target = case.data.batch(0)[1][:2]
            graph = profile(model, example, lambda out, case=case, target=target: case.loss(out, target), warmup=0, iterations=1)
            yield f"{name} ({size_name} size, profiled)", graph


def zoo_rows(graphs: Iterator[tuple[str, Graph]], levels: Sequence[Sequence[int]] = LEVELS) -> list[dict[str, Any]]:
    rows = []
    for profile, graph in graphs:
        for machines in levels:
            load = os.getloadavg()[0]
            started, cpu = time.perf_counter(), time.process_time()
            plan = partition(graph, Hierarchy.from_lists(list(machines)))
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            over = seconds >= BAR_S[min(len(machines), 2)]
            rows.append({"profile": profile, "num_nodes": len(graph), "num_machines": list(machines), "seconds": round(seconds, 4),
                         "cpu_seconds": round(cpu, 4), "load_1min": load, "over_bar": over,
                         "time_per_minibatch_s": plan.time_per_minibatch_s, "cuts": plan.extra["cuts"],
                         "exact": plan.extra["exact"], "num_states": plan.extra["num_states"],
                         "lower_bound_s": plan.extra.get("lower_bound_s")})
            print(f"{profile:<44} {len(graph):>5} nodes  -n {' '.join(map(str, machines)):<4} {seconds:>7.3f} s {cpu:>7.3f} s cpu  "
                  f"{plan.extra['cuts']:<19} exact={str(plan.extra['exact']):<5}{'  OVER THE BAR' if over else ''}", flush=True)
    return rows


def zoo(quick: bool) -> dict[str, Any]:
    """Every row, the rows over the bar, and the load average before and after."""
    load_before = list(os.getloadavg())
    graphs = [torchvision_graphs(QUICK_TORCHVISION if quick else None), hf_graphs(names=QUICK_HF if quick else None)]
    rows = [row for source in graphs for row in zoo_rows(source)]
    worst = sorted(rows, key=lambda row: row["seconds"] / BAR_S[min(len(row["num_machines"]), 2)], reverse=True)[:10]
    print("slowest against the bar:")
    for row in worst:
        print(f"  {row['profile']:<44} -n {' '.join(map(str, row['num_machines'])):<4} {row['seconds']:>7.3f} s "
              f"(load {row['load_1min']:.1f})")
    return {"rows": rows, "over_bar": [row for row in rows if row["over_bar"]], "quick": quick,
            "bar_seconds": {"one level": BAR_S[1], "two levels": BAR_S[2]},
            "load_average_before": load_before, "load_average_after": list(os.getloadavg())}
