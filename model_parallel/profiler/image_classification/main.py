"""PipeDream's step 1 where its README types it (`python main.py -a resnet152 -b 64`): same as `model-parallel profile`."""
import functools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a plain script from a checkout: import this checkout's `model_parallel`
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # (not another one installed in the environment)

from model_parallel.cli.profile import main  # noqa: E402

if __name__ == "__main__":
    from model_parallel.cli.common import run_cli

    run_cli(functools.partial(main, prog=None))  # usage and errors name this script
