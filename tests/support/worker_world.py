"""The start of a test world's rank script (`python tests/support/X_worker.py RANK WORLD PORT OUT`): one thread, the
gloo world joined on localhost under a 120 s timeout."""
from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist


def join(argv: Sequence[str]) -> tuple[int, int, Path]:
    """Join the world `argv` (RANK WORLD PORT OUT ...) names; (rank, world size, output directory)."""
    rank, world, port, out = int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    return rank, world, out
