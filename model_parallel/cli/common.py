"""What every command line shares: logging set-up and turning our errors into one line + exit code 2."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Optional

from model_parallel.errors import ModelParallelError

EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (argparse's own convention)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def add_token_arguments(parser: argparse.ArgumentParser) -> None:
    """--token / --token-file: the shared secret of `model-parallel coordinator` and `ctl`."""
    parser.add_argument("--token", help="shared secret (or --token-file, or $MODEL_PARALLEL_TOKEN)")
    parser.add_argument("--token-file", "--token_file", dest="token_file", help="file whose first line is the shared secret")


def configure_logging(verbose: int = 0, prefix: str = "") -> None:
    """Only command lines configure handlers; library code just calls logging.getLogger(__name__)."""
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose == 1 else logging.WARNING
    fmt = f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s" if prefix else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True)


def run_cli(main: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None) -> None:
    """Run `main(argv)` and exit with its code; our errors become `error: <message>` and exit 2."""
    prog = argparse.ArgumentParser().prog
    try:
        code = main(argv)
    except ModelParallelError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a socket or another pipe: a real error
        sys.exit(EXIT_BROKEN_PIPE)  # `| head` read what it wanted: a traceback here was noise
    sys.exit(code or 0)


EXIT_BROKEN_PIPE = 141  # what a shell reports for a process killed by SIGPIPE (128 + 13)


def _stdout_closed() -> bool:
    """Whether stdout's reader went away; if so stdout points at /dev/null, so exiting does not raise again."""
    try:
        import select

        poll = select.poll()  # a pipe whose reader closed polls POLLERR; a terminal, file or live pipe does not
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poll.poll(0)):
            return False
    except (OSError, ValueError, AttributeError):
        return False
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # the exit code says it all the same; Python may add one "Exception ignored" line at shutdown
    return True
