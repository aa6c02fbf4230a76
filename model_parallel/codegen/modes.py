"""Arguments a trace fixed to training mode, made to follow the stage module's mode again.

A trace records what `forward` computed in the mode it ran in, and the profiler traces in training mode:
torch.export writes `aten.dropout(x, 0.1, True)`, `aten.batch_norm(..., training=True, ...)`,
`aten.scaled_dot_product_attention(..., dropout_p=0.1)` and BatchNorm's `num_batches_tracked.add_(1)`; an fx
trace of `F.dropout(x, self.p, self.training)` records `training=True`. A stage built from those literals
drops out, and normalizes with the batch's statistics (overwriting the running ones), in eval mode too:
`evaluate` would be silently wrong and would change the model. Here each such literal becomes the stage
module's `self.training` (a dropout probability: `p * self.training`), so `stage.eval()` means what
`model.eval()` means to the original model, and training computes exactly what it did.

A literal False, or a probability of 0, stays: the model asked for no dropout there in training too. So does
BatchNorm's `training=True` without running statistics (`track_running_stats=False`: batch statistics in
both modes). What a trace cannot show is randomness a module draws in training only through other ops
through other ops: timm's DropPath (`new_empty(...).bernoulli_(q).div_(q)`, q the keep probability) gets
`q ** self.training` (all ones in eval); any other random operator is named by `random_in_eval`, and
evaluation refuses the graph rather than validate at random.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx

from model_parallel.graph.core import Graph
from model_parallel.graph.op_rules import aten_schema_name


@dataclass(frozen=True)
class ModeArgument:
    """Where an operator takes its mode: argument `index` or keyword `keyword`; `probability`: a dropout
    probability (scaled by the mode) rather than a flag; `needs_index`: an argument that must not be None
    for the flag to be the mode (BatchNorm's running mean)."""

    index: int
    keyword: str
    probability: bool = False
    needs_index: Optional[int] = None


_DROPOUTS = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "native_dropout")
# ATen operators (torch.export's training IR), by schema name.
ATEN_MODES = {
    **{name: ModeArgument(2, "train") for name in _DROPOUTS},
    "batch_norm": ModeArgument(5, "training", needs_index=3),
    "scaled_dot_product_attention": ModeArgument(4, "dropout_p", probability=True),
}
# torch.nn.functional and torch functions (an fx trace), by name.
FUNCTION_MODES = {
    **{name: ModeArgument(2, "training") for name in (*_DROPOUTS, "dropout1d", "dropout2d", "dropout3d")},
    "batch_norm": ModeArgument(5, "training", needs_index=1),
    "scaled_dot_product_attention": ModeArgument(4, "dropout_p", probability=True),
}
_TORCH_DROPOUTS = {"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"}  # torch.dropout(x, p, train)
# Operators that draw random numbers: in a stage, outside the rules above, evaluation would be random.
RANDOM_OPS = frozenset(("bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
                        "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_", "geometric_",
                        "cauchy_", "log_normal_", "random_", "multinomial", "poisson", "rrelu", "rrelu_with_noise"))


def mode_argument(target: str) -> Optional[ModeArgument]:
    """The mode argument of the call_function `target` (a graph's dotted path), if it has one."""
    schema = aten_schema_name(target)
    if schema is not None:
        return ATEN_MODES.get(schema)
    module, _, name = target.rpartition(".")
    if module == "torch" and name in _TORCH_DROPOUTS:
        return ModeArgument(2, "train")
    if module in ("torch.nn.functional", "torch._C._nn"):
        return FUNCTION_MODES.get(name)
    return None


def follow_mode(target: str, args: tuple, kwargs: dict[str, Any], training: Callable[[fx.Graph], fx.Node],
                graph: fx.Graph) -> tuple[tuple, dict[str, Any]]:
    """`args`/`kwargs` of a call_function or call_method node with a training-mode literal replaced by the
    stage's mode, `training(graph)` (a node reading `self.training`): a flag by the mode itself, a dropout
    probability p by `p * training`, a keep probability q by `q ** training`. Exact in training: x * True and
    x ** True are x, so training computes bit for bit what the trace recorded."""
    name = aten_schema_name(target) or target.rpartition(".")[2]
    if name == "add_":
        return _counted_in_training(args, kwargs, training, graph), kwargs
    if name == "bernoulli_" and len(args) == 2 and not kwargs and _is_keep_probability(args[1]):
        keep = graph.call_function(operator.pow, (args[1], training(graph)))  # in eval: all ones
        keep.meta["keep_probability"] = args[1]
        return (args[0], keep), kwargs
    if name == "div_" and len(args) == 2 and isinstance(args[0], fx.Node) and not kwargs:
        keep = args[0].args[1] if len(args[0].args) == 2 else None  # DropPath's mask scaled by its keep probability
        if isinstance(keep, fx.Node) and keep.meta.get("keep_probability") == args[1]:
            return (args[0], keep), kwargs
        return args, kwargs
    rule = mode_argument(target)
    if rule is None:
        return args, kwargs
    if rule.needs_index is not None and (len(args) <= rule.needs_index or args[rule.needs_index] is None):
        return args, kwargs
    in_args = len(args) > rule.index
    value = args[rule.index] if in_args else kwargs.get(rule.keyword)
    if rule.probability:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value == 0:
            return args, kwargs
        mode: Any = graph.call_function(operator.mul, (value, training(graph)))
    elif value is True:
        mode = training(graph)
    else:
        return args, kwargs
    if in_args:
        return args[:rule.index] + (mode,) + args[rule.index + 1:], kwargs
    return args, {**kwargs, rule.keyword: mode}


def _is_keep_probability(value: Any) -> bool:
    return isinstance(value, float) and 0.0 < value < 1.0


def _counted_in_training(args: tuple, kwargs: dict[str, Any], training: Callable[[fx.Graph], fx.Node],
                         graph: fx.Graph) -> tuple:
    """BatchNorm's `num_batches_tracked.add_(1)` (export records it beside the operator): counted in training
    only, as the module counts it (`add_(self.training)`: a bool adds 1 or 0)."""
    if len(args) == 2 and args[1] == 1 and not isinstance(args[1], bool) and isinstance(args[0], fx.Node) \
            and args[0].op == "get_attr" and str(args[0].target).endswith("num_batches_tracked") and not kwargs:
        return (args[0], training(graph))
    return args


def random_in_eval(graph: Graph) -> list[tuple[str, str]]:
    """(node id, operator) of the graph's operators that draw random numbers in eval mode too: every random
    operator but a `bernoulli_` of a literal keep probability (`follow_mode` makes that all ones in eval)."""
    found = []
    for node in graph.nodes:
        layer = node.layer
        if layer is None or layer.op not in ("call_function", "call_method"):
            continue
        name = aten_schema_name(layer.target) or layer.target.rpartition(".")[2]
        if name in RANDOM_OPS and not (name == "bernoulli_" and len(layer.args) == 2 and not layer.kwargs
                                       and _is_keep_probability(layer.args[1])):
            found.append((node.node_id, name))
    return found
