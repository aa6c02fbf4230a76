"""Profile a torchvision image classifier: `profile_arch(...)` is the job `model-parallel profile` runs.

`write_profile` writes `<profile_directory>/<arch>/graph.txt`, `graph.json`, `graph.svg` and
`profile_summary.json`; the demo and the benchmark call both in-process.
"""
from __future__ import annotations

import logging
import sys
import statistics
from dataclasses import replace
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from model_parallel.compat import import_torchvision
from model_parallel.errors import ProfileError, RenderError
from model_parallel.fileio import atomic_write_json
from model_parallel.graph.core import Graph
from model_parallel.graph.io import save_graph
from model_parallel.profiler.api import preserved_model, profile, resolve_device
from model_parallel.allocator import keep_freed_memory
from model_parallel.profiler.image_classification import feasibility
from model_parallel.profiler.resume import PARTIAL_NAME, PartialProfile
from model_parallel.profiler.timing import clock_seconds, time_training_step, training_step

logger = logging.getLogger(__name__)

# Smallest input side each family accepts (the rest work from 32x32).
MIN_IMAGE_SIZE = {"inception_v3": 75}
INCEPTION_AUX_MIN_SIZE = 299


def list_architectures() -> list[str]:
    """Every torchvision classification model name."""
    tv = import_torchvision()
    return sorted(tv.models.list_models(module=tv.models))


def check_arch(arch: str, image_size: int) -> None:
    """Refuse an unknown model name, or images smaller than the model accepts."""
    names = list_architectures()
    if arch not in names:
        raise ProfileError(f"unknown architecture {arch!r}; valid ones: {', '.join(names)}")
    minimum = MIN_IMAGE_SIZE.get(arch, 32)
    if image_size < minimum:
        raise ProfileError(f"{arch} needs --image-size >= {minimum}, got {image_size}")


def build_model(arch: str, num_classes: int = 1000, image_size: int = 224, *, quiet: bool = False) -> nn.Module:
    """A freshly initialised torchvision classifier (no weights are downloaded); `quiet`: no warnings (a second build)."""
    check_arch(arch, image_size)
    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    # These fix their input size at construction; build them for the size being profiled.
    if arch.startswith("vit_"):
        kwargs["image_size"] = image_size
    if arch.startswith("maxvit"):
        kwargs["input_size"] = (image_size, image_size)
    if arch == "inception_v3" and image_size < INCEPTION_AUX_MIN_SIZE:
        # The auxiliary head (run in training only) pools 17x17 features with a 5x5 window: below
        # 299 pixels it cannot run, so the model is profiled without it (and says so).
        (logger.debug if quiet else logger.warning)("inception_v3 at %d pixels: profiling without the auxiliary head (it needs >= %d)",
                       image_size, INCEPTION_AUX_MIN_SIZE)
        kwargs["aux_logits"] = False
    if arch in ("inception_v3", "googlenet"):
        kwargs["init_weights"] = False  # their truncated-normal init is slow and changes no timing
    tv = import_torchvision()
    torch.manual_seed(0)
    try:
        return tv.models.get_model(arch, **kwargs)
    except (ValueError, RuntimeError, AssertionError) as error:  # e.g. maxvit's window sizes need 224x224
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ProfileError(f"torchvision cannot build {arch} for {image_size}x{image_size} inputs: {first_line}; "
                           "try another --image-size (224 always works)") from None


def classification_loss(targets: torch.Tensor) -> Any:
    """Cross entropy on the logits; auxiliary heads (inception_v3, googlenet in training) weigh 0.4, as
    torchvision's reference training does."""

    def loss_fn(output: Any) -> torch.Tensor:
        if isinstance(output, torch.Tensor):
            return F.cross_entropy(output, targets)
        main, *aux = [o for o in output if isinstance(o, torch.Tensor)]
        loss = F.cross_entropy(main, targets)
        for extra in aux:
            loss = loss + 0.4 * F.cross_entropy(extra, targets)
        return loss

    return loss_fn


