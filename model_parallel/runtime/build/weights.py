"""Stored initial values for a rank's layers: safetensors files and our layer-keyed checkpoints.

    source = weight_source("llama/", graph)      # a .safetensors file, an HF-style sharded directory
                                                 # (model.safetensors.index.json), or a checkpoint directory
    Initializer(seed, source=source)             # each rank reads only the tensors of its own layers

Both answer `read(expected)` with the values of the asked stage state-dict keys (`blocks_0_fc.weight`)
and nothing else. safetensors files are memory-mapped (`safe_open`): a rank touches the bytes of
its tensors only, never a whole file. Names in the files are the original model's
(`blocks.0.fc.weight`), mapped to stage keys by the same rule as everywhere (`codegen.naming`);
files already keyed by stage names work too. A missing or mis-shaped tensor is an `InitError`
naming the tensor and the file(s).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import safe_open

from model_parallel import jsonbound
from model_parallel.codegen.naming import state_key_map, tie_aliases
from model_parallel.errors import OutOfMemoryError
from model_parallel.graph.core import STATE_ALIASES, Graph
from model_parallel.runtime.build.materialize import InitError, ValueSource
from model_parallel.userfile import check_regular

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"


def _check(key: str, name: str, value: torch.Tensor, want: torch.Tensor, where: str) -> torch.Tensor:
    if tuple(value.shape) != tuple(want.shape):
        raise InitError(f"{where}: tensor {name!r} (stage key {key!r}) has shape {tuple(value.shape)}, the model "
                        f"expects {tuple(want.shape)}; are these the weights of this model and config?")
    if value.dtype != want.dtype and not (value.is_floating_point() and want.is_floating_point()):
        raise InitError(f"{where}: tensor {name!r} (stage key {key!r}) is {value.dtype}, the model expects {want.dtype}")
    return value


def _names(graph: Optional[Graph]) -> dict[str, list[str]]:
    """Stage key -> the names a file may hold it under (original names, tied names, then the key itself)."""
    if graph is None:
        return {}
    out: dict[str, list[str]] = {}
    for original, key in state_key_map(graph).items():
        out.setdefault(key, []).append(original)
    for alias, owned in tie_aliases(graph).items():  # `lm_head.weight` stored once, as `wte.weight`
        out.setdefault(alias, []).extend(out.get(owned, [owned]))
    for alias, owned in (graph.metadata.get(STATE_ALIASES) or {}).items():
        for names in out.values():
            if owned in names:
                names.append(alias)
    for group in graph.tie_groups():
        for names in out.values():
            if any(n in group for n in names):
                names.extend(n for n in group if n not in names)
    return out


def _where(file: Path, named_by: Path) -> str:
    return str(file) if file == named_by else f"{file} (named by {named_by})"


def _check_regular(file: Path, named_by: Path) -> None:
    """A FIFO or device is refused before it is opened (opening a FIFO blocks; a device never ends)."""
    check_regular(file, error=InitError, what=".safetensors file", where=_where(file, named_by))


def _open(file: Path, named_by: Path) -> Any:
    """safe_open of a regular file (followed symlinks included); a file that is not safetensors is an
    InitError, not the library's own untyped error."""
    _check_regular(file, named_by)
    try:
        return safe_open(str(file), framework="pt")
    except Exception as error:  # noqa: BLE001 - safetensors raises its own untyped errors for a bad header
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        from model_parallel.runtime.observe.memory_probe import memory_limit, refused_allocation

        if refused_allocation(error):  # the file is fine: the process's memory cap refused its memory-map
            limit, what = memory_limit(torch.device("cpu"))
            cap = f"{limit / 1e9:.3g} GB ({what})" if limit else what
            raise OutOfMemoryError(
                f"{_where(file, named_by)}: memory-mapping the weights file ({file.stat().st_size / 1e9:.3g} GB) was "
                f"refused: the process is at its memory limit, {cap}; the file is fine [{reason}]; raise the limit "
                "(under RLIMIT_AS the mapping counts whole: the file's size on top of the stage's share; RLIMIT_DATA "
                "does not count it: memory_per_worker + 0.25 GB)") from None
        raise InitError(f"{_where(file, named_by)}: not a readable safetensors file ({reason}); give the model's "
                        ".safetensors files") from None


