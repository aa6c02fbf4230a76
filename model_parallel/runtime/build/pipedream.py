"""Run a package that PipeDream's own converter generated: its stage modules as whole layers of a static plan.

Such a package has no graph.json/plan.json, only `__init__.py` with `model(criterion)` returning
`[(Stage0(), ["input0"], ["out0"]), ..., (criterion, ["outN"], ["loss"])]` and the configs
`hybrid_conf.json` / `mp_conf.json` (`module_to_stage_map`, `stage_to_rank_map`; docs/FORMATS.md).
`load_pipedream_package` turns it into what the engine runs: a graph with one `call_module` node per
generated module (`module0`, `module1`, ...; getitem nodes for a module that returns a tuple, even a
1-tuple as this project's generated stages do, while PipeDream's return one output bare), a plan
from the configs, and a container module holding the generated modules under those names. A
generated module is opaque (its layers are not graph nodes), so the plan cannot be re-cut: live plan
switching needs a graph.json (`StaticPlanChannel` refuses it).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from model_parallel import jsonbound
from model_parallel.errors import PlanError
from model_parallel.graph.core import Graph, LayerSpec, Node, TensorMeta
from model_parallel.graph.plan import Plan, StagePlan
from model_parallel.messages import Command, StepReport

logger = logging.getLogger(__name__)

CONFIGS = ("hybrid_conf.json", "mp_conf.json")  # hybrid_conf carries the replicas; mp_conf is one rank per stage


@dataclass(frozen=True)
class PipeDreamJob:
    """A PipeDream-generated package, ready for the engine."""

    graph: Graph
    plan: Plan
    model: "PipeDreamModel"  # holds generated module i as attribute `module{i}`
    num_outputs: int  # width of the last output (classes / vocabulary), from one forward pass


def is_pipedream_package(directory: Path) -> bool:
    """A generated package without our graph.json (PipeDream's converter writes none)."""
    return (directory / "__init__.py").is_file() and not (directory / "graph.json").is_file()


def _import_package(directory: Path) -> Any:
    init = directory / "__init__.py"
    # A private module name: two packages with the same directory name must not collide in sys.modules.
    name = f"_mp_pipedream_{abs(hash(str(directory.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(directory)])
    if spec is None or spec.loader is None:
        raise PlanError(f"{init}: cannot be imported as a package")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - generated code may fail in any way; say where
        sys.modules.pop(name, None)
        raise PlanError(f"{init}: importing the generated package failed ({type(error).__name__}: {error})") from None
    if not callable(getattr(module, "model", None)):
        raise PlanError(f"{init}: a PipeDream package defines model(criterion) returning [(module, inputs, outputs), ...]")
    return module


def _read_config(directory: Path, count: int) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    """(module -> stage, stage -> ranks) from hybrid_conf.json or mp_conf.json (default: module i on stage i, rank i)."""
    for name in CONFIGS:
        path = directory / name
        if not path.is_file():
            continue
        expected = '{"module_to_stage_map": [0, 1, 1], "stage_to_rank_map": {"0": [0], "1": [1]}}'
        data = jsonbound.load_file(path, error=PlanError, what=name, fix=f"expected {expected}")
        if not isinstance(data, dict) or not isinstance(data.get("module_to_stage_map"), list):
            raise PlanError(f"{path}: expected {expected}, found no module_to_stage_map list")
        stage_of = [_index(s, f"{path}: module_to_stage_map", expected) for s in data["module_to_stage_map"]]
        ranks = stage_to_rank_map(data, path)
        # PipeDream lists the criterion too (it runs on the last stage); a map without it is accepted.
        if len(stage_of) not in (count, count + 1):
            raise PlanError(f"{path}: module_to_stage_map has {len(stage_of)} entries but model(criterion) returns "
                            f"{count} module(s) plus the criterion; regenerate the package")
        return stage_of[:count], ranks
    return list(range(count)), {s: (s,) for s in range(count)}


def _index(value: Any, where: str, expected: str) -> int:
    """A stage or rank number as JSON writes one: 0.7, true or "01" are refused, not read as 0, 1 or (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{where}: {json.dumps(value)[:40]} is not an integer; expected {expected}")
    return value


def stage_to_rank_map(data: Any, path: Path) -> dict[int, tuple[int, ...]]:
    """A config's `stage_to_rank_map` ({"0": [0, 1], ...}: stage -> ranks), every number an integer."""
    expected = '{"stage_to_rank_map": {"0": [0, 1], "1": [2]}}'
    mapping = data.get("stage_to_rank_map") if isinstance(data, dict) else None
    if not isinstance(mapping, dict):
        raise PlanError(f"{path}: expected {expected}, found no stage_to_rank_map object")
    ranks = {}
    for key, listed in mapping.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9 and str(int(key)) == key):
            raise PlanError(f"{path}: stage_to_rank_map key {key[:20]!r} is not a stage number; expected {expected}")
        if not isinstance(listed, list):
            raise PlanError(f"{path}: stage_to_rank_map[{key!r}] must be a list of ranks, found "
                            f"{json.dumps(listed)[:40]}; expected {expected}")
        ranks[int(key)] = tuple(_index(r, f"{path}: stage_to_rank_map[{key!r}]", expected) for r in listed)
    return ranks


