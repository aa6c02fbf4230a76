"""The coordinator ("master server" in PipeDream's seed): `python test_socket.py --port P --token T --graph G --plan P`.

See docs/coordinator.md. Same as `model-parallel coordinator ...`.
"""
import os
import sys

try:
    import model_parallel  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from model_parallel.cli.common import run_cli
from model_parallel.cli.coordinator import coordinator_main

if __name__ == "__main__":
    run_cli(coordinator_main)
