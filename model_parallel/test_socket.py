"""The seed's step 4, master server, run from `model_parallel/` as PipeDream's README says: `python test_socket.py`.

With no arguments it serves the package convert_graph_to_model.py wrote last (see
model_parallel/coordinator/jobfiles.py) and prints how workers join. Same as the repository root's
test_socket.py and `model-parallel coordinator`; see docs/coordinator.md.
"""
import os
import sys

if __name__ == "__main__":
    # Run as a script, this file's folder (the package itself) would come first on sys.path, and its
    # modules (errors, graph, runtime, ...) would shadow top-level names: put the checkout there instead.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.path.insert(0, os.path.dirname(here))

    from model_parallel.cli.common import run_cli
    from model_parallel.cli.coordinator import coordinator_main

    run_cli(coordinator_main)
