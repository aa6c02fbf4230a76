"""One pipeline worker: `python test_parallel_0.py --rank N --dist_addr <rank-0 address> [options]` (see --help).

The name and flags follow PipeDream's runtime so existing launch scripts keep working; the
implementation lives in `model_parallel.cli.worker`. `torchrun --nproc_per_node=K test_parallel_0.py ...`
works as well.
"""
from model_parallel.cli.common import run_cli
from model_parallel.cli.worker import main

if __name__ == "__main__":
    run_cli(main)
