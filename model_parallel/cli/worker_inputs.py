"""Checks of the worker's flags before it joins a world (numbers, input files, each job of --jobs): one line, exit 2."""
from __future__ import annotations

import os
from typing import Any, Callable

from model_parallel import jsonbound
from model_parallel.cli import data_flags
from model_parallel.errors import ModelParallelError, PlanError, ProtocolError
from model_parallel.userfile import read_text


def read_control_script(path: str) -> Any:
    """--control_script FILE as a ScriptedChannel; any defect is a ProtocolError naming the file."""
    from model_parallel.messages import ScriptedChannel

    text = read_text(path, error=ProtocolError, what="control script", max_bytes=jsonbound.MAX_FILE_BYTES,
                     fix="give the JSON file {step: command}")
    try:
        return ScriptedChannel.from_json(text)
    except ProtocolError as error:
        raise ProtocolError(f"--control_script {path}: {error}") from None


# (flag, lowest allowed, highest allowed, what it is): a value outside, NaN or infinite is refused.
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # torch's timedelta and TCPStore (ms) overflow far above this; a week is no wait
NUMBERS = (("threads", 1, 4096, "torch threads per worker"), ("steps", 1, 1 << 53, "steps to train"),
           ("timeout", 1e-3, MAX_TIMEOUT_S, "seconds"), ("lr", 0.0, 1e6, "learning rate"),
           ("momentum", 0.0, 1e6, "SGD momentum"), ("weight_decay", 0.0, 1e6, "weight decay"),
           ("eps", 0.0, 1.0, "AdamW eps"),
           ("slowdown", 1.0, 1e6, "slowdown factor"), ("gloo_loop_nice", 0, 19, "nice value of gloo's message threads"))


def check_numbers(args: Any, where: str = "") -> None:
    """Numeric flags: finite and in range, one line each (NaN would train to NaN and exit 0; `--threads 0`
    or `--timeout inf` would be a traceback deep in torch)."""
    import math

    from model_parallel.errors import ConfigError

    for flag, low, high, what in NUMBERS:
        value = getattr(args, flag)
        if not (math.isfinite(value) and low <= value <= high):
            raise ConfigError(f"{where}--{flag} {value}: the {what} must be a finite number in {low:g}..{high:g}")


# What only the pipeline's workers do: single-process mode (runtime/trainer.SingleProcessRunner, the oracle the
# pipeline is checked against) trains in memory and writes nothing, so these would be ignored while it exits 0.
PIPELINE_ONLY = ("checkpoint_dir", "checkpoint_every", "resume", "allow_config_change", "metrics", "trace_dir")


def check_single_process(args: Any, where: str = "") -> None:
    """--single_process with a flag it would ignore (a checkpoint never written, a resume that starts at step 0)."""
    from model_parallel.errors import ConfigError

    given = [f"--{name}" for name in PIPELINE_ONLY if getattr(args, name, None)]
    if args.single_process and given:
        raise ConfigError(f"{where}--single_process with {', '.join(given)}: single-process mode (the oracle/check run) "
                          f"does not checkpoint, resume, write metrics or traces; drop {', '.join(given)}, or run the "
                          f"pipeline to have them (torchrun --nproc_per_node=N -m model_parallel.cli.worker ...)")


def check_inputs(args: Any, where: str = "") -> None:
    """Fail fast, before joining a world, on input files and values that cannot work (one line each, exit 2)."""
    check_numbers(args, where)
    if args.control_script:
        if not os.path.isfile(args.control_script):
            raise PlanError(f"{where}--control_script {args.control_script}: no such file; give the JSON file "
                            "{step: command} that rank 0 plays")
        read_control_script(args.control_script)
    if args.resume and not args.checkpoint_dir:  # else ignored: training started at step 0 and exited 0, unsaid
        from model_parallel.errors import ConfigError

        raise ConfigError(f"{where}--resume needs --checkpoint_dir DIR (the directory the run wrote its checkpoints to)")
    if args.checkpoint_dir and os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        raise PlanError(f"{where}--checkpoint_dir {args.checkpoint_dir}: is a file, not a directory; give a directory "
                        "(it is created if missing)")
    data_flags.check(args, where)
    if args.weights:
        check_weights(args.weights, where)
    if args.token_file and not os.path.isfile(args.token_file):
        raise PlanError(f"{where}--token-file {args.token_file}: no such file; write the shared token on its first line")


def check_weights(path: str, where: str = "") -> None:
    """`--weights`: a path that exists, and a file there a safetensors header (the rest is read per stage)."""
    from model_parallel.errors import InitError

    fix = "give a .safetensors file, an HF sharded directory or our checkpoint directory"
    if not os.path.exists(path):
        raise InitError(f"{where}--weights {path}: no such file or directory; {fix}")
    from model_parallel.runtime.build.weights import weight_source

    try:
        weight_source(path)  # reads the safetensors headers (or the index) only; a checkpoint is read later
    except ModelParallelError as error:
        raise InitError(f"{where}--weights {path}: {error}") from None
    except Exception as error:  # safetensors raises its own (untyped) errors for a bad header
        raise InitError(f"{where}--weights {path}: not a readable safetensors file ({str(error)[:120]}); {fix}") from None


def read_jobs(path: str, build_parser: Callable[[], Any]) -> list[list[str]]:
    """--jobs FILE: a JSON list of argument lists, each parsed with the worker's parser (`build_parser()`) and
    checked now (before any rank joins a world)."""
    fix = 'expected a JSON list of argument lists, e.g. [["--model", "mlp", "--steps", "2"], [...]]'
    jobs = jsonbound.load_file(path, error=PlanError, what="jobs file", fix=fix)
    if not isinstance(jobs, list) or not jobs:
        raise PlanError(f"{path}: the jobs file holds {type(jobs).__name__ if jobs != [] else 'an empty list'}; {fix}")
    argvs = []
    for number, job in enumerate(jobs):
        if not isinstance(job, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in job):
            raise PlanError(f"{path}: job [{number}] is {str(job)[:60]!r}, not a list of strings and numbers; {fix}")
        argv = list(map(str, job))
        parser = build_parser()

        def refuse(message: str, number: int = number) -> None:
            raise PlanError(f"{path}: job [{number}]: {message}; fix that job's arguments")

        def no_help(file: Any = None, number: int = number) -> None:  # argparse's -h/--help (or --he): print, exit 0
            raise PlanError(f"{path}: job [{number}] asks for the help text (-h/--help), which is no job; {fix}")

        parser.error = refuse  # a bad job is our typed error, not SystemExit
        parser.print_help = no_help  # nor the help text and exit 0, running nothing
        check_inputs(parser.parse_args(argv), f"{path}: job [{number}]: ")
        argvs.append(argv)
    return argvs
