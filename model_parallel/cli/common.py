"""What every command line shares: logging set-up and turning our errors into one line + exit code 2."""
from __future__ import annotations

import argparse
import logging
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
    sys.exit(code or 0)
