"""The seed's step 4, one worker, run from `model_parallel/` as PipeDream's README says:
`python test_parallel_0.py --rank N --dist_addr <rank 0's address>`.

With no model on the command line the worker asks the coordinator for the job (graph, plan, training
flags). Same as the repository root's test_parallel_0.py; see docs/runtime.md and docs/coordinator.md.
"""
import os
import sys

if __name__ == "__main__":
    # See test_socket.py beside this file: the checkout, not the package folder, goes on sys.path.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.path.insert(0, os.path.dirname(here))

    from model_parallel.cli.common import run_cli
    from model_parallel.cli.worker import main

    run_cli(main)
