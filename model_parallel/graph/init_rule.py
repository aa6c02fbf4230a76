"""The per-layer init rule: a layer built on meta gets its first values under its own seed.

One owner for the rule the runtime uses to build stages (`runtime/materialize.py`) and the profiler
uses to time a model layer by layer (`profiler/layer_by_layer.py`): under a CPU generator seeded
with `layer_seed(seed, layer_name)`, the user's `init_weights(layer, layer_name)` hook if given,
else `reset_parameters()` of every module of the layer that holds tensors directly. Every layer
draws from its own seed, so its values depend neither on the partition nor on the order.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Optional, Union

import torch
from torch import nn

from model_parallel.errors import InitError

Layer = Union[nn.Module, torch.Tensor]
InitWeights = Callable[[Layer, str], None]  # fills one layer's tensors in place, drawing from the global RNG
BareTensorInit = Callable[[str, torch.Tensor], None]  # fills one bare tensor in place


def layer_name(target: str) -> str:
    """`"layer1.0.conv1"` -> `"layer1_0_conv1"`: the attribute a stage module holds the layer under,
    and the name its seed is drawn from (`codegen.naming` re-exports it)."""
    name = str(target).replace(".", "_")
    if not name.isidentifier():
        # graph.txt node ids like `5` are not identifiers; a prefix keeps them readable and unique.
        name = "_" + "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return name


def layer_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one layer: sha256 of (seed, layer name), whatever the process or order."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_layer(name: str, obj: Layer, seed: int, init_weights: Optional[InitWeights] = None,
               bare_tensor: Optional[BareTensorInit] = None) -> None:
    """Initialise one (allocated) layer under its own seed; refuse a tensor no rule covers.

    `bare_tensor(name, tensor)`: how a bare tensor (no module around it) is filled when no
    `init_weights` is given; without it such a tensor is an `InitError`."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(layer_seed(seed, name))
        if init_weights is not None:
            init_weights(obj, name)
            return
        if isinstance(obj, torch.Tensor) and bare_tensor is not None:
            bare_tensor(name, obj)
            return
        if isinstance(obj, torch.Tensor):
            raise InitError(f"layer {name!r} is a bare tensor of shape {tuple(obj.shape)} built on meta, and no "
                            f"module's reset_parameters() covers it; pass init_weights=fn(layer, layer_name) (it "
                            f"fills tensors in place), or load its values (safetensors or a checkpoint)")
        for path, module in obj.named_modules():
            own = [k for k, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]
            if not own:
                continue
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset):
                where = f"{name}.{path}" if path else name
                raise InitError(f"layer {name!r}: {type(module).__name__} at {where!r} holds {', '.join(own)} but has no "
                                f"reset_parameters(); pass init_weights=fn(layer, layer_name) to initialise it, or "
                                f"load its values (safetensors or a checkpoint)")
            reset()
