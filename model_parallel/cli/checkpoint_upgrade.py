"""`model-parallel checkpoint-upgrade DIR`: convert, once, the shards an earlier model_parallel wrote as torch pickles.

Shards used to be torch.save files (`step_<N>/shard_<rank>.pt`); this version writes safetensors and never unpickles
what it reads, so it refuses those. Running this command is the opt-in: for each committed step of DIR whose
manifest lists `.pt` shards, each is checked against its recorded size and sha256, loaded with
torch.load(weights_only=True) (a restricted unpickler, still an unpickler: only run it on files you trust) and
rewritten as `shard_<rank>.safetensors`; then its index and the step's manifest record the new file, size and
sha256 (every file replaced atomically), and the `.pt` file is removed. Exit 2 on bad input.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from model_parallel.cli.common import ArgumentParser, configure_logging, run_cli
from model_parallel.errors import CheckpointError


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="model-parallel checkpoint-upgrade", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint_dir", help="a --checkpoint_dir written by an earlier version (its files trusted)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.verbose)
    root = Path(args.checkpoint_dir)
    from model_parallel.runtime.checkpoint.store import list_checkpoints

    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory; give a run's --checkpoint_dir")
    steps = list_checkpoints(root)
    if not steps:
        raise CheckpointError(f"{root}: no committed checkpoint (no step_<N>/manifest.json); nothing to convert")
    converted = [line for step in steps for line in upgrade_step(root, step)]
    for line in converted:
        print(line)
    print(f"converted {len(converted)} shard(s) in {root}" if converted else f"{root}: every shard is safetensors already")
    return 0


def upgrade_step(root: Path, step: int) -> list[str]:
    """Rewrite the `.pt` shards of committed step `step` as safetensors; returns what was converted."""
    import torch

    from model_parallel.fileio import atomic_write, atomic_write_json
    from model_parallel.runtime.checkpoint.check import check_manifest, check_payload, shard_digest
    from model_parallel.runtime.checkpoint.layout import MANIFEST, PICKLED_SUFFIX, fsync_dir, shard_path, step_dir
    from model_parallel.runtime.checkpoint.shardio import write_shard_file
    from model_parallel.runtime.checkpoint.store import _read_json

    folder = step_dir(root, step)
    manifest = _read_json(folder / MANIFEST, "manifest")
    check_manifest(manifest, folder / MANIFEST, step)
    done, old_files = [], []
    for entry in manifest["shards"]:
        old = folder / entry["file"]
        if not entry["file"].endswith(PICKLED_SUFFIX):
            continue
        size, digest = shard_digest(old, entry.get("bytes"), entry["rank"])
        if digest != entry["sha256"]:
            raise CheckpointError(f"{old}: the shard's sha256 differs from {MANIFEST}; it was not loaded")
        try:
            payload: Any = torch.load(old, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - torch raises many kinds for a file it cannot read
            raise CheckpointError(f"{old}: cannot be loaded as a torch checkpoint ({type(error).__name__}: "
                                  f"{str(error).splitlines()[0][:200] if str(error) else ''})") from None
        check_payload(payload, entry, old)
        new = shard_path(root, step, entry["rank"])
        written: list[tuple[int, str]] = []
        atomic_write(new, lambda f: written.append(write_shard_file(f, payload["params"], payload["buffers"],
                                                                    payload["optimizer"], payload["extra"], new)),
                     binary=True, readable=True)
        del payload
        entry.update(file=new.name, bytes=written[0][0], sha256=written[0][1])
        index = old.with_suffix(".json")
        if index.is_file():  # the shard's own index, read by finalize: the same fields
            atomic_write_json(index, {**_read_json(index, "shard index"), **{k: entry[k] for k in ("file", "bytes", "sha256")}})
        done.append(f"step_{step}/{old.name} -> {new.name} ({written[0][0]} bytes, sha256 {written[0][1][:16]}...)")
        old_files.append(old)
    if done:
        atomic_write_json(folder / MANIFEST, manifest)  # the commit of this step's conversion
        fsync_dir(folder)
        for old in old_files:
            old.unlink()
    return done


if __name__ == "__main__":
    run_cli(main)
