"""A running engine's checkpoint glue: the model fingerprint, restoring a rank's stage from the latest
checkpoint (whatever partition wrote it), and what a run does with its checkpoint directory at start.
Writing and committing is `checkpoint_commit.save_and_commit`; the format is `checkpoint.py`."""
from __future__ import annotations

import logging
from typing import Any

from torch import nn

from model_parallel.graph.core import Graph

logger = logging.getLogger(__name__)


def fingerprint(graph: Graph, model: nn.Module) -> str:
    """The model's parameter names (as stage modules name them), shapes and dtypes, hashed."""
    from model_parallel.codegen.naming import state_key_map
    from model_parallel.runtime.checkpoint import model_fingerprint

    # A traced model has original names (`0.weight`); one rebuilt from a graph already has stage names.
    mapping = state_key_map(graph)
    return model_fingerprint({mapping.get(name, name): p for name, p in model.named_parameters()})


def restore(engine: Any) -> int:
    """Load this rank's stage and optimizer state from the latest checkpoint; returns the next step."""
    from model_parallel.runtime import checkpoint as ckpt

    checkpoint = ckpt.load_checkpoint(engine.options.checkpoint_dir, expected_fingerprint=engine.fingerprint())
    if engine.stage is not None:
        checkpoint.load_into(engine.stage)
        if engine.optimizer is not None:
            named = dict(engine.stage.named_parameters())
            ckpt.load_optimizer_state_by_name(engine.optimizer, named, checkpoint.optimizer_state(list(named)))
    return int(checkpoint.extra.get("next_step", checkpoint.step + 1))


def prepare(engine: Any, start_step: int) -> int:
    """At the start of a run: clear what a run killed mid-checkpoint left (rank 0), and with `resume`
    restore the latest checkpoint. Returns the step to start from."""
    directory = engine.options.checkpoint_dir
    if not directory:
        return start_step
    if engine.rank == 0:
        from model_parallel.runtime.checkpoint_commit import prune

        prune(directory)  # leftovers of a run killed mid-checkpoint
    if engine.options.resume:
        from model_parallel.runtime.checkpoint import latest_step

        if latest_step(directory) is not None:
            start_step = engine.load_checkpoint()
            logger.warning("%s resumed from %s at step %d", engine.prefix, directory, start_step)
    return start_step
