"""A 2-rank MLP world under a coordinator's auto policy, rank 1 slowed 4x after step 2, on a plan of several stages
per rank: what the live-rebalancing tests of the loop (interleaved) and the V (zbv) share."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from model_parallel.graph.plan import Plan, read_plan
from model_parallel.runtime.checkpoint.store import load_checkpoint
from support.mlp import mlp_job


@dataclass(frozen=True)
class SlowedRun:
    start: Plan  # plan v0, as the workers and the coordinator got it
    checkpoint: Any  # the workers' last checkpoint (its world's plan: the live one)
    coordinator_output: str

    @property
    def live(self) -> dict[str, Any]:
        return self.checkpoint.world["plan"]

    def layers_on(self, rank: int) -> tuple[int, int]:
        """Nodes `rank` held under plan v0 and under the live plan."""
        before = sum(len(s.node_ids) for s in self.start.stages if s.ranks == (rank,))
        return before, sum(len(s["node_ids"]) for s in self.live["stages"] if s["ranks"] == [rank])


def run_slowed(tmp_path: Path, schedule: str, rank_of: Callable[[int], int], steps: int = 40) -> SlowedRun:
    """`--schedule schedule` (served by the coordinator too) on 2 workers with the MLP cut in 4 stages, stage k on `rank_of(k)`; the coordinator's
    auto policy (window 3, cooldown 3, threshold 5 %) sees rank 1 slow down 4x after step 2. Asserts both ended
    cleanly."""
    from model_parallel.coordinator.local import CoordinatorProcess
    from model_parallel.runtime.launch import LocalWorld, worker_commands

    graph, plan = mlp_job(tmp_path, 4)
    start = read_plan(plan)
    start = replace(start, stages=tuple(replace(s, ranks=(rank_of(s.stage_id),)) for s in start.stages))
    plan.write_text(json.dumps(start.to_dict()))
    token = f"{schedule}-rebalance-token"
    with CoordinatorProcess(graph, plan, token, workdir=tmp_path,
                            extra=["--window", "3", "--cooldown-steps", "3", "--threshold", "0.05",
                                   "--schedule", schedule]) as coord:
        args = ["--model", "mlp", "--plan", str(plan), "--schedule", schedule, "--steps", str(steps),
                "--batch_size", "8", "--num_microbatches", "4", "--checkpoint_dir", str(tmp_path / "ck"),
                "--timeout", "30", "--coordinator", coord.address, "--token", token,
                "--slowdown", "4", "--slowdown_rank", "1", "--slowdown_after_step", "2"]
        with LocalWorld(worker_commands(args, 2)) as world:
            result = world.wait(timeout=300)
        assert result.ok, result.summary()
        assert coord.wait(timeout=20) == 0, coord.output()
        out = coord.output()
    return SlowedRun(start, load_checkpoint(tmp_path / "ck"), out)
