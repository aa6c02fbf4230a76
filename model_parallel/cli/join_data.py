"""A joiner's token file or image folder and graph file against the running job's, before it asks to be admitted (cli/worker_join.py).

The joiner's flags are compared with the job's, but `--data tokens:train.bin` names a file on the joiner's own
host: another file under the same path (another copy, another version) passed that comparison, and the joiner
was refused only when it restored the admission's checkpoint, inside the new world, which ended every member
of the running job with exit 2. The contents are compared here with the fingerprint the latest committed
checkpoint recorded (runtime/checkpoint/data_identity.py), so such a joiner is refused alone, before the job
stops for it; the same for `--graph FILE` / `--package DIR` (the record's graph structure, graph_identity.py). The
check at restore stays the authority (this one is skipped where no record can be read).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from model_parallel.errors import ConfigError

logger = logging.getLogger(__name__)


def check_joiner_data(args: Any, where: str) -> None:
    """ConfigError (exit 2) when this joiner's `--data tokens:PATH` or `--data DIR` (an ImageFolder) or graph file
    holds other contents than the job's.
    Whatever --allow_config_change says: it lets a whole job resume with other settings, but a joiner changes nothing
    for the members (they keep reading their files), so a joiner restoring with other tokens trained its stages on
    other data than theirs (stage 0's inputs, the last stage's targets)."""
    from model_parallel.errors import CheckpointError
    from model_parallel.runtime.checkpoint.store import load_checkpoint

    try:
        checkpoint = load_checkpoint(args.checkpoint_dir)
    except (CheckpointError, OSError) as error:  # none yet, or pruned while read: the restore checks it
        logger.debug("joiner: no committed checkpoint to compare the data with (%s)", error)
        return
    training = checkpoint.extra.get("training")
    if not isinstance(training, Mapping):
        return
    _check_graph(args, training.get("graph"), where, f"checkpoint step {checkpoint.step} in {args.checkpoint_dir}")
    spec = getattr(args, "data", None) or ""
    stored = training.get("data_content")
    if not isinstance(stored, Mapping) or spec in ("", "synthetic"):
        return
    mine, what = _content_of(spec, stored.get("kind"), where)
    if mine is None:
        return
    theirs = {key: stored.get(key) for key in mine}
    if mine != theirs:
        differing = "; ".join(f"{key} {theirs[key]} (job) vs {mine[key]} (this worker)" for key in mine
                              if mine[key] != theirs[key])
        raise ConfigError(f"--join {where}: --data {spec} on this host holds other {what} than the running job trained "
                          f"on ({differing}; checkpoint step {checkpoint.step} in {args.checkpoint_dir}): give this worker "
                          f"a copy of the job's data; the job runs on without it")


def _content_of(spec: str, kind: Any, where: str) -> tuple[Any, str]:
    """(this host's fingerprint of `--data spec`, what it holds), or (None, "") where the job's record is of another
    kind (the restore names that change)."""
    if spec.startswith("tokens:") and kind == "token file":
        from model_parallel.runtime.checkpoint.data_identity import token_file_content

        try:
            return token_file_content(spec[len("tokens:"):]), "tokens"
        except OSError as error:
            raise ConfigError(f"--join {where}: --data {spec}: cannot read it ({error}); give the job's token file") from None
    if not spec.startswith("tokens:") and kind == "image folder":
        # The image list only (paths and classes, as the record holds it): listing a directory, no image decoded.
        from model_parallel.errors import ModelParallelError
        from model_parallel.runtime.checkpoint.data_identity import data_content
        from model_parallel.runtime.data.batches import ImageFolderData

        try:
            return data_content(ImageFolderData(spec, 1)), "images"
        except ModelParallelError as error:
            raise ConfigError(f"--join {where}: {error}; give the job's image folder") from None
    return None, ""


def _check_graph(args: Any, recorded: Any, where: str, source: str) -> None:
    """The joiner's `--graph FILE` (or `--package DIR`'s graph.json) against the structure the checkpoint recorded."""
    import os

    path = getattr(args, "graph", None)
    if getattr(args, "package", None):  # ours (graph.json inside); a PipeDream package's graph is built from its modules
        from model_parallel.runtime.build.pipedream import is_pipedream_package

        path = None if is_pipedream_package(args.package) else os.path.join(args.package, "graph.json")
    if not path or not isinstance(recorded, str):
        return
    from model_parallel.errors import ModelParallelError
    from model_parallel.graph.io import load_graph
    from model_parallel.runtime.checkpoint.graph_identity import describe_graph

    try:
        mine = describe_graph(load_graph(path))
    except (ModelParallelError, OSError) as error:  # the job's build says what is wrong with it
        logger.debug("joiner: graph %s not compared (%s)", path, error)
        return
    if mine != recorded:
        raise ConfigError(f"--join {where}: the graph {path} on this host is another model than the running job's "
                          f"({recorded} (job, {source}) vs {mine} (this worker)): give this worker the job's graph file; "
                          "the job runs on without it")
