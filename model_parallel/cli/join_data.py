"""A joiner's token file or image folder and graph file against the running job's, before it asks to be admitted (cli/worker_join.py).

The joiner's flags are compared with the job's, but `--data tokens:train.bin` names a file on the joiner's own
host: another file under the same path (another copy, another version) passed that comparison, and the joiner
was refused only when it restored the admission's checkpoint, inside the new world, which ended every member
of the running job with exit 2. The contents are compared here with the fingerprint the latest committed
checkpoint recorded (runtime/checkpoint/data_identity.py), so such a joiner is refused alone, before the job
stops for it; the same for `--graph FILE` / `--package DIR` and the graph `--model NAME` traces to with this host's code
(the record's graph structure, graph_identity.py). The
check at restore stays the authority (this one is skipped where no record can be read).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from model_parallel.errors import ConfigError

logger = logging.getLogger(__name__)


def check_joiner_data(args: Any, where: str, published: Any = None) -> None:
    """ConfigError (exit 2) when this joiner's `--data tokens:PATH` or `--data DIR` (an ImageFolder) or graph
    holds other contents than the job's: the training record rank 0 `published` (runtime/wire/join.py), else the
    latest committed checkpoint's (None before the first one: not compared here).
    Whatever --allow_config_change says: it lets a whole job resume with other settings, but a joiner changes nothing
    for the members (they keep reading their files), so a joiner restoring with other tokens trained its stages on
    other data than theirs (stage 0's inputs, the last stage's targets)."""
    from model_parallel.errors import CheckpointError
    from model_parallel.runtime.checkpoint.store import load_checkpoint

    training: Any
    if isinstance(published, Mapping):
        training, source = published, f"published by the job's rank 0 at {where}"
    else:
        try:
            checkpoint = load_checkpoint(args.checkpoint_dir)
        except (CheckpointError, OSError) as error:  # none yet, or pruned while read: the restore checks it
            logger.debug("joiner: no committed checkpoint to compare the data with (%s)", error)
            return
        training, source = checkpoint.extra.get("training"), f"checkpoint step {checkpoint.step} in {args.checkpoint_dir}"
    if not isinstance(training, Mapping):
        return
    _check_graph(args, training.get("graph"), where, source)
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
                          f"on ({differing}; {source}): give this worker "
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
    """The joiner's `--graph FILE` (or `--package DIR`'s graph.json, or the graph its `--model NAME` traces to) against
    the structure the checkpoint recorded."""
    import os

    path = getattr(args, "graph", None)
    if getattr(args, "package", None):  # ours (graph.json inside); a PipeDream package's graph is built from its modules
        from model_parallel.runtime.build.pipedream import is_pipedream_package

        path = None if is_pipedream_package(args.package) else os.path.join(args.package, "graph.json")
    model = getattr(args, "model", None)
    if not (path or model) or not isinstance(recorded, str):
        return
    from model_parallel.errors import ModelParallelError
    from model_parallel.runtime.checkpoint.graph_identity import describe_graph

    try:
        if path:
            from model_parallel.graph.io import load_graph

            mine = describe_graph(load_graph(path))
        else:
            # A zoo model is traced from this host's own code: another version of model_parallel (or of torch)
            # traces another graph under the same flags, found before only by the new world's agreement, which
            # ended every member of the running job (exit 2). Traced on meta, as the worker's own build does.
            from model_parallel.api.job_models import zoo_model

            mine = describe_graph(zoo_model(str(model), max(1, args.batch_size // args.num_microbatches), None)[0])
    except (ModelParallelError, OSError) as error:  # the job's build says what is wrong with it
        logger.debug("joiner: graph %s not compared (%s)", path or model, error)
        return
    if mine != recorded:
        what, fix = ((f"the graph {path} on this host is", "give this worker the job's graph file") if path else
                     (f"--model {model} traces on this host to", "run this worker with the job's version of "
                      "model_parallel and torch (pip freeze on a member's host)"))
        raise ConfigError(f"--join {where}: {what} another model than the running job's ({recorded} (job, {source}) "
                          f"vs {mine} (this worker)): {fix}; the job runs on without it")
