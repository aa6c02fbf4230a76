"""The per-layer init rule: a layer built on meta gets its first values under its own seed.

One owner for the rule the runtime uses to build stages (`runtime/build/materialize.py`) and the profiler
uses to time a model layer by layer (`profiler/layer_by_layer.py`): under a CPU generator seeded
with `layer_seed(seed, layer_name)`, the user's `init_weights(layer, layer_name)` hook if given,
else `reset_parameters()` of every module of the layer that holds tensors directly. A bare tensor
(the torch.export route lifts parameters out of their modules: Hugging Face models) gets the value
its owning module's `reset_parameters()` gives it (`owner_reset`). Every layer draws from its own
seed, so its values depend neither on the partition nor on the order.

Hugging Face modules often have no `reset_parameters()` (GPT-2's Conv1D, Llama's RMSNorm and rotary
table): `hf_init_weights(model)` is the hook that applies the model's own `_init_weights` (what
`from_config` uses) to each tensor; the runtime uses it by default for a `PreTrainedModel`
(`runtime.build.materialize.Initializer.hook`).
"""
from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping
from typing import Optional, Union, cast

import torch
from torch import nn

from model_parallel.errors import InitError
from model_parallel.graph.names import layer_name  # noqa: F401 - the seed's name; re-exported for the profiler

Layer = Union[nn.Module, torch.Tensor]
InitWeights = Callable[[Layer, str], None]  # fills one layer's tensors in place, drawing from the global RNG
BareTensorInit = Callable[[str, torch.Tensor], None]  # fills one bare tensor in place
TensorOwners = Mapping[str, tuple[str, nn.Module, str]]  # layer name -> (state path, owning module, key)
TensorTable = dict[str, Optional[torch.Tensor]]


def tensor_tables(module: nn.Module) -> tuple[TensorTable, TensorTable]:
    """The module's own `_parameters` and `_buffers`, typed as the tensor swaps here use them: torch's stubs
    say a parameter slot holds a Parameter, but a swap may put a plain tensor there for a call (as torch.func does)."""
    return cast(TensorTable, module._parameters), module._buffers


def tensor_table(module: nn.Module, key: str) -> TensorTable:
    """The one of `tensor_tables(module)` that holds `key` (parameters first)."""
    parameters, buffers = tensor_tables(module)
    return parameters if key in parameters else buffers


