"""cli/recover_sources.py without processes: the rule every survivor applies to choose where the lost stage
comes from (a live replica or the committed checkpoint), and the recovery line that names it."""
from __future__ import annotations

from typing import Any, Optional

from model_parallel.cli.recover_sources import decide
from model_parallel.cli.worker_recover import RecoveryRecord

# A world of 3: stage 0 on ranks 0 and 1 (replicated), stage 1 on rank 2.
STAGE_RANKS = [[0, 1], [2]]


def post(rank: int, stages: list[int], step: int = 4, version: int = 0) -> dict[str, Any]:
    return {"ok": True, "rank": rank, "stages": stages, "step": step, "version": version, "stage_ranks": STAGE_RANKS}


def test_a_replicated_stage_that_lost_a_replica_comes_back_from_the_other() -> None:
    decision = decide({0: post(0, [0]), 2: post(2, [1])}, (0, 1, 2), (1,), latest=3)
    assert decision == {"kind": "replica", "step": 4, "text": "the replica of stage 0 on original rank 0", "why": "",
                        "writers": {"0": 0, "2": 2}}


def test_the_lowest_surviving_holder_writes_a_stage() -> None:
    posts = {1: post(1, [0]), 2: post(2, [1]), 3: post(3, [0])}
    stage_ranks = [[1, 3, 0], [2]]
    posts = {o: {**p, "stage_ranks": stage_ranks} for o, p in posts.items()}
    decision = decide(posts, (0, 1, 2, 3), (0,), latest=None)
    assert decision["kind"] == "replica" and decision["writers"] == {"1": 1, "2": 2}
    assert decision["text"] == "the replica of stage 0 on original rank 1"


def test_an_unreplicated_stage_that_was_lost_falls_back_to_the_checkpoint() -> None:
    decision = decide({0: post(0, [0]), 1: post(1, [0])}, (0, 1, 2), (2,), latest=3)
    assert decision["kind"] == "checkpoint" and decision["step"] is None
    assert decision["why"] == "stage(s) [1] had no copy outside the lost original rank(s) [2] (no replica)"


def test_survivors_at_different_steps_fall_back() -> None:
    decision = decide({0: post(0, [0], step=4), 2: post(2, [1], step=5)}, (0, 1, 2), (1,), latest=3)
    assert decision["kind"] == "checkpoint"
    assert decision["why"] == "the survivors stand at different steps {0: 4, 2: 5} (a failure during an update)"


def test_a_survivor_without_a_live_state_or_a_post_falls_back() -> None:
    missing: dict[int, Optional[dict[str, Any]]] = {0: post(0, [0]), 2: None}
    assert decide(missing, (0, 1, 2), (1,), 3)["why"] == "original rank 2 posted no live state in time"
    broken = {0: post(0, [0]), 2: {"ok": False, "why": "a plan switch was under way"}}
    assert decide(broken, (0, 1, 2), (1,), 3)["why"] == "original rank 2 holds no live state: a plan switch was under way"
    switched = {0: post(0, [0], version=1), 2: post(2, [1], version=2)}
    assert decide(switched, (0, 1, 2), (1,), 3)["why"] == "the survivors ran different plans (a plan switch was under way)"


def test_a_checkpoint_of_the_live_step_is_used_as_it_is() -> None:
    decision = decide({0: post(0, [0]), 2: post(2, [1])}, (0, 1, 2), (1,), latest=4)
    assert decision == {"kind": "checkpoint", "step": 4, "text": "checkpoint step 4", "why": "", "writers": {}}


def test_the_recovery_line_names_the_replica_and_zero_steps_lost() -> None:
    record = RecoveryRecord(me=2, generation=1, lost=(1,), world=(0, 2), store="127.0.0.1:29501", checkpoint_dir="ck",
                            checkpoint_step=4, done_before=5, continued_at=5, seconds=0.5, source_kind="replica",
                            source="the replica of stage 0 on original rank 0")
    assert record.recomputed == 0
    assert ("restored step 4 from the replica of stage 0 on original rank 0 (committed as checkpoint step 4 in ck); "
            "recomputed 0 step(s) (continued at step 5)") in record.line()
    assert RecoveryRecord.from_json(record.to_json()) == record
    fallback = RecoveryRecord(2, 1, (1,), (0, 2), "h:1", "ck", 3, 5, 4, 0.5, why="stage(s) [1] had no copy")
    assert fallback.line().endswith("; no live copy: stage(s) [1] had no copy")