class PipeDreamModel(nn.Module):
    """The generated modules in sequence (attribute `module{i}`): the whole model in one process."""

    def __init__(self, input_names: Sequence[str], wiring: Sequence[tuple[Sequence[str], Sequence[str]]]) -> None:
        super().__init__()
        self.input_names = list(input_names)
        self.wiring = [(list(i), list(o)) for i, o in wiring]

    def forward(self, *inputs: torch.Tensor) -> Any:
        values = dict(zip(self.input_names, inputs))
        result: Any = None
        for index, (in_names, out_names) in enumerate(self.wiring):
            result = getattr(self, f"module{index}")(*[values[n] for n in in_names])
            outs = list(result) if isinstance(result, (tuple, list)) else [result]
            values.update(zip(out_names, outs))
        return values[self.wiring[-1][1][0]]


class _Criterion:
    """Stands in for the criterion passed to `model(criterion)`, so its entry can be recognised and dropped."""

    def __call__(self, *args: Any) -> Any:
        raise PlanError("the package's criterion entry is not run: the worker applies --loss to the last stage")


def _node(node_id: str, op: str, target: str, args: Sequence[Any] = (), outputs: Sequence[torch.Tensor] = (),
          module: Optional[nn.Module] = None, description: str = "") -> Node:
    metas = tuple(TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in outputs)
    state = module.state_dict() if module is not None else {}
    return Node(node_id, description or target,
                activation_size=float(sum(t.numel() * t.element_size() for t in outputs)),
                parameter_size=float(sum(p.numel() * p.element_size() for p in module.parameters())) if module else 0.0,
                layer=LayerSpec(op=op, target=target, args=tuple(args), outputs=metas,
                                parameters=tuple(f"{target}.{key}" for key in state)))


