"""A worker started with no model (the seed's `--rank N --dist_addr IP`) asks the coordinator for its job:
the graph and plan (vetted by the safe loader like a file on disk) and the training flags a coordinator may
set (`coordinator.jobfiles.SERVED_FLAGS`; the worker's own flags win)."""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from model_parallel.errors import PlanError, ProtocolError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedJob:
    """What the coordinator sent a worker started without a model (`ask_coordinator`)."""

    graph: Any  # graph.core.Graph, checked by the safe loader
    plan: Any  # graph.plan.Plan
    address: str  # the coordinator's HOST:PORT
    token: bytes  # the token that worked


def wants_served_job(args: Any) -> bool:
    """The seed's `--rank N --dist_addr IP` alone: no model on the command line, so the coordinator sends it."""
    return not (args.model or args.package or args.graph or args.jobs or args.single_process)


def fetch_served_job(argv: Sequence[str], args: Any, parser: Any) -> tuple[Any, ServedJob]:
    """Fetch the job from the coordinator; returns the arguments with its training flags (the command line's
    own flags win) and the served graph and plan."""
    from model_parallel.codegen.build import check_layers, ensure_layers
    from model_parallel.coordinator.client import fetch_job
    from model_parallel.coordinator.jobfiles import SERVED_FLAGS, coordinator_address, token_path
    from model_parallel.coordinator.protocol import read_token
    from model_parallel.graph.json_format import graph_from_dict
    from model_parallel.graph.plan import Plan

    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", 0))
    address = coordinator_address(args.coordinator, args.dist_addr or os.environ.get("MASTER_ADDR"))
    if address is None:
        raise PlanError("nothing to train: give --model, --package or --graph, or --dist_addr (the coordinator is "
                        "then asked on that host) or --coordinator HOST:PORT / $MODEL_PARALLEL_COORDINATOR")
    reply, token = fetch_job(address, lambda: read_token(args.token, args.token_file, str(token_path())), rank,
                             args.timeout)
    where = f"the job from the coordinator at {address}"
    graph = graph_from_dict(reply["graph"], source=where)
    check_layers(ensure_layers(graph))  # a file from the network: the same allow-lists as a graph.json on disk
    plan = Plan.from_dict(reply["plan"], source=where)
    served: list[str] = []
    for flag, value in reply["train"].items():
        if flag not in SERVED_FLAGS or isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ProtocolError(f"{where}: training flag {flag!r} = {str(value)[:40]!r} is not one a coordinator may "
                                f"set ({', '.join(SERVED_FLAGS)}); run the same model_parallel version on both sides")
        served += [f"--{flag}", str(value)]

    def refuse(message: str) -> None:
        raise ProtocolError(f"{where}: {message}; fix the coordinator's training flags")

    parser.error = refuse  # type: ignore[method-assign]  # a bad served flag is a typed error, not SystemExit
    merged = parser.parse_args(served + list(argv))  # argparse keeps the last value: the worker's own flags win
    merged.coordinator = address
    if merged.world_size is None and not os.environ.get("WORLD_SIZE"):
        merged.world_size = plan.num_ranks
    logger.info("rank %d got the job from the coordinator at %s: %d stage(s) on %d rank(s)%s", rank, address,
                plan.num_stages, plan.num_ranks, f", flags {' '.join(served)}" if served else "")
    return merged, ServedJob(graph, plan, address, token)
