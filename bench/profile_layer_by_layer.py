"""Layer-by-layer profiling benchmark: peak memory and Σ/step, whole model vs `layer_by_layer=True`.

    python bench/profile_layer_by_layer.py            # resnet50 (64x64, batch 8), TinyGPT 12x768, GPT-2 (many minutes)
    python bench/profile_layer_by_layer.py --quick    # smaller models, a few minutes

Each (model, mode) runs in its own process, so its peak RSS (`ru_maxrss`) is its own: the whole-model
profile builds the model with real values (in-situ timing) and also times plain training steps of it
(the "step" of Σ/step); the layer-by-layer one builds it under `torch.device("meta")` and times it
segment by segment (`profiler/segments.py`, default budget). Σ = nodes' forward + backward + the loss.
`--clock cpu` (the default) counts this process's CPU time only, for a shared machine. Writes
bench/results/profile_layer_by_layer.json: {"rows": [{"model", "mode", "peak_rss_mb",
"rss_after_import_mb", "sum_ms", "step_ms", "sum_per_step", "parameter_mb", "peak_parameter_mb",
"segments", "seconds"}], "settings"}. The load average is recorded with each row.
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
import statistics
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
    "gpt2": {"kind": "gpt2", "vocab": 50257, "seq": 128, "dim": 768, "heads": 12, "layers": 12, "batch": 4},
}
QUICK = {
    "resnet50": {"kind": "resnet50", "image": 32, "batch": 4},
    "gpt": {"kind": "gpt", "vocab": 50304, "seq": 64, "dim": 256, "heads": 4, "layers": 4, "batch": 2},
    "gpt2": {"kind": "gpt2", "vocab": 50257, "seq": 64, "dim": 128, "heads": 4, "layers": 2, "batch": 2},
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
    if spec["kind"] == "gpt2":
        import transformers

        config = transformers.GPT2Config(n_layer=spec["layers"], n_embd=spec["dim"], n_head=spec["heads"],
                                         vocab_size=spec["vocab"], n_positions=spec["seq"])
        return transformers.AutoModelForCausalLM.from_config(config)
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
    if spec["kind"] == "gpt2":
        return {"input_ids": ids}, lambda out: lm_loss(out.logits, ids)
    return (ids,), lambda out: lm_loss(out, ids)


class Keywords(torch.nn.Module):
    """`model(**inputs)` as `time_training_step` calls it: `wrapped(*values)`."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *values: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, values)))


def plain_step_ms(model: torch.nn.Module, inputs: Any, loss_fn: Any, count: int, clock: str) -> float:
    """Median of `count` plain training steps (after one untimed)."""
    from model_parallel.profiler.timing import time_training_step

    if isinstance(inputs, dict):
        model, inputs = Keywords(model, list(inputs)), tuple(inputs.values())
    times = time_training_step(model, list(inputs), loss_fn, torch.device("cpu"), count + 1, clock)[1:]
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def one(spec: dict[str, Any], mode: str, warmup: int, iterations: int, clock: str) -> dict[str, Any]:
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
    graph = model_parallel.profile(model, inputs, loss_fn, warmup=warmup, iterations=iterations, clock=clock,
                                   layer_by_layer=mode == "layer_by_layer")
    seconds = time.perf_counter() - started
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the profile's (the plain steps add activations)
    step = plain_step_ms(model, inputs, loss_fn, 2 * iterations + 1, clock) if mode == "whole" else float("nan")
    walk = graph.metadata["profile"].get("layer_by_layer", {})
    loss_ms = graph.metadata["profile"]["loss_forward_ms"] + graph.metadata["profile"]["loss_backward_ms"]
    return {
        "mode": mode,
        "timing": graph.metadata["profile"]["timing"],
        "peak_rss_mb": peak_rss,
        "rss_after_import_mb": base,
        "sum_ms": sum(n.compute_ms for n in graph.nodes) + loss_ms,
        "step_ms": step,
        "loss_ms": loss_ms,
        "segments": walk.get("segments"),
        "boundary_ms": walk.get("boundary_ms"),
        "num_nodes": len(graph.nodes),
        "parameter_mb": sum(n.parameter_size for n in graph.nodes) / 2**20,
        "largest_node_parameter_mb": max(n.parameter_size for n in graph.nodes) / 2**20,
        "peak_parameter_mb": walk.get("peak_parameter_bytes", float("nan")) / 2**20,
        "seconds": seconds,
        "load_average": os.getloadavg(),
    }


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models (about a minute)")
    parser.add_argument("--models", default="resnet50,gpt,gpt2", help="comma-separated: resnet50, gpt, gpt2")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="profile and step clock")
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
        print(json.dumps(one(spec, mode, args.warmup, args.iterations, args.clock)))
        return 0
    table = QUICK if args.quick else MODELS
    rows = []
    for name in args.models.split(","):
        if name not in table:
            print(f"unknown model {name!r}; choose from {', '.join(table)}", file=sys.stderr)
            return 2
        for mode in ("whole", "layer_by_layer"):
            command = [sys.executable, __file__, "--one", json.dumps([table[name], mode]),
                       "--warmup", str(args.warmup), "--iterations", str(args.iterations), "--clock", args.clock]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
            except subprocess.TimeoutExpired:
                print(f"{name} {mode}: no result within {args.timeout:.0f} s (raise --timeout)", file=sys.stderr)
                return 2
            if done.returncode != 0:
                print(f"{name} {mode} failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                return 2
            row = {"model": name, **table[name], **json.loads(done.stdout.strip().splitlines()[-1])}
            if mode == "whole":
                step = row["step_ms"]
            row["step_ms"] = step  # the layer-by-layer run has no real model to step: the whole run's step
            row["sum_per_step"] = row["sum_ms"] / step
            rows.append(row)
            print(f"{name:9s} {mode:15s} peak RSS {row['peak_rss_mb']:7.0f} MB (after import {row['rss_after_import_mb']:.0f})"
                  f"  params {row['parameter_mb']:6.1f} MB, held at once {row['peak_parameter_mb']:5.1f} MB"
                  f"  Σ {row['sum_ms']:8.2f} ms / step {step:8.2f} ms = {row['sum_per_step']:.3f}"
                  f"  ({row['seconds']:.0f} s, load {row['load_average'][0]:.1f})", flush=True)
    settings = {"warmup": args.warmup, "iterations": args.iterations, "quick": args.quick, "threads": 1, "clock": args.clock,
                "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count()}
    atomic_write_json(args.out, {"rows": rows, "settings": settings})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
