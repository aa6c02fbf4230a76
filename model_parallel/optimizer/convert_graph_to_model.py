"""PipeDream's step 3 where its README types it (`python convert_graph_to_model.py ...`): same as `model-parallel generate`."""
import functools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a plain script from a checkout: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model_parallel.cli.generate import main  # noqa: E402

if __name__ == "__main__":
    from model_parallel.cli.common import run_cli

    run_cli(functools.partial(main, prog=None))  # usage and errors name this script