def is_hugging_face_model(model: nn.Module) -> bool:
    """A transformers `PreTrainedModel` (checked by class name, so transformers need not be importable)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


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


# ---- bare tensors: the owning module's rule ---------------------------------------------------------
def tensor_owners(model: nn.Module) -> dict[str, tuple[str, nn.Module, str]]:
    """Layer name of each parameter/buffer path (what a get_attr layer is called) -> (path, owning module, key)."""
    out: dict[str, tuple[str, nn.Module, str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                full = f"{path}.{key}" if path else key
                out.setdefault(layer_name(full), (full, module, key))
    return out


def meta_copy(module: nn.Module) -> nn.Module:
    """The module with every parameter and buffer on meta (no storage; ties stay ties; the original untouched)."""
    memo: dict[int, object] = {}
    for _, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        meta = tensor.detach().to("meta")
        memo.setdefault(id(tensor), nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta)
    return copy.deepcopy(module, memo)


def owner_reset(owners: TensorOwners) -> BareTensorInit:
    """Fill a bare tensor with what its owning module's `reset_parameters()` gives it: on a copy of that
    module (its own tensors on the CPU, its children on meta), under the generator `init_layer` seeded."""

    def fill(name: str, tensor: torch.Tensor) -> None:
        if name not in owners:
            raise InitError(f"layer {name!r} is a bare tensor of shape {tuple(tensor.shape)} built on meta, and no "
                            f"module's reset_parameters() covers it; pass init_weights=fn(layer, layer_name) (it "
                            f"fills tensors in place), or load its values (safetensors or a checkpoint)")
        path, module, key = owners[name]
        if not callable(getattr(module, "reset_parameters", None)):
            raise InitError(f"layer {name!r} is a bare tensor of shape {tuple(tensor.shape)} ({path!r} of a "
                            f"{type(module).__name__}, which has no reset_parameters()); give {type(module).__name__} a "
                            f"reset_parameters(), pass init_weights=fn(layer, layer_name) (it fills tensors in place), "
                            f"or load its values (safetensors or a checkpoint)")
        clone = meta_copy(module).to_empty(device="cpu", recurse=False)
        reset: Callable[[], object] = getattr(clone, "reset_parameters")  # checked callable just above
        reset()
        value = tensor_table(clone, key)[key]
        if value is None:
            raise InitError(f"layer {name!r}: {type(module).__name__}.reset_parameters() set {key!r} to None; give it "
                            f"a tensor there, or pass init_weights=fn(layer, layer_name) (it fills tensors in place)")
        tensor.copy_(value)

    return fill


# ---- Hugging Face models: the model's own per-module init --------------------------------------------
def hf_init_weights(model: nn.Module) -> InitWeights:
    """`init_weights` for a Hugging Face `PreTrainedModel`: each tensor gets what the model's own
    `_init_weights` gives it (the rule `from_config` applies: GPT-2's scaled `c_proj`, Llama's RMSNorm
    ones and rotary table), drawn from the layer's generator.

    HF applies `_init_weights` to every module, children before parents, each sub-model with its own
    (`PreTrainedModel.initialize_weights`). Here, per tensor, it is applied to the tensor's owner and
    then each ancestor, in that order, on a meta copy of the model in which only that tensor is real:
    the calls that touch other tensors do nothing and draw nothing, so a tensor's values depend only on
    (seed, layer name)."""
    if not callable(getattr(model, "_init_weights", None)):
        raise InitError(f"hf_init_weights: {type(model).__name__} is not a Hugging Face PreTrainedModel (it has no "
                        f"_init_weights); pass your own init_weights=fn(layer, layer_name)")
    shadow = meta_copy(model)  # meta tensors only: the module tree, no storage
    owners = tensor_owners(model)
    module_paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}

    def init_one(path: str, tensor: torch.Tensor) -> None:
        parts = path.split(".")
        # (module, the _init_weights of its nearest PreTrainedModel) from the root down; the root's is
        # checked callable above.
        chain: list[tuple[nn.Module, Callable[[nn.Module], object]]] = []
        init: Callable[[nn.Module], object] = getattr(shadow, "_init_weights")
        module = shadow
        for depth in range(len(parts)):
            own = getattr(module, "_init_weights", None)
            init = own if callable(own) else init
            chain.append((module, init))
            if depth < len(parts) - 1:
                module = module.get_submodule(parts[depth])
        table = tensor_table(module, parts[-1])
        meta = table[parts[-1]]
        table[parts[-1]] = tensor  # the real tensor, filled in place by the calls below
        try:
            for owner, init in reversed(chain):  # the owner first, then its ancestors (HF's post-order)
                init(owner)
        finally:
            table[parts[-1]] = meta

    def init_weights(layer: Layer, name: str) -> None:
        if isinstance(layer, torch.Tensor):
            if name not in owners:
                raise InitError(f"hf_init_weights: layer {name!r} is no parameter or buffer of {type(model).__name__}")
            init_one(owners[name][0], layer)
            return
        prefix = module_paths.get(id(layer))
        if prefix is None:
            raise InitError(f"hf_init_weights: layer {name!r} ({type(layer).__name__}) is no module of {type(model).__name__}")
        for sub, child in layer.named_modules(remove_duplicate=False):
            for key, tensor in [*child._parameters.items(), *child._buffers.items()]:
                if tensor is not None:
                    init_one(".".join(p for p in (prefix, sub, key) if p), tensor)

    return init_weights
