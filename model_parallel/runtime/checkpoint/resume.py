"""A running engine's checkpoint glue: the model fingerprint, restoring a rank's stage from the latest
checkpoint (whatever partition wrote it), and what a run does with its checkpoint directory at start.
Writing and committing is `commit.save_and_commit`; the format is `store.py`.
Under torchrun, a restart of the workers after a failure (TORCHELASTIC_RESTART_COUNT > 0) resumes as `resume` does."""
from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from torch import nn

from model_parallel.graph.core import Graph
from model_parallel.runtime.checkpoint.commit import AgreeingEngine, CheckpointingEngine, agree, prune
from model_parallel.runtime.checkpoint.graph_identity import graph_details
from model_parallel.runtime.checkpoint.training_record import check_resume
from model_parallel.runtime.config import RunOptions

logger = logging.getLogger(__name__)


class RestoringEngine(CheckpointingEngine, Protocol):
    """What restoring a checkpoint needs: what writing one does, and the check that split ties agree."""

    def check_tied(self, when: str) -> None: ...


class StartingEngine(AgreeingEngine, Protocol):
    """What `prepare` needs of a rank's engine at the start of a run (every rank agrees on a refusal)."""

    options: RunOptions

    @property
    def prefix(self) -> str: ...

    def load_checkpoint(self) -> int: ...


def fingerprint(graph: Graph, model: nn.Module) -> str:
    """The model's parameter names (as stage modules name them), shapes and dtypes, hashed."""
    from model_parallel.codegen.naming import state_key_map
    from model_parallel.runtime.build.tied import without_aliases
    from model_parallel.runtime.checkpoint.store import model_fingerprint

    # A traced model has original names (`0.weight`); one rebuilt from a graph already has stage names.
    # A tied tensor counts once, under the key checkpoints store it by (tied.stored_keys).
    mapping = state_key_map(graph)
    named = {mapping.get(name, name): p for name, p in model.named_parameters(remove_duplicate=False)}
    return model_fingerprint(without_aliases(named, graph))


def restore(engine: RestoringEngine) -> int:
    """Load this rank's stage and optimizer state from the latest checkpoint; returns the next step.
    Collective (every rank together): a rank that cannot read its part tells every rank why (one line,
    the same on all), instead of leaving its peers to time out and blame the wrong rank; then the copies
    of a tie split across stages are checked to agree."""
    from model_parallel.errors import CheckpointError, ConfigError
    error, next_step, step, changed = None, 0, None, None
    try:
        step, next_step = _restore_stage(engine)
    except ConfigError as exc:  # a changed training configuration: every rank read the same manifest
        error, changed = str(exc), exc
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear of it (not time out)
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    failure = agree(engine, error)
    if failure is not None and changed is not None:
        raise changed  # the user's change, named as such (exit 2 on the command line)
    if failure is not None:
        raise CheckpointError(f"restoring the checkpoint failed on {failure}")
    engine.check_tied(f"after restoring checkpoint step {step}")
    return next_step


def _restore_stage(engine: RestoringEngine) -> tuple[int, int]:
    """This rank's part of restore: (the checkpoint's step, the step to continue from)."""
    from model_parallel.runtime.build.tied import stored_keys
    from model_parallel.errors import CheckpointError
    from model_parallel.runtime.checkpoint import store as ckpt

    if engine.options.checkpoint_dir is None:
        raise CheckpointError("resuming needs the checkpoint directory to read from; pass --checkpoint_dir")
    checkpoint = ckpt.load_checkpoint(engine.options.checkpoint_dir, expected_fingerprint=engine.fingerprint(),
                                      fix="start without --resume")
    next_step = int(checkpoint.extra.get("next_step", checkpoint.step + 1))
    # Every rank reads the same manifest: all refuse together, before any state changes.
    where, allow = f"{engine.options.checkpoint_dir} (step {checkpoint.step})", engine.options.allow_config_change
    check_resume(checkpoint.extra.get("training"), engine.training_record(next_step), allow, where,
                 graph_details(checkpoint.path, engine.graph))
    if engine.stage is not None:
        stored = stored_keys(engine.graph)  # a tied copy is restored from the one stored tensor
        checkpoint.load_into(engine.stage, stored)
        if engine.optimizer is not None:
            named = dict(engine.stage.named_parameters())
            state = checkpoint.optimizer_state(sorted({stored.get(name, name) for name in named}))
            # Still unread: each parameter's state goes from the shard into the optimizer (or its offload files) alone.
            state = state.renamed({name: stored.get(name, name) for name in named})
            if optimizer_state_fits(engine.optimizer, state, allow, where):
                ckpt.load_optimizer_state_by_name(engine.optimizer, named, state, copy=False)  # each entry read fresh
    # load_checkpoint checked it: an int in 0..step + 1.
    return checkpoint.step, next_step


