"""Layer-by-layer profiling benchmark: peak memory and sum of node times, whole model vs `layer_by_layer=True`.

    python bench/profile_layer_by_layer.py            # resnet50 (64x64, batch 8) and a GPT (several minutes)
    python bench/profile_layer_by_layer.py --quick    # smaller models, about a minute

Each (model, mode) runs in its own process, so its peak RSS (`ru_maxrss`) is its own: the whole-model
profile builds the model with real values; the layer-by-layer one builds it under
`torch.device("meta")` and materializes one node's tensors at a time. Writes
bench/results/profile_layer_by_layer.json: {"rows": [{"model", "mode", "peak_rss_mb",
"rss_after_import_mb", "sum_layer_ms", "parameter_mb", "peak_parameter_mb", "seconds"}], "settings"}.
Times are meaningful on a quiet machine only (the load average is recorded with each row).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a plain script from a checkout
    try:
        import model_parallel  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import platform
import resource
import subprocess
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from model_parallel.fileio import atomic_write_json

OUT = Path(__file__).resolve().parent / "results" / "profile_layer_by_layer.json"
# name -> (builder kind, size settings); quick variants keep the shapes small.
MODELS = {
    "resnet50": {"kind": "resnet50", "image": 64, "batch": 8},
    "gpt": {"kind": "gpt", "vocab": 50304, "seq": 128, "dim": 768, "heads": 12, "layers": 12, "batch": 4},
}
QUICK = {
    "resnet50": {"kind": "resnet50", "image": 32, "batch": 4},
    "gpt": {"kind": "gpt", "vocab": 50304, "seq": 64, "dim": 256, "heads": 4, "layers": 4, "batch": 2},
}


def rss_mb() -> float:
    with open("/proc/self/status") as status:  # current RSS (Linux)
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build(spec: dict[str, Any]) -> torch.nn.Module:
    if spec["kind"] == "resnet50":
        import torchvision

        return torchvision.models.resnet50(num_classes=1000)
    from model_parallel.models import TinyGPT

    return TinyGPT(vocab_size=spec["vocab"], seq_len=spec["seq"], dim=spec["dim"], num_heads=spec["heads"],
                   num_layers=spec["layers"])


def example(spec: dict[str, Any]) -> tuple[tuple, Any]:
    """One minibatch and the loss on it."""
    torch.manual_seed(0)
    if spec["kind"] == "resnet50":
        x = torch.randn(spec["batch"], 3, spec["image"], spec["image"])
        return (x,), lambda out: torch.nn.functional.cross_entropy(out, torch.zeros(len(out), dtype=torch.long))
    from model_parallel.models.gpt import lm_loss

    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]))
    return (ids,), lambda out: lm_loss(out, ids)


def one(spec: dict[str, Any], mode: str, warmup: int, iterations: int) -> dict[str, Any]:
    """Profile one model in this process and report its peak memory."""
    import model_parallel  # noqa: F811 - (the checkout import above only finds the package)

    torch.set_num_threads(1)
    base = rss_mb()
    started = time.perf_counter()
    if mode == "layer_by_layer":
        with torch.device("meta"):  # shapes only: the walk materializes one node at a time
            model = build(spec)
    else:
        model = build(spec)
    inputs, loss_fn = example(spec)
    graph = model_parallel.profile(model, inputs, loss_fn, warmup=warmup, iterations=iterations,
                                   layer_by_layer=mode == "layer_by_layer")
    walk = graph.metadata["profile"].get("layer_by_layer", {})
    return {
        "mode": mode,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_after_import_mb": base,
        "sum_layer_ms": sum(n.compute_ms for n in graph.nodes),
        "loss_ms": graph.metadata["profile"]["loss_forward_ms"] + graph.metadata["profile"]["loss_backward_ms"],
        "num_nodes": len(graph.nodes),
        "parameter_mb": sum(n.parameter_size for n in graph.nodes) / 2**20,
        "largest_node_parameter_mb": max(n.parameter_size for n in graph.nodes) / 2**20,
        "peak_parameter_mb": walk.get("peak_parameter_bytes", float("nan")) / 2**20,
        "seconds": time.perf_counter() - started,
        "load_average": os.getloadavg(),
    }


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models (about a minute)")
    parser.add_argument("--models", default="resnet50,gpt", help="comma-separated: resnet50, gpt")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per (model, mode) process")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: JSON spec of one child run
    parser.add_argument("--out", type=Path, default=OUT)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.one:
        spec, mode = json.loads(args.one)
        print(json.dumps(one(spec, mode, args.warmup, args.iterations)))
        return 0
    table = QUICK if args.quick else MODELS
    rows = []
    for name in args.models.split(","):
        if name not in table:
            print(f"unknown model {name!r}; choose from {', '.join(table)}", file=sys.stderr)
            return 2
        for mode in ("whole", "layer_by_layer"):
            command = [sys.executable, __file__, "--one", json.dumps([table[name], mode]),
                       "--warmup", str(args.warmup), "--iterations", str(args.iterations)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
            except subprocess.TimeoutExpired:
                print(f"{name} {mode}: no result within {args.timeout:.0f} s (raise --timeout)", file=sys.stderr)
                return 2
            if done.returncode != 0:
                print(f"{name} {mode} failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                return 2
            row = {"model": name, **table[name], **json.loads(done.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(f"{name:9s} {mode:15s} peak RSS {row['peak_rss_mb']:7.0f} MB (after import {row['rss_after_import_mb']:.0f})"
                  f"  params {row['parameter_mb']:6.1f} MB, largest node {row['largest_node_parameter_mb']:5.1f} MB"
                  f"  sum {row['sum_layer_ms']:8.1f} ms  ({row['seconds']:.0f} s)", flush=True)
    settings = {"warmup": args.warmup, "iterations": args.iterations, "quick": args.quick, "threads": 1,
                "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count()}
    atomic_write_json(args.out, {"rows": rows, "settings": settings})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
