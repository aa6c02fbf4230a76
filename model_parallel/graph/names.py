"""Python names for a graph's strings: the attribute a stage holds a layer under, the variable a value is in.

`layer_name(target)` is the readable base (fx's own convention: dots become underscores, so the
parameter `layer1.0.conv1.weight` is `layer1_0_conv1.weight` in a stage; checkpoints key on it).
It is not injective (`x.y` and `x_y`, `5` and `_5` share `x_y`, `_5`), and a graph file may use any
string as a node id (`self`, `class`, `forward`), so code never uses it directly: `unique_names`
maps all of one graph's targets (or node ids) at once, giving each its base name unless that name
is taken or reserved, and a numbered variant otherwise. Names that are free map exactly as before,
so checkpoints of ordinary models keep their keys; a graph that used to lose a layer to a name
collision now keeps both. `Graph.attribute_names` and `Graph.variable_names` cache the two maps.
"""
from __future__ import annotations

import functools
import keyword
from collections.abc import Iterable

# StageModule's own attributes (codegen.build): a layer named like one would replace it.
_STAGE_ATTRIBUTES = ("input_names", "output_names", "node_ids", "meta")


def layer_name(target: str) -> str:
    """`"layer1.0.conv1"` -> `"layer1_0_conv1"`: the base of the attribute a stage module holds the layer
    under, and the name its seed is drawn from. Not injective: use `unique_names` for a whole graph."""
    name = str(target).replace(".", "_")
    if not name.isidentifier():
        # graph.txt node ids like `5` are not identifiers; a prefix keeps them readable.
        name = "_" + "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return name


@functools.lru_cache(maxsize=None)
def reserved_attributes() -> frozenset[str]:
    """Names a layer attribute must not take: everything a stage module (an fx GraphModule) already has
    (`forward`, `_modules`, `graph`, `training`, ...): assigning a layer there breaks the module."""
    import torch.fx as fx
    from torch import nn

    return frozenset(dir(fx.GraphModule(nn.Module(), fx.Graph()))) | frozenset(_STAGE_ATTRIBUTES)


def _free(name: str, attributes: bool) -> bool:
    """A name generated code may use: an identifier, no keyword, no `self` (it would rebind the module in
    `forward`), no `__x` (class bodies mangle it to `_Stage0__x`), no reserved attribute for a layer."""
    if not name.isidentifier() or keyword.iskeyword(name) or name == "self" or name.startswith("__"):
        return False
    return not (attributes and name in reserved_attributes())


def unique_names(keys: Iterable[str], attributes: bool = True) -> dict[str, str]:
    """Each distinct key -> a distinct Python name, deterministic in the set of keys (not their order).

    A key gets `layer_name(key)` when that is free; a key whose base is not free (`self`, `class`,
    `forward`) gets the base with `_` appended (`__x` gets `m__x`). Keys sharing a base: the key that
    *is* the base keeps it (`x_y` over `x.y`), else the least key; the others get `<base>_1`, `<base>_2`,
    ... (skipping any name another key holds). `attributes`: also avoid the stage module's attributes
    (for layer attributes; local variables only avoid keywords and `self`).
    """
    distinct = sorted(set(map(str, keys)))
    bases = {}
    for key in distinct:
        base = layer_name(key)
        if not _free(base, attributes):
            base = "m" + base if base.startswith("__") else base + "_"
        bases[key] = base
    taken = set(bases.values())
    # Owners first (the key equal to its base, then the least), so the other keys number after them.
    order = sorted(distinct, key=lambda k: (k != bases[k], k))
    out: dict[str, str] = {}
    used: set[str] = set()
    for key in order:
        name = bases[key]
        if name in used:
            index = 1
            while f"{name}_{index}" in taken or f"{name}_{index}" in used or not _free(f"{name}_{index}", attributes):
                index += 1
            name = f"{name}_{index}"
        used.add(name)
        out[key] = name
    return {key: out[key] for key in distinct}
