"""The one job builder: what to train (a zoo name, a package, a graph, a module) -> graph, plan, model, data.

    spec = JobSpec(model="mlp", num_stages=2, batch_size=8, num_microbatches=4)
    job = build_job(spec, world_size=2)          # -> runtime.run.Job(graph, plan, model, criterion, dataset)

Both the worker command line (`--model/--package/--graph`, model_parallel.cli.worker) and the Python
API (`PipelineTrainer`, model_parallel.api.trainer) describe their job as a `JobSpec` and build it
here, so they trace, seed, load and cut a model the same way. This is the place that wires the
workflow's steps together: the profiler traces a module, the code generator rebuilds a model from a
graph, the runtime loads a PipeDream-generated package (job_models.py: where the model comes from), and the even split
is the default plan.

Models are built on the meta device (zoo names, graphs and our packages; a module the caller built on
meta is traced there too): no rank holds the whole model's memory. Each rank's engine materializes
the layers of its own stage (`runtime.build.materialize`), with values from `weights` (safetensors or our
checkpoint, `runtime.build.weights`) or else the per-layer init rule under `seed`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from model_parallel.api.job_models import (graph_model, output_width, package_model, ranks_from_hybrid_conf,
                                           traced_module, zoo_model)
from model_parallel.errors import PlanError
from model_parallel.graph.in_flight import MULTI_STAGE_SCHEDULES, V_SCHEDULES
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan
from model_parallel.runtime.run import Job
from model_parallel.runtime.step.auto import AUTO

logger = logging.getLogger(__name__)

__all__ = ["JobSpec", "Job", "build_job", "output_width", "ranks_from_hybrid_conf"]

LOSSES = ("cross_entropy", "lm")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What to train and how to cut it. Exactly one of `model`, `package`, `graph` names the model."""

    model: Union[str, nn.Module, None] = None  # a built-in model name (runtime.build.zoo) or a module this process holds
    package: Union[str, Path, None] = None  # a generated package directory (ours, or PipeDream's converter's)
    graph: Union[Graph, str, Path, None] = None  # a Graph, or its graph.json / graph.txt file
    plan: Union[Plan, str, Path, None] = None  # a Plan or plan.json; default: the package's, else an even split
    num_stages: Optional[int] = None  # stages of the even split (default: the world size less the extra replicas)
    stage_to_num_ranks: Optional[Mapping[int, int]] = None  # replicas per stage of the even split
    criterion: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None  # default: the zoo's, else by `loss`
    loss: Optional[str] = None  # "cross_entropy" | "lm"; default: "lm" for token inputs, else "cross_entropy"
    input_shape: Optional[tuple[int, ...]] = None  # per sample, for a PipeDream package (it records none)
    num_classes: Optional[int] = None  # classes of synthetic data (default: the model's output width)
    # "synthetic", "tokens:PATH", an ImageFolder directory, a map-style Dataset, an iterable, a DataLoader, or
    # anything with `batch(step) -> (inputs, target)` (runtime.data.sources turns the others into that)
    data: Any = "synthetic"
    collate_fn: Optional[Callable[[list[Any]], Any]] = None  # a map-style Dataset's or an iterable's (default: torch's)
    causal_labels: bool = False  # dict batches carry Hugging Face causal-LM labels, shifted (runtime.data.pairs.as_pair)
    seq_len: Optional[int] = None  # "tokens:PATH" windows (default: the model's input length)
    token_dtype: str = "uint16"  # "tokens:PATH" ids: uint16 (nanoGPT's GPT-2 vocabulary) or uint32
    eval_data: Any = None  # validation data, any form `data` takes (synthetic: another seed than training's)
    example_inputs: Union[Sequence[Any], Mapping[str, Any], None] = None  # a microbatch to trace a module with (default: from `data`)
    seed: int = 0  # the per-layer init rule's seed (runtime.build.materialize.layer_seed)
    weights: Union[str, Path, None] = None  # initial values: a .safetensors file, an HF sharded directory, our checkpoint
    init_weights: Optional[Callable[[Any, str], None]] = None  # init_weights(layer, layer_name): replaces reset_parameters()
    batch_size: int = 8
    num_microbatches: int = 4
    # Bytes one worker may hold: the default split becomes the most even one whose predicted footprint
    # (optimizer/memory.py) fits on every stage, else an InfeasibleError names the smallest that would.
    memory_per_worker: Optional[float] = None
    optimizer: str = "sgd_momentum"  # what the footprint prices: sgd | sgd_momentum | adam | adamw
    offload_chunk: Optional[float] = None  # bytes of optimizer state in memory when it is offloaded (RunOptions)
    schedule: str = "1f1b"  # the run's schedule (how many microbatches' activations a stage holds); "auto": chosen here
    # schedule name -> why the run cannot use it (TrainConfig.schedule_refusals, the command line's): auto skips those
    schedule_refusals: Optional[Mapping[str, str]] = None
    schedule_order: str = "list"  # zero bubble's order, "list"-built from stage times or "fixed" (TrainConfig's): what auto prices

    def __post_init__(self) -> None:
        given = [name for name in ("model", "package", "graph") if getattr(self, name) is not None]
        if len(given) != 1:
            raise PlanError(f"JobSpec: give exactly one of model, package, graph (got {', '.join(given) or 'none'})")
        if not isinstance(self.model, (str, nn.Module, type(None))) or not isinstance(self.graph, (Graph, str, Path, type(None))):
            raise PlanError(f"JobSpec: model takes a built-in model's name or an nn.Module, graph a Graph or its file; "
                            f"got model={type(self.model).__name__}, graph={type(self.graph).__name__}")
        if self.loss is not None and self.loss not in LOSSES:
            raise PlanError(f"JobSpec: loss {self.loss!r} is unknown; use one of {', '.join(LOSSES)}")
        if self.num_stages is not None and self.num_stages < 1:
            raise PlanError(f"JobSpec: num_stages must be >= 1, got {self.num_stages}")
        mem = self.memory_per_worker
        if mem is not None and (isinstance(mem, bool) or not isinstance(mem, (int, float)) or not 0 < mem < float("inf")):
            raise PlanError(f"JobSpec: memory_per_worker is bytes per worker (a number > 0), got {mem!r}")

    @property
    def micro_batch(self) -> int:
        return max(1, self.batch_size // self.num_microbatches)


INTERLEAVED_STAGES_PER_RANK = 2  # the default split under the interleaved schedule: 2 stages per rank


def _loop_plan(spec: JobSpec, graph: Graph, world_size: int) -> Plan:
    """The interleaved schedules' default plan: `num_stages` (default 2 per rank) stages balanced by profiled cost,
    each rank's stages summed: stage k on rank k % world_size (loop placement; optimizer.contiguous.loop_plan), or
    for zbv 2 per rank in a V (optimizer.contiguous.v_plan); under --memory_per_worker when given (a rank's stages
    together; runtime.plancheck checks the rest)."""
    from model_parallel.optimizer.contiguous import loop_plan, v_plan

    if spec.stage_to_num_ranks:
        where = "min(k, 2p-1-k) + i*p" if spec.schedule in V_SCHEDULES else "k % p + i*p"
        raise PlanError(f"the {spec.schedule} schedule's default split places one replica of each stage (replicas: a "
                        f"--plan with replica i of stage k on rank {where}): drop --stage_to_num_ranks, or use 1f1b")
    stages = spec.num_stages or INTERLEAVED_STAGES_PER_RANK * world_size
    footprint = _footprint(spec, graph) if spec.memory_per_worker is not None else None
    if spec.schedule in V_SCHEDULES:  # 2 stages per rank in a V: rank r holds r and 2p-1-r, balanced by rank sums
        if stages != 2 * world_size:
            raise PlanError(f"the {spec.schedule} schedule places 2 stages per rank in a V: give --num_stages "
                            f"{2 * world_size} (PipelineTrainer(num_stages=...)) for {world_size} rank(s), got {stages}")
        return v_plan(graph, world_size, memory_per_worker=spec.memory_per_worker, footprint=footprint)
    if stages % world_size or stages < 2 * world_size:
        raise PlanError(f"the interleaved schedule places {stages} stage(s) on {world_size} rank(s) in a loop: give "
                        f"--num_stages (PipelineTrainer(num_stages=...)) a multiple of the world size, at least {2 * world_size}")
    return loop_plan(graph, world_size, stages // world_size, memory_per_worker=spec.memory_per_worker,
                     footprint=footprint, schedule=spec.schedule)


def build_job(spec: JobSpec, world_size: int) -> Job:
    """Graph, plan, seed-built model, criterion and dataset of `spec` for a world of `world_size` ranks."""
    plan: Optional[Plan] = None
    adapted = False
    if spec.data is not None and not isinstance(spec.data, str):  # None: no data (plan or evaluate only)
        from model_parallel.runtime.data.sources import BatchSource, as_source

        source = as_source(spec.data, spec.batch_size, spec.seed, spec.collate_fn, spec.causal_labels)
        adapted = source is not spec.data and not isinstance(source, BatchSource)  # a batch(step) is read as it is
        spec = replace(spec, data=source)
    static = False  # a PipeDream-generated package: its plan is static (no graph.json to re-cut)
    if isinstance(spec.model, str):
        graph, model, criterion, shape, classes, kind = zoo_model(spec.model, spec.micro_batch, spec.criterion)
        vocab = classes if kind == "tokens" else None  # a language model's classes are its vocabulary
    else:
        if isinstance(spec.model, nn.Module):
            graph, model = traced_module(spec.model, spec.example_inputs, spec.data, spec.micro_batch)
        elif spec.package is not None:
            graph, plan, model, static = package_model(spec.package, spec.seed, spec.input_shape, spec.micro_batch,
                                                        plan_given=spec.plan is not None)
        else:
            graph, model = graph_model(spec.graph)  # type: ignore[arg-type]  # not None: __post_init__ wants a model, package or graph
        criterion, shape, classes, kind, vocab = spec.criterion, (), 0, "dense", None
        if not static and not isinstance(spec.model, nn.Module):  # rebuilt from a graph: traced elsewhere, at some size
            from model_parallel.api.traced_batch import check_microbatch

            check_microbatch(graph, model, spec.batch_size, spec.num_microbatches, _source(spec))
        # The graph's inputs say which loss and data fit.
        if criterion is None or isinstance(spec.data, str) or isinstance(spec.eval_data, str):
            inputs = graph.metadata.get("inputs") or []
            if not inputs:
                raise PlanError(f"{_source(spec)}: graph metadata lacks the model inputs' shapes; re-profile the model")
            shape = tuple(inputs[0]["shape"][1:])
            kind = "tokens" if inputs[0]["dtype"].startswith("int") else "dense"
            criterion = spec.criterion or _criterion(spec.loss or ("lm" if kind == "tokens" else "cross_entropy"))
            known = int(spec.num_classes or graph.metadata.get("num_classes") or output_width(graph) or 0)
            classes = known or (128 if kind == "tokens" else 10)
            vocab = known if kind == "tokens" and known else None
    if spec.plan is not None:
        from model_parallel.graph.plan import read_plan

        plan = spec.plan if isinstance(spec.plan, Plan) else read_plan(spec.plan)
    if spec.schedule == AUTO:  # resolved once, here: everything downstream sees a concrete schedule
        from model_parallel.api.auto_schedule import resolve_auto

        given = plan
        plan = resolve_auto(graph, world_size, spec.num_microbatches, spec.micro_batch, spec.schedule_refusals or {},
                            lambda name: _schedule_plan(spec, graph, name, given, world_size), spec.schedule_order == "list")
    else:
        plan = _schedule_plan(spec, graph, spec.schedule, plan, world_size)
    records = graph.metadata.get("inputs") or []
    if spec.data == "synthetic" and len(records) > 1:  # named inputs (input_ids + attention_mask): one value each
        from model_parallel.runtime.data.named_data import NamedSyntheticData

        dataset: Any = NamedSyntheticData.from_graph_inputs(records, spec.batch_size, classes, kind, spec.seed)
    elif isinstance(spec.data, str):
        from model_parallel.runtime.data.batches import make_dataset

        dataset = make_dataset(spec.data, spec.batch_size, spec.seed, shape=shape, num_classes=classes, kind=kind, vocab=vocab,
                               seq_len=spec.seq_len, token_dtype=spec.token_dtype)
    elif adapted:  # reading a user's data (collating, decoding) stays off stage 0's critical path
        from model_parallel.runtime.data.prefetch import Prefetcher

        dataset = Prefetcher(spec.data, depth=2)
    else:
        dataset = spec.data
    eval_dataset = _eval_dataset(spec, shape, classes, kind, vocab)
    from model_parallel.runtime.build.materialize import Initializer

    source = None
    weights = spec.weights if spec.weights is not None else _initial_weights(spec, graph)
    if weights is not None:
        from model_parallel.runtime.build.weights import weight_source

        source = weight_source(weights, graph)
    return Job(graph=graph, plan=plan.with_default_ranks(), model=model, criterion=criterion, dataset=dataset,
               static_plan=static, eval_dataset=eval_dataset, initializer=Initializer(spec.seed, spec.init_weights, source,
                                                          bare_tensor_defaults=spec.model is None,
                                                          model=spec.model if isinstance(spec.model, nn.Module) else None))


def _schedule_plan(spec: JobSpec, graph: Graph, schedule: str, given: Optional[Plan], world_size: int) -> Plan:
    """The plan `schedule` runs for this job: the one given (checked against `memory_per_worker`), else the loop
    plan (interleaved) or the even split (under `memory_per_worker` the most even that fits this schedule)."""
    footprint = _footprint(replace(spec, schedule=schedule), graph) if spec.memory_per_worker is not None else None
    if given is not None:
        if footprint is not None:
            from model_parallel.optimizer.memory import MemoryLimit

            MemoryLimit(float(spec.memory_per_worker), footprint).check(graph, given, "the plan given")  # type: ignore[arg-type]
        return given
    if schedule in MULTI_STAGE_SCHEDULES:
        return _loop_plan(replace(spec, schedule=schedule), graph, world_size)
    from model_parallel.runtime.build.stages import even_plan

    replicas = dict(spec.stage_to_num_ranks) if spec.stage_to_num_ranks else None
    stages = spec.num_stages or (world_size - (sum(replicas.values()) - len(replicas) if replicas else 0))
    return even_plan(graph, stages, replicas, spec.memory_per_worker, footprint)


def _eval_dataset(spec: JobSpec, shape: tuple[int, ...], classes: int, kind: str, vocab: Optional[int]) -> Any:
    """The validation data of `spec` (None without): read on demand, no prefetching (each validation
    rereads steps 0..n-1, which a prefetcher would only read ahead past)."""
    if spec.eval_data is None:
        return None
    if not isinstance(spec.eval_data, str):
        from model_parallel.runtime.data.sources import as_source

        return as_source(spec.eval_data, spec.batch_size, spec.seed, spec.collate_fn, spec.causal_labels)
    from model_parallel.runtime.data.batches import make_dataset

    # Synthetic validation data from another seed: training's own minibatches would not be held out.
    return make_dataset(spec.eval_data, spec.batch_size, spec.seed + 1, shape=shape, num_classes=classes, kind=kind,
                        prefetch=0, seq_len=spec.seq_len, token_dtype=spec.token_dtype, vocab=vocab)


def _footprint(spec: JobSpec, graph: Graph) -> Any:
    """The footprint model of the run `spec` describes (its optimizer, schedule, microbatches)."""
    from model_parallel.optimizer.memory import Footprint, activation_scale

    return Footprint(spec.optimizer, spec.schedule, spec.num_microbatches, activation_scale(graph, spec.micro_batch),
                     offload_chunk=spec.offload_chunk)


def _initial_weights(spec: JobSpec, graph: Graph) -> Optional[Path]:
    """The initial values a graph file names beside itself (`model-parallel profile-hf` writes the model's own
    initialisation there): a bare file name in the graph's directory, nothing else is followed."""
    name = graph.metadata.get("initial_weights")
    if not isinstance(spec.graph, (str, Path)) or not isinstance(name, str) or Path(name).name != name:
        return None
    path = Path(spec.graph).parent / name
    if not path.is_file():
        raise PlanError(f"{spec.graph}: the graph names its initial values {name!r} beside it, but {path} is missing; "
                        "copy it there or pass --weights (PipelineTrainer(weights=...))")
    logger.info("initial values from %s (named by the graph)", path)
    return path


def _source(spec: JobSpec) -> str:
    """How the spec names its model, for error messages."""
    if spec.package is not None:
        return str(spec.package)
    if spec.graph is not None and not isinstance(spec.graph, Graph):
        return str(spec.graph)
    return f"the {type(spec.model or spec.graph).__name__} given"


def _criterion(loss: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    if loss == "lm":
        from model_parallel.models.gpt import lm_loss

        return lm_loss
    from torch.nn import functional as F

    return F.cross_entropy
