"""Where a job's model comes from: a zoo name, a module this process holds, a graph, or a generated package
(ours or PipeDream's). Each returns the graph and the model on meta (`api.job.build_job` cuts and seeds them)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from model_parallel import jsonbound
from model_parallel.errors import DataError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan

logger = logging.getLogger(__name__)

__all__ = ["zoo_model", "traced_module", "graph_model", "package_model", "output_width", "ranks_from_hybrid_conf"]


def zoo_model(name: str, micro_batch: int, criterion: Optional[Callable]
              ) -> tuple[Graph, nn.Module, Callable, tuple[int, ...], int, str]:
    """A built-in model, built on meta and traced there on one microbatch of its example input."""
    from model_parallel.profiler.trace import trace_model
    from model_parallel.runtime.build.zoo import recipe

    r = recipe(name)
    model = r.meta_model()
    graph, _ = trace_model(model, tuple(x.to("meta") for x in r.example(micro_batch)))
    return graph, model, criterion or r.criterion, r.input_shape, r.num_classes, r.kind


def traced_module(model: nn.Module, example: Any, data: Any, micro_batch: int) -> tuple[Graph, nn.Module]:
    """A module this process holds, traced on one microbatch (`example_inputs`, else the data's first)."""
    from model_parallel.graph.loader import allow_model
    from model_parallel.profiler.trace import trace_model

    if example is None:
        if isinstance(data, str):
            raise PlanError(f"JobSpec(model={type(model).__name__}): give example_inputs (one microbatch of inputs to "
                            f"trace with) or a dataset as data, not {data!r}")
        inputs, _ = data.batch(0)
        if isinstance(inputs, Mapping):  # keyword inputs (`{"input_ids": ...}`): one microbatch of each
            example = {k: v[: micro_batch] for k, v in inputs.items()}
        else:
            example = [x[: micro_batch] for x in inputs]
    else:
        _warn_other_batch(example, micro_batch)
    _check_decoder_inputs(model, example)
    # Trace where the model is (a model built on meta traces shapes on meta; one on a GPU runs there).
    where = next((t.device for t in [*model.parameters(), *model.buffers()] if t.device.type != "cpu"), None)
    if where is not None:
        move = lambda x: x.to(where) if isinstance(x, torch.Tensor) else x  # noqa: E731
        example = {k: move(v) for k, v in example.items()} if isinstance(example, Mapping) else [move(x) for x in example]
    graph, traced = trace_model(model, dict(example) if isinstance(example, Mapping) else tuple(example))
    allow_model(model, traced)  # the graph comes from this process's own model, not from a file
    return graph, model


def _warn_other_batch(example: Any, micro_batch: int) -> None:
    """Given `example_inputs` of another batch size than a microbatch's: a shape-generic model traces the same, but a
    trace that records shapes (Hugging Face's `view`s do) fails at the first step with a raw shape error, so say why
    first. Only when every input agrees on its first dimension (a [1, T] `position_ids` broadcasts: no batch size)."""
    tensors = [x for x in (example.values() if isinstance(example, Mapping) else example)
               if isinstance(x, torch.Tensor) and x.dim() > 0]
    sizes = {int(x.shape[0]) for x in tensors}
    if len(sizes) == 1 and (size := sizes.pop()) != micro_batch:
        logger.warning("example_inputs hold %d samples (dim 0) and a microbatch %d (batch_size / num_microbatches): the "
                       "model is traced at %d; a trace that records shapes (Hugging Face models' do) then fails at the "
                       "first step with a shape error: give one microbatch of inputs", size, micro_batch, size)


def _check_decoder_inputs(model: nn.Module, example: Any) -> None:
    """An encoder-decoder's keyword inputs without the decoder's: its own forward builds them from "labels", which a
    pipeline's stages never see (they are the targets), so the trace failed deep in the decoder ("You must specify
    exactly one of input_ids or inputs_embeds") with advice about control flow. Refused here with the fix."""
    config = getattr(model, "config", None)
    if not (isinstance(example, Mapping) and getattr(config, "is_encoder_decoder", False)):
        return
    if not {"decoder_input_ids", "decoder_inputs_embeds"} & set(example):
        raise DataError(f"{type(model).__name__} is an encoder-decoder and its batches carry no 'decoder_input_ids' "
                        f"(inputs: {', '.join(map(repr, example))}); transformers builds them from the labels inside the "
                        "model, which a pipeline stage does not see: add them to each batch, e.g. "
                        "DataCollatorForSeq2Seq(tokenizer, model=model) or batch['decoder_input_ids'] = "
                        "model.prepare_decoder_input_ids_from_labels(labels=batch['labels'])")


def graph_model(source: Union[Graph, str, Path]) -> tuple[Graph, nn.Module]:
    """The whole model rebuilt from a graph (a Graph or its file), on meta."""
    from model_parallel.codegen.build import full_model_from_graph
    from model_parallel.graph.io import load_graph

    graph = source if isinstance(source, Graph) else load_graph(source)
    with torch.device("meta"):
        return graph, full_model_from_graph(graph)


def package_model(source: Union[str, Path], seed: int, input_shape: Any, micro_batch: int, plan_given: bool
                  ) -> tuple[Graph, Optional[Plan], nn.Module, bool]:
    """A generated package: ours (graph.json + plan.json, ranks from hybrid_conf.json; no plan when one is given)
    or PipeDream's."""
    from model_parallel.runtime.build.pipedream import is_pipedream_package, load_pipedream_package

    package = Path(source)
    if is_pipedream_package(package):
        # PipeDream's converter wrote it: its stage modules are the layers of a static plan.
        pipedream = load_pipedream_package(package, seed, input_shape, micro_batch)
        logger.info("running PipeDream package %s: %d stage(s), static plan", package, pipedream.plan.num_stages)
        return pipedream.graph, pipedream.plan, pipedream.model, True
    from model_parallel.codegen.build import full_model_from_graph
    from model_parallel.graph.io import load_graph
    from model_parallel.graph.plan import read_plan

    graph = load_graph(package / "graph.json")
    plan = None if plan_given else ranks_from_hybrid_conf(read_plan(package / "plan.json"),
                                                                     package / "hybrid_conf.json")
    with torch.device("meta"):
        return graph, plan, full_model_from_graph(graph), False


def output_width(graph: Graph) -> Optional[int]:
    """Last dimension of the model output (the number of classes / vocabulary size), if the graph records
    it. A structured output (a dict such as Hugging Face's `ModelOutput`) is read at its `logits` entry,
    else its first entry."""
    from model_parallel.graph.arguments import referenced_nodes

    encoded = graph.metadata.get("outputs")
    if isinstance(encoded, dict) and isinstance(encoded.get("dict"), dict):
        entries = encoded["dict"]
        encoded = entries.get("logits", next(iter(entries.values()), None))
    refs = referenced_nodes(encoded) if encoded is not None else []
    if not refs or refs[0] not in graph or graph[refs[0]].layer is None:
        return None
    outputs = graph[refs[0]].layer.outputs
    return int(outputs[0].shape[-1]) if outputs and outputs[0].shape else None


def ranks_from_hybrid_conf(plan: Plan, path: Path) -> Plan:
    """Place a package's stages on the ranks its `hybrid_conf.json` names (PipeDream's stage_to_rank_map)."""
    if not path.is_file():
        return plan
    from model_parallel.runtime.build.pipedream import stage_to_rank_map

    ranks = stage_to_rank_map(jsonbound.load_file(path, error=PlanError, what="hybrid_conf.json",
                                                  fix='expected {"stage_to_rank_map": {"0": [0, 1], ...}}'), path)
    if sorted(ranks) != list(range(plan.num_stages)):
        raise PlanError(f"{path}: stage_to_rank_map names stages {sorted(ranks)}, the plan has 0..{plan.num_stages - 1}")
    stages = tuple(replace(s, ranks=ranks[s.stage_id], num_replicas=len(ranks[s.stage_id])) for s in plan.stages)
    return replace(plan, stages=stages)
