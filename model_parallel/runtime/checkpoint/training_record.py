"""What a checkpoint records of how its run trained, and the check that a resume trains the same way.

    record = training_record(config, dataset, next_step)   # stored in the manifest's extra["training"]
    check_resume(stored, record, allow=False, where=...)   # ConfigError naming every field that changed

A resume that silently trained with another batch size (the worker's default 8 where the run had used
32) computes something else than the run it claims to continue: every field below that changed is
refused, named with both values, unless the user accepts it (`--allow_config_change`, then logged).
The data position (epoch, minibatch) is recorded too; it follows from the step, so it is not compared.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

from model_parallel.errors import ConfigError

logger = logging.getLogger(__name__)

# The fields a resume must keep, in the order a refusal names them.
COMPARED = ("batch_size", "num_microbatches", "schedule", "seed", "lr_schedule", "precision", "clip_grad", "data")


def describe_data(dataset: Any) -> str:
    """A short, stable name of a data source: "synthetic dense", "tokens:PATH (N samples)", a directory, a type."""
    from model_parallel.runtime.data.batches import ImageFolderData, SyntheticData
    from model_parallel.runtime.data.prefetch import Prefetcher
    from model_parallel.runtime.data.sources import IterableData, MapData

    if isinstance(dataset, Prefetcher):
        dataset = dataset.dataset
    if isinstance(dataset, SyntheticData):
        return f"synthetic {dataset.kind}"
    if isinstance(dataset, ImageFolderData):
        return str(dataset.root)
    if isinstance(dataset, MapData):
        return f"{dataset.name} ({len(dataset.dataset)} samples)"
    if isinstance(dataset, IterableData):
        return dataset.name
    return type(dataset).__name__


def training_record(config: Any, dataset: Any, next_step: int) -> dict[str, Any]:
    """The training configuration of a run (a `TrainConfig`) and where its data stands at `next_step` (JSON)."""
    from model_parallel.runtime.data.sources import position

    # A schedule `--schedule auto` chose is recorded as "auto": a resume may choose again (all flush schedules train alike).
    # `schedule_running`: the one it ran when the checkpoint was taken (auto may have chosen again at a live switch);
    # not compared on resume. A recovery's stand-in schedule (TrainConfig.schedule_asked) records the one asked for.
    schedule = "auto" if getattr(config, "schedule_auto", False) else getattr(config, "schedule_asked", None) or config.schedule
    return {
        "batch_size": config.batch_size, "num_microbatches": config.num_microbatches, "schedule": schedule,
        "schedule_running": config.schedule,
        "seed": config.seed, "lr_schedule": config.lr_schedule, "precision": "bf16" if config.bf16 else "float32",
        "clip_grad": config.clip_grad, "data": describe_data(dataset),
        "data_position": {"next_step": next_step, **position(dataset, next_step)},
    }


def changed_fields(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, stored value, current value) of every compared field that differs (fields the record lacks: unchanged)."""
    return [(key, stored[key], current.get(key)) for key in COMPARED if key in stored and stored[key] != current.get(key)]


def check_resume(stored: Optional[Mapping[str, Any]], current: Mapping[str, Any], allow: bool, where: str) -> list[str]:
    """Refuse (ConfigError) a resume that changes a recorded field, or with `allow` log each change; returns them."""
    if not isinstance(stored, Mapping):
        logger.warning("%s records no training configuration (written before it was recorded): the resume cannot "
                       "check that batch size, microbatches, schedule, seed, lr schedule, precision and data are the same",
                       where)
        return []
    changes = [f"{key} {old!r} -> {new!r}" for key, old, new in changed_fields(stored, current)]
    if changes and not allow:
        first = changed_fields(stored, current)[0][0]
        raise ConfigError(f"--resume from {where}: the run was trained with a different {first}: {'; '.join(changes)} "
                          f"(checkpoint -> this run); resume with the checkpoint's settings (e.g. --{first} "
                          f"{stored[first]}), or pass --allow_config_change (RunOptions.allow_config_change) to accept the change")
    for change in changes:
        logger.warning("--allow_config_change: resuming from %s with %s (checkpoint -> this run)", where, change)
    return changes