def synthetic_batch(batch_size: int, image_size: int, num_classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    targets = torch.randint(0, num_classes, (batch_size,), generator=generator)
    return images, targets


def image_folder_batch(data_dir: str, batch_size: int, image_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The first minibatch of an ImageFolder (class-per-subfolder), resized and normalised; also the class count."""
    tv = import_torchvision()
    from torchvision import transforms

    transform = transforms.Compose([
        transforms.Resize(image_size), transforms.CenterCrop(image_size), transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
    ])
    try:
        dataset = tv.datasets.ImageFolder(data_dir, transform=transform)
    except (FileNotFoundError, OSError) as error:
        raise ProfileError(f"--data_dir {data_dir}: not a readable ImageFolder (one subfolder per class): {error}") from None
    if len(dataset) < batch_size:
        raise ProfileError(f"--data_dir {data_dir} holds {len(dataset)} images, fewer than --batch-size {batch_size}")
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)
    images, targets = next(iter(loader))
    return images, targets, len(dataset.classes)


def profile_arch(
    arch: str,
    batch_size: int,
    image_size: int = 224,
    *,
    device: Optional[str] = "auto",
    warmup: int = 1,
    iterations: int = 3,
    num_classes: Optional[int] = None,
    data_dir: Optional[str] = None,
    step_iterations: int = 5,
    rounds: int = 1,
    progress: bool = False,
    clock: str = "wall",
    partial_path: Optional[Path] = None,
    estimate: bool = False,
    force: bool = False,
    node_timing: str = "auto",
    precision: str = "fp32",
) -> tuple[Graph, dict[str, Any]]:
    """Profile one torchvision model and time a plain training step of it; returns (graph, summary).

    The training step (forward + loss + backward, zero_grad; no optimizer) is timed in chunks of
    `step_iterations` before, between and after the `rounds` profiling passes, so background load
    hits both sides alike; with rounds > 1 each node's times are the median over the rounds.
    `progress`: what is being measured, and bars over nodes and steps, on stderr.
    `estimate`: first predict the peak memory (a `ProfileError` if it cannot fit, unless `force`) and
    the time (with the flags that shorten it when over `feasibility.SLOW_SECONDS`).
    `partial_path`: keep measurements there as they are made, and reuse those an interrupted run with
    the same settings left (see `model_parallel.profiler.resume`).
    `precision` "bf16": nodes and training steps timed under the runtime's bf16 autocast (`--bf16`).
    """
    if batch_size < 1:
        raise ProfileError(f"--batch-size must be >= 1, got {batch_size}")
    if rounds < 1 or step_iterations < 1:
        raise ProfileError(f"rounds and step_iterations must be >= 1, got {rounds} and {step_iterations}")
    check_arch(arch, image_size)  # before the first status line: a usage error is one line
    say = _status if progress else logger.info
    keep_freed_memory()  # pay the allocation cost our workers pay (see model_parallel/allocator.py)
    target = resolve_device(device)
    threads = torch.get_num_threads()
    say(f"profiling {arch}: batch {batch_size} of {image_size}x{image_size} images ({data_dir or 'synthetic'}) on {target}, "
        f"{threads} thread(s); timing each node's forward and backward ({warmup} warm-up + {iterations} timed replays"
        f"{f', {rounds} rounds' if rounds > 1 else ''}) and {step_iterations} plain training steps before and after")
    if data_dir is not None:
        images, targets, found_classes = image_folder_batch(data_dir, batch_size, image_size)
        num_classes = num_classes or found_classes
        if int(targets.max()) >= num_classes:
            raise ProfileError(f"--data_dir {data_dir} has {found_classes} classes but --num-classes is {num_classes}")
    else:
        num_classes = num_classes or 1000
        images, targets = synthetic_batch(batch_size, image_size, num_classes)
    memory = _check_memory(arch, batch_size, image_size, num_classes, target, say, force) if estimate else None
    model = build_model(arch, num_classes, image_size).to(target)
    images, targets = images.to(target), targets.to(target)
    loss_fn = classification_loss(targets)
    tv = import_torchvision()
    key = {"arch": arch, "batch_size": batch_size, "image_size": image_size, "num_classes": num_classes,
           "data": data_dir or "synthetic", "device": str(target), "num_threads": threads, "clock": clock, "timing": node_timing,
           "precision": precision, "warmup": warmup, "iterations": iterations, "step_iterations": step_iterations, "rounds": rounds,
           "torch_version": torch.__version__, "torchvision_version": tv.__version__}
    partial = PartialProfile.open(partial_path, key, say)

    step_times: list[float] = []
    graphs: list[Graph] = []
    profile_seconds: list[float] = []
    timing = None
    with preserved_model(model, target):
        try:
            if estimate:
                probe = min(batch_size, feasibility.PROBE_BATCH)
                timing = feasibility.estimate_time(model, (images[:probe],), classification_loss(targets[:probe]), probe,
                                                   batch_size, image_size, target, (warmup, iterations, step_iterations, rounds), say)
            say("warm-up training step (untimed)")
            training_step(model, (images,), loss_fn, precision=precision)  # untimed warm-up: first-touch allocations, lazy init
            step_times += _timed_steps(model, images, loss_fn, target, step_iterations, clock, partial, 0, rounds, progress,
                                       precision)
            for index in range(rounds):
                model.zero_grad(set_to_none=True)
                started = clock_seconds(clock)
                graphs.append(profile(model, (images,), loss_fn, warmup=warmup, iterations=iterations,
                                      device=target, progress=progress, clock=clock, store=partial.round(index),
                                      timing=node_timing, precision=precision))
                profile_seconds.append(clock_seconds(clock) - started)
                step_times += _timed_steps(model, images, loss_fn, target, step_iterations, clock, partial, index + 1,
                                           rounds, progress, precision)
        finally:
            partial.save()  # interrupted or not, what was measured is on disk
        model.zero_grad(set_to_none=True)
    graph = graphs[0] if rounds == 1 else _median_graph(graphs)

    measured_step_ms = statistics.median(step_times)
    sum_layer_ms = graph.total_compute_ms
    profiling_seconds = statistics.median(profile_seconds)
    summary = {
        "arch": arch,
        "batch_size": batch_size,
        "image_size": image_size,
        "num_classes": num_classes,
        "data": data_dir or "synthetic",
        "device": str(target),
        "num_threads": threads,
        "clock": clock,
        "precision": precision,
        "num_nodes": len(graph),
        "num_edges": len(graph.edges),
        "parameter_bytes": sum(n.parameter_size for n in graph.nodes),
        "measured_step_ms": measured_step_ms,
        "measured_step_ms_all": step_times,
        "sum_layer_ms": sum_layer_ms,
        "sum_forward_ms": sum(n.forward_ms for n in graph.nodes),
        "sum_backward_ms": sum(n.backward_ms for n in graph.nodes),
        "loss_ms": graph.metadata["profile"]["loss_forward_ms"] + graph.metadata["profile"]["loss_backward_ms"],
        "accuracy_ratio": sum_layer_ms / measured_step_ms if measured_step_ms > 0 else float("nan"),
        "profiling_seconds": profiling_seconds,
        "overhead_ratio": profiling_seconds * 1000.0 / measured_step_ms if measured_step_ms > 0 else float("nan"),
        "warmup": warmup,
        "iterations": iterations,
        "rounds": rounds,
        "overhead_subtracted_ms": graph.metadata["profile"]["overhead_subtracted_ms"],
        "resumed_nodes": partial.resumed_nodes,
        "torch_version": torch.__version__,
        "torchvision_version": tv.__version__,
    }
    summary["warnings"] = profile_disagreement(sum_layer_ms, step_times, clock, threads)
    for warning in summary["warnings"]:
        logger.warning("%s", warning)
    if memory is not None:
        summary["estimated_peak_bytes"] = memory.peak_bytes
    if timing is not None:
        summary["estimated_seconds"] = timing.total_s
    metadata = dict(graph.metadata)
    metadata.update({"arch": arch, "batch_size": batch_size, "image_size": image_size})
    return replace(graph, metadata=metadata), summary


RATIO_BAND = (0.9, 1.1)  # sum of layers / measured step: outside it the per-layer times do not add up to a step
STEP_SPREAD = 1.5  # slowest / fastest plain training step: more means the machine's load moved while profiling


def profile_disagreement(sum_layer_ms: float, step_ms: list[float], clock: str, threads: Optional[int]) -> list[str]:
    """Why this profile's own samples disagree (each with the fix), or nothing: the per-layer sum against the
    measured step, and the spread of the plain steps timed between the profiling rounds."""
    fixes = []
    if clock == "wall":
        fixes.append("--clock cpu (a busy machine stretches wall-clock times)")
    fixes.append(f"--threads N below the free cores (now {threads if threads else 'torch default'}), on a quiet machine")
    fix = "; try " + " and ".join(fixes)
    found = []
    step = statistics.median(step_ms) if step_ms else 0.0
    if step > 0 and not RATIO_BAND[0] <= sum_layer_ms / step <= RATIO_BAND[1]:
        found.append(f"the profile disagrees with itself: sum of layers {sum_layer_ms:.0f} ms, measured step {step:.0f} ms "
                     f"(ratio {sum_layer_ms / step:.3f}, outside {RATIO_BAND[0]}-{RATIO_BAND[1]}), so plans cut from it "
                     f"are off{fix}")
    if step_ms and min(step_ms) > 0 and max(step_ms) / min(step_ms) > STEP_SPREAD:
        found.append(f"the profile's training steps spread {min(step_ms):.0f}-{max(step_ms):.0f} ms (more than "
                     f"{STEP_SPREAD}x): the machine's load changed while it was measured{fix}")
    return found


def _status(message: str) -> None:
    """A status line on stderr that does not break a progress bar being drawn."""
    tqdm.write(message, file=sys.stderr)


def _check_memory(arch: str, batch_size: int, image_size: int, num_classes: int, device: torch.device,
                  say: Any, force: bool) -> Optional[feasibility.MemoryEstimate]:
    """Estimate the peak on the meta device before anything large is allocated; refuse what cannot fit."""
    try:
        with torch.device("meta"):
            model = build_model(arch, num_classes, image_size, quiet=True)
            images, targets = torch.empty(batch_size, 3, image_size, image_size), torch.zeros(batch_size, dtype=torch.long)
            parameter_bytes, activation_bytes = feasibility.meta_training_bytes(model, (images,), classification_loss(targets))
    except ProfileError:
        raise
    except Exception as error:  # an op without a meta kernel: no estimate, the profile itself still works
        logger.info("no memory estimate for %s: %s: %s", arch, type(error).__name__, error)
        return None
    memory = feasibility.MemoryEstimate(batch_size, parameter_bytes, activation_bytes, feasibility.available_memory_bytes(device))
    say(memory.describe())
    if not memory.fits:
        what = f"{arch} at batch {batch_size}, {image_size}x{image_size}"
        if not force:
            raise ProfileError(memory.refusal(what, device))
        say(f"warning: {memory.refusal(what, device)} (going on: --force)")
    return memory


def _timed_steps(model: nn.Module, images: torch.Tensor, loss_fn: Any, device: torch.device, count: int, clock: str,
                 partial: PartialProfile, index: int, rounds: int, progress: bool, precision: str = "fp32") -> list[float]:
    """Chunk `index` of plain training steps: reused from an interrupted run, or timed with a bar."""
    times = partial.steps(index)
    if times:
        partial.say(f"reusing {len(times)} training step time(s) measured by the interrupted run")
    remaining = max(0, count - len(times))
    if remaining:
        def keep(milliseconds: float) -> None:
            partial.add_step(index, milliseconds)
            bar.update(1)

        with tqdm(total=count, initial=count - remaining, desc=f"timing training steps ({index + 1}/{rounds + 1})",
                  unit="step", file=sys.stderr, disable=not progress) as bar:
            times += time_training_step(model, (images,), loss_fn, device, remaining, clock, on_step=keep,
                                        precision=precision)
    return times


def _median_graph(graphs: Sequence[Graph]) -> Graph:
    """The first graph with each node's times replaced by the median over all the graphs."""
    first = graphs[0]
    nodes = []
    for index, node in enumerate(first.nodes):
        forward = statistics.median(g.nodes[index].forward_ms for g in graphs)
        backward = statistics.median(g.nodes[index].backward_ms for g in graphs)
        nodes.append(replace(node, forward_ms=forward, backward_ms=backward))
    return first.replace_nodes(nodes)


def write_profile(graph: Graph, summary: dict[str, Any], directory: Path) -> dict[str, Path]:
    """Write graph.txt + graph.json, graph.svg (skipped with one warning if graphviz is missing) and
    profile_summary.json into `directory`; returns what was written."""
    written = {"graph.txt": save_graph(graph, directory / "graph.txt"), "graph.json": directory / "graph.json"}
    try:
        written["graph.svg"] = render_svg(graph, directory / "graph.svg", summary["arch"])
    except RenderError as error:
        print(f"warning: {error}", file=sys.stderr)
    written["profile_summary.json"] = atomic_write_json(directory / "profile_summary.json", summary)
    return written


def render_svg(graph: Graph, path: Path, title: str) -> Path:
    from model_parallel.graph.render import render_graph

    return render_graph(graph, path, title=title)
