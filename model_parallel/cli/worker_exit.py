"""How a worker process ends after a failure: the one error line, the exit code, the status its peers read,
and a last line naming the latest committed checkpoint and the command that resumes from it.

Exit codes (docs/reliability.md): 0 only when every requested step ran; 2 a usage or configuration
error (cli.common.run_cli); 3 a peer died, stalled or became unreachable (the message names it);
4 the run was stopped before its requested steps (a stop command, or SIGTERM / Ctrl-C at a step boundary, with a
checkpoint: runtime/step/stop_signals.py; the message says by whom and why); 5 this rank's
own code failed while training (a layer raised: wrong device, shapes, out of memory); 6 (`--recover`) this
process was declared lost and its peers re-formed the world without it (it came back too late: it never rejoins).
"""
from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, Optional

from model_parallel.cli.common import EXIT_USAGE

EXIT_PEER = 3
EXIT_STOPPED = 4
EXIT_FAILED = 5
EXIT_REPLACED = 6
# How long the store host keeps the store up after a failure, in --timeouts, unless every other live rank
# has published its verdict sooner: a peer may sit in a receive for up to one timeout before its own
# diagnosis (at most 0.4 timeouts) reads the store to name the culprit.
LINGER_TIMEOUTS = 1.4

__all__ = ["EXIT_USAGE", "EXIT_PEER", "EXIT_STOPPED", "EXIT_FAILED", "EXIT_REPLACED", "LINGER_TIMEOUTS", "resume_hint", "launch_command", "leave",
           "runtime_failure"]


def runtime_failure(error: BaseException, prefix: str) -> str:
    """One line for an exception our code did not raise on purpose (a layer failing at run time)."""
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return f"{prefix} failed while training: {type(error).__name__}: {text}".rstrip(": ")


def resume_hint(checkpoint_dir: Optional[str], argv: Sequence[str], rank: int, fix_first: bool = False,
                who: Optional[str] = None) -> Optional[str]:
    """The last line after a failure: the latest committed checkpoint and the command that resumes from it
    (None without --checkpoint_dir: nothing was saved to resume from). `fix_first`: the failure was a usage or
    configuration error, which the same command would meet again (a resume refused for a changed flag, a
    token file with a bad id): the line says to fix it first. `who`: the line's prefix (default "[rank R]")."""
    if not checkpoint_dir:
        return None
    from model_parallel.errors import CheckpointError
    from model_parallel.runtime.checkpoint.layout import latest_step, step_dir

    who = who or f"[rank {rank}]"
    try:
        step = latest_step(checkpoint_dir)
    except CheckpointError as error:
        return f"{who} cannot tell which checkpoint to resume from: {error}"
    except OSError as error:
        return f"{who} cannot read --checkpoint_dir {checkpoint_dir}: {error}"
    launcher, note = launch_command()
    if any(a == "--join" or a.startswith("--join=") for a in argv):
        # A joiner's command cannot resume the job (--resume on it only restores what an admission gives it): the
        # job's own ranks resume it, and this command joins it again (it said "resume every rank with: ... --join").
        where = (f"no checkpoint was committed in {checkpoint_dir}" if step is None else
                 f"latest committed checkpoint: {step_dir(checkpoint_dir, step)}")
        steps = _steps(argv)
        if step is not None and steps is not None and step + 1 >= steps:
            # The job ended before it admitted this worker (or while it stood still): "resume the job" has nothing
            # to run, and "join it again" nothing to join
            return (f"{who} the job finished: its latest committed checkpoint {step_dir(checkpoint_dir, step)} "
                    f"holds all {steps} requested step(s); there is nothing left to join")
        again = shlex.join([*launcher, *(a for a in argv if a != "--resume")]) + note
        return (f"{who} {where}; this worker joined with --join: resume the job with its "
                f"ranks' own commands (each one's last line), then join it again with: {again}")
    args = list(argv) if "--resume" in argv else [*argv, "--resume"]
    command = shlex.join([*launcher, *args]) + note
    if step is None:
        return f"{who} no checkpoint was committed in {checkpoint_dir}; rerun to start over: {command}"
    first = " once the error above is fixed (where it names a flag: in this command too)," if fix_first else ""
    return f"{who} latest committed checkpoint: {step_dir(checkpoint_dir, step)};{first} resume every rank with: {command}"


def _steps(argv: Sequence[str]) -> Optional[int]:
    """The `--steps N` of a worker's command line (None if absent or not a number)."""
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--steps" and i + 1 < len(argv) else arg[len("--steps="):] if arg.startswith("--steps=") else None
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def launch_command(env: Optional[Mapping[str, str]] = None, main_module: Optional[str] = None,
                   argv0: Optional[str] = None) -> tuple[list[str], str]:
    """How this worker was started, up to its flags, as a user types it again, and a note where that is not all:
    `python -m model_parallel.cli.worker`, `python test_parallel_0.py`, `model-parallel worker` (also as
    `python -m model_parallel.cli.main worker`); under torchrun
    (which sets TORCHELASTIC_RUN_ID) `torchrun --nproc_per_node=N -m ...`, its rendezvous flags unknown here
    (the note says so on several nodes). Defaults: this process's environment, `__main__` and sys.argv[0]."""
    env = os.environ if env is None else env
    if main_module is None:  # `python -m X` (also what torchrun -m runs): __main__'s spec names X
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        main_module = spec.name if spec is not None else ""
    script = os.path.basename(sys.argv[0] if argv0 is None else argv0) or "test_parallel_0.py"
    if main_module:
        target, python = ["-m", main_module.removesuffix(".__main__")], [os.path.basename(sys.executable)]
        if main_module == "model_parallel.cli.main":  # `python -m model_parallel.cli.main worker ...`: the
            target.append("worker")  # subcommand is not in the worker's own argv, and without it the line fails
    elif script == "model-parallel":  # the console script's subcommand: an executable, not a Python file
        target, python = ["model-parallel", "worker"], []
    else:
        target, python = [script], [os.path.basename(sys.executable)]
    if "TORCHELASTIC_RUN_ID" not in env:
        return [*python, *target], ""
    nodes = int(env.get("GROUP_WORLD_SIZE", "1") or 1)
    torchrun = ["torchrun", *([f"--nnodes={nodes}"] if nodes > 1 else []),
                f"--nproc_per_node={env.get('LOCAL_WORLD_SIZE', '1')}", *([] if python else ["--no-python"])]
    return [*torchrun, *target], " (on every node, with the same rendezvous flags)" if nodes > 1 else ""


def leave(code: int, line: str, rank: int, health: Any, *, state: str = "failed", cause: str = "",
          blamed: Optional[int] = None, linger: bool = True, hint: Optional[str] = None) -> NoReturn:
    """Print the error line (and the resume hint), publish this rank's status, keep the store up for the
    others if this rank hosts it, and exit without interpreter teardown (a store call blocked in a daemon
    thread would abort it: exit -6 instead of `code`)."""
    print(line, file=sys.stderr, flush=True)
    if hint:
        print(hint, file=sys.stderr, flush=True)
    if health is not None:
        health.stop(state, None, cause or line)
        # The store host keeps the store up so the others can read who is to blame; not when it is the
        # culprit itself (it stood still): they gave up on it already.
        if linger and rank == health.store_host and blamed != rank:
            health.linger(LINGER_TIMEOUTS * health.store_timeout, blamed)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