class SafetensorsValues:
    """Values from one .safetensors file or a directory of them (HF sharded: its index names each
    tensor's file; without an index, every *.safetensors file's header is read)."""

    def __init__(self, path: Union[str, Path], graph: Optional[Graph] = None) -> None:
        self.path = Path(path)
        self.names = _names(graph)
        self.file_of: dict[str, Path] = {}
        if self.path.exists() and not self.path.is_dir():
            files = [self.path]  # a FIFO or device too: _open refuses it by name
        elif (self.path / INDEX).is_file():
            index = jsonbound.load_file(self.path / INDEX, error=InitError, what=INDEX)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise InitError(f"{self.path / INDEX}: expected {{\"weight_map\": {{tensor name: file name}}}}")
            for name, file in weight_map.items():
                if Path(file).name != file:  # the index is data: it names files in this directory, no paths
                    raise InitError(f"{self.path / INDEX}: tensor {name!r} names file {file!r}; expected a file name in {self.path}")
                self.file_of[name] = self.path / file
            for file in sorted(set(self.file_of.values())):  # before any rank joins: a stat each, nothing read
                _check_regular(file, self.path / INDEX)
            files = []
        elif self.path.is_dir():
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise InitError(f"{self.path}: no *.safetensors file and no {INDEX}")
        else:
            raise InitError(f"{self.path}: no such safetensors file or directory")
        for file in files:
            with _open(file, self.path) as handle:  # reads the header only
                for name in handle.keys():
                    self.file_of.setdefault(name, file)
        self._handles: dict[Path, Any] = {}
        self._keys: dict[Path, set[str]] = {}  # the tensors each open file holds
        self.read_names: list[str] = []  # what this source read, in order (tests and logs)

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            if not file.exists():
                raise InitError(f"{file}: listed in {self.path / INDEX} but missing")
            self._handles[file] = _open(file, self.path / INDEX)
            self._keys[file] = set(self._handles[file].keys())
        return self._handles[file]

    def read(self, expected: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, want in expected.items():
            name = next((n for n in [*self.names.get(key, []), key] if n in self.file_of), None)
            if name is None:
                tried = ", ".join(repr(n) for n in dict.fromkeys([*self.names.get(key, []), key]))
                raise InitError(f"{self.path}: no tensor for stage key {key!r} (looked for {tried}); the files hold "
                                f"{len(self.file_of)} tensors, e.g. {sorted(self.file_of)[:3]}")
            file = self.file_of[name]
            handle = self._handle(file)
            if name not in self._keys[file]:  # the index is data: it may name a file that does not hold the tensor
                raise InitError(f"{file}: holds no tensor {name!r}, which {self.path / INDEX} says it does (stage key "
                                f"{key!r}); the index and its files disagree: give the model's own files")
            value = handle.get_tensor(name)
            out[key] = _check(key, name, value, want, str(file))
            self.read_names.append(name)
        self._handles.clear()  # drop the maps: what was read is in `out`, copied into the layers next
        self._keys.clear()
        return out


class CheckpointValues:
    """Values from a committed checkpoint of ours (`runtime.checkpoint.store`); only the shards holding the
    asked keys are read."""

    def __init__(self, directory: Union[str, Path], step: Optional[int] = None, graph: Optional[Graph] = None) -> None:
        self.directory, self.step = Path(directory), step
        self.aliases = tie_aliases(graph) if graph is not None else {}

    def read(self, expected: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from model_parallel.errors import CheckpointError
        from model_parallel.runtime.checkpoint.store import load_checkpoint

        checkpoint = load_checkpoint(self.directory, self.step,
                                     fix="give --weights a training run's --checkpoint_dir, a .safetensors file or an HF directory")
        params = set(checkpoint.param_names)
        stored = {key: self.aliases.get(key, key) if key not in params and key not in checkpoint.buffer_names else key
                  for key in expected}
        try:
            values = {**checkpoint.params([n for n in stored.values() if n in params]),
                      **checkpoint.buffers([n for n in stored.values() if n not in params])}
        except CheckpointError as error:
            raise InitError(str(error)) from None
        return {key: _check(key, name, values[name], expected[key], str(checkpoint.path)) for key, name in stored.items()}


def weight_source(path: Union[str, Path], graph: Optional[Graph] = None) -> ValueSource:
    """The source a path names: our checkpoint directory (it has `latest` or step_<N>/), else safetensors."""
    from model_parallel.runtime.checkpoint.layout import LATEST

    root = Path(path)
    if root.is_dir() and ((root / LATEST).exists() or any(root.glob("step_*/manifest.json"))):
        return CheckpointValues(root, graph=graph)
    return SafetensorsValues(root, graph)
