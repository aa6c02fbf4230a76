"""A joiner's token file against the running job's, before it asks to be admitted (cli/worker_join.py).

The joiner's flags are compared with the job's, but `--data tokens:train.bin` names a file on the joiner's own
host: another file under the same path (another copy, another version) passed that comparison, and the joiner
was refused only when it restored the admission's checkpoint, inside the new world, which ended every member
of the running job with exit 2. The contents are compared here with the fingerprint the latest committed
checkpoint recorded (runtime/checkpoint/data_identity.py), so such a joiner is refused alone, before the job
stops for it. The check at restore stays the authority (this one is skipped where no record can be read).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from model_parallel.errors import ConfigError

logger = logging.getLogger(__name__)


def check_joiner_data(args: Any, where: str) -> None:
    """ConfigError (exit 2) when this joiner's `--data tokens:PATH` holds other contents than the job trained on."""
    spec = getattr(args, "data", None) or ""
    # Whatever --allow_config_change says: it lets a whole job resume with other settings, but a joiner changes
    # nothing for the members (they keep reading their files), so its restore accepting other tokens would have it
    # train its stages on other data than theirs (stage 0's inputs, the last stage's targets).
    if not spec.startswith("tokens:"):
        return
    from model_parallel.errors import CheckpointError
    from model_parallel.runtime.checkpoint.data_identity import token_file_content
    from model_parallel.runtime.checkpoint.store import load_checkpoint

    try:
        checkpoint = load_checkpoint(args.checkpoint_dir)
    except (CheckpointError, OSError) as error:  # none yet, or pruned while read: the restore checks it
        logger.debug("joiner: no committed checkpoint to compare the data with (%s)", error)
        return
    training = checkpoint.extra.get("training")
    stored = training.get("data_content") if isinstance(training, Mapping) else None
    if not isinstance(stored, Mapping) or stored.get("kind") != "token file":
        return
    path = spec[len("tokens:"):]
    try:
        mine = token_file_content(path)
    except OSError as error:
        raise ConfigError(f"--join {where}: --data {spec}: cannot read it ({error}); give the job's token file") from None
    theirs = {key: stored.get(key) for key in mine}
    if mine != theirs:
        differing = "; ".join(f"{key} {theirs[key]} (job) vs {mine[key]} (this worker)" for key in mine
                              if mine[key] != theirs[key])
        raise ConfigError(f"--join {where}: --data {spec} on this host holds other tokens than the running job trained "
                          f"on ({differing}; checkpoint step {checkpoint.step} in {args.checkpoint_dir}): give this worker "
                          "a copy of the job's token file; the job runs on without it")