def optimizer_state_fits(optimizer: Any, state: Any, allow: bool, where: str) -> bool:
    """Whether the checkpoint's optimizer state is this optimizer's kind (else: refused, or with `allow` left unloaded,
    logged). The training record names a changed optimizer first; this catches a checkpoint that records none."""
    from model_parallel.errors import ConfigError
    from model_parallel.runtime.checkpoint.state import foreign_state

    foreign = foreign_state(optimizer, state)
    if foreign is None:
        return True
    held, kept = (", ".join(sorted(keys)) or "nothing" for keys in foreign)
    kind = type(optimizer).__name__
    if not allow:
        raise ConfigError(f"--resume from {where}: the checkpoint holds another optimizer's state ({held}) than this "
                          f"run's {kind} keeps ({kept}); resume with the optimizer the run trained with (--optimizer, "
                          f"or its optimizer_factory), or pass --allow_config_change (RunOptions.allow_config_change) "
                          f"to start {kind}'s state afresh")
    logger.warning("--allow_config_change: resuming from %s without its optimizer state (%s): this run's %s keeps %s, "
                   "so its state starts afresh", where, held, kind, kept)
    return False


RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun's agent: 0 on the first attempt, N on the Nth restart


def elastic_restart() -> int:
    """Which torchrun restart this process is (0: the first attempt, or not under torchrun)."""
    from model_parallel.errors import ConfigError

    text = os.environ.get(RESTART_ENV, "0").strip() or "0"
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise ConfigError(f"{RESTART_ENV}={text!r} is not a restart count (torchrun sets it to 0, 1, ...); "
                          f"unset it or start the workers with torchrun")
    return count


def refuse_fresh_start(engine: StartingEngine, directory: str) -> None:
    """A run from step 0 without --resume into a directory holding committed checkpoints is refused on every rank
    (rank 0 reads the directory; ConfigError, exit 2). Before, it trained from scratch and its first commit moved
    `latest` below the old steps, which `prune` then deleted as "never committed": a forgotten --resume lost the
    previous run's checkpoints without a warning."""
    from model_parallel.errors import ConfigError
    from model_parallel.runtime.checkpoint.store import latest_step

    error = None
    if engine.rank == 0 and (step := latest_step(directory)) is not None:
        error = (f"checkpoint_dir {directory} holds committed checkpoints (latest: step {step}) and this run starts "
                 f"at step 0 without --resume, so its first checkpoint would delete them; pass --resume "
                 f"(RunOptions.resume) to continue that run, or give an empty --checkpoint_dir (or delete {directory}) "
                 f"to train from scratch")
    failure = agree(engine, error)
    if failure is not None:
        raise ConfigError(error or failure.partition(": ")[2])


def prepare(engine: StartingEngine, start_step: int) -> int:
    """At the start of a run: clear what a run killed mid-checkpoint left (rank 0), and with `resume`
    or on a torchrun restart restore the latest checkpoint. Returns the step to start from."""
    directory = engine.options.checkpoint_dir
    restart = elastic_restart()
    if not directory:
        if restart:
            logger.warning("%s torchelastic restart %d: no checkpoint directory, so training starts again from step %d "
                           "(give --checkpoint_dir / RunOptions.checkpoint_dir so a restart resumes)",
                           engine.prefix, restart, start_step)
        return start_step
    existed = os.path.isdir(directory)  # before anything is written there: the warning below says which
    if not (engine.options.resume or restart) and start_step == 0:
        refuse_fresh_start(engine, directory)
    if engine.rank == 0:
        prune(directory)  # leftovers of a run killed mid-checkpoint
    if engine.options.resume or restart:
        from model_parallel.runtime.checkpoint.store import latest_step

        if latest_step(directory) is not None:
            start_step = engine.load_checkpoint()
            if restart:  # torchrun restarted the workers after a failure: as if --resume had been given
                logger.warning("%s torchelastic restart %d: resumed from the latest committed checkpoint in %s, "
                               "continuing at step %d", engine.prefix, restart, directory, start_step)
            else:
                logger.warning("%s resumed from %s at step %d", engine.prefix, directory, start_step)
        elif restart:
            logger.warning("%s torchelastic restart %d: no committed checkpoint in %s, so training starts again "
                           "from step %d", engine.prefix, restart, directory, start_step)
        elif engine.rank == 0:
            # Not refused: launch scripts pass --resume on the first start too. But a misspelled directory would
            # otherwise train from scratch without a word.
            logger.warning("--resume: no checkpoint in %s (%s); starting from step %d", directory,
                           "has no committed checkpoint" if existed else "the directory does not exist", start_step)
    return start_step