def load_pipedream_package(directory: Path, seed: int = 0, input_shape: Optional[Sequence[int]] = None,
                           micro_batch: int = 2) -> PipeDreamJob:
    """Import the package (every rank with the same `seed`, so weights agree), build graph, plan and model.

    `input_shape` (per sample, e.g. (3, 224, 224)) is needed for the one forward pass that records the
    tensors' shapes; the package does not record it.
    """
    directory = Path(directory)
    package = _import_package(directory)
    sentinel = _Criterion()
    torch.manual_seed(seed)
    try:
        entries = list(package.model(sentinel))
    except Exception as error:  # noqa: BLE001 - generated code
        raise PlanError(f"{directory / '__init__.py'}: model(criterion) failed ({type(error).__name__}: {error})") from None
    entries = [e for e in entries if not (isinstance(e, (tuple, list)) and e and e[0] is sentinel)]
    for index, entry in enumerate(entries):
        if not (isinstance(entry, (tuple, list)) and len(entry) == 3 and isinstance(entry[0], nn.Module)
                and all(isinstance(n, str) for n in list(entry[1]) + list(entry[2]))):
            raise PlanError(f"{directory / '__init__.py'}: model(criterion) entry {index} is not "
                            f"(nn.Module, [input names], [output names]): {str(entry)[:80]}")
    if not entries:
        raise PlanError(f"{directory / '__init__.py'}: model(criterion) returned no stage modules")
    # The init rule of every other path (runtime/build/materialize.py): each layer under a seed of (seed, its
    # name), so a package generated here starts exactly where its graph.json would.
    from model_parallel.runtime.build.materialize import init_layer

    for module, _, _ in entries:
        for name, child in module.named_children():
            init_layer(name, child, seed)
    if input_shape is None:
        raise PlanError(f"{directory}: a PipeDream-generated package does not record its input shape; pass "
                        "--input_shape (per sample, e.g. 3,224,224) and --num_classes")
    stage_of, ranks = _read_config(directory, len(entries))

    container = PipeDreamModel([], [(list(i), list(o)) for _, i, o in entries])
    produced: dict[str, str] = {}  # tensor name -> node id producing it
    values: dict[str, torch.Tensor] = {}  # tensor name -> example value (shapes for the graph)
    nodes: list[Node] = []
    edges: list[tuple[str, str]] = []
    members: dict[int, list[str]] = {}
    inputs_meta: list[dict[str, object]] = []  # the graph's `inputs` metadata, one entry per placeholder
    for index, (module, in_names, out_names) in enumerate(entries):
        for name in in_names:
            if name in produced:
                continue
            if index and stage_of[index] != 0:
                raise PlanError(f"{directory}: input {name!r} of module {index} is produced by no earlier module; "
                                "only stage 0 may read model inputs")
            example = torch.randn(micro_batch, *input_shape)
            values[name], produced[name] = example, name
            nodes.append(_node(name, "placeholder", name, outputs=[example], description=f"Input{len(inputs_meta)}"))
            members.setdefault(0, []).append(name)
            inputs_meta.append({"name": name, "shape": list(example.shape), "dtype": "float32"})
            container.input_names.append(name)
        node_id = f"module{index}"
        container.add_module(node_id, module)
        was_training = module.training
        module.eval()  # no BatchNorm statistics updates, no dropout RNG draws: the run must start untouched
        try:
            with torch.no_grad():
                result = module(*[values[n] for n in in_names])
        except Exception as error:  # noqa: BLE001 - generated code
            raise PlanError(f"{directory}: module {index} ({type(module).__name__}) failed on inputs of shape "
                            f"{[tuple(values[n].shape) for n in in_names]} ({type(error).__name__}: {error}); "
                            "is --input_shape right?") from None
        finally:
            module.train(was_training)
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(outs) != len(out_names):
            raise PlanError(f"{directory}: module {index} returns {len(outs)} tensor(s) but is listed with outputs {list(out_names)}")
        nodes.append(_node(node_id, "call_module", node_id, [{"node": produced[n]} for n in in_names], outs,
                           module, description=type(module).__name__))
        edges += [(produced[n], node_id) for n in in_names]
        members.setdefault(stage_of[index], []).append(node_id)
        for k, (name, value) in enumerate(zip(out_names, outs)):
            values[name] = value
            if not isinstance(result, (tuple, list)):
                produced[name] = node_id  # PipeDream's convention: one output is returned bare
                continue
            # A tuple (also a 1-tuple, as this project's generated stages return) is unpacked by
            # getitem nodes, so the next module receives the tensor, not the tuple holding it.
            item = f"{node_id}_{k}"
            nodes.append(_node(item, "call_function", "operator.getitem", [{"node": node_id}, k], [value]))
            edges.append((node_id, item))
            members[stage_of[index]].append(item)
            produced[name] = item
    stages = sorted(members)
    if stages != list(range(len(stages))) or sorted(ranks) != stages:
        raise PlanError(f"{directory}: modules are on stages {stages} and stage_to_rank_map names {sorted(ranks)}; "
                        "both must be 0..N-1")
    last = produced[entries[-1][2][0]]
    graph = Graph(tuple(nodes), tuple(edges), {"model": f"PipeDream package {directory.name}", "inputs": inputs_meta,
                                               "outputs": {"node": last}})
    plan = Plan(stages=tuple(StagePlan(s, tuple(members[s]), num_replicas=len(ranks[s]), ranks=ranks[s]) for s in stages))
    width = values[entries[-1][2][0]]
    return PipeDreamJob(graph, plan, container, int(width.shape[-1]) if width.dim() else 1)


class StaticPlanChannel:
    """Wraps a control channel for a static plan: a 'switch' is refused (logged), everything else passes."""

    def __init__(self, inner: Any, why: str) -> None:
        self.inner, self.why = inner, why

    def report(self, report: StepReport) -> None:
        self.inner.report(report)

    def poll(self, before_step: Optional[int] = None) -> Optional[Command]:
        command = self.inner.poll(before_step)
        if command is not None and command.kind == "switch":
            logger.error("refusing the live plan switch (%s): %s; training goes on with the static plan",
                         command.reason or "no reason given", self.why)
            refused = getattr(self.inner, "switch_refused", None)  # the coordinator waits for an answer to every switch
            if refused is not None and command.plan is not None:
                refused(command.plan.version, self.why)
            return None
        return command

    def close(self, reason: str = "") -> None:
        self.inner.close(reason)
