"""cli/recover_sources.py without processes: the rule every survivor applies to choose where the lost stage
comes from (a live replica or the committed checkpoint), and the recovery line that names it."""
from __future__ import annotations

from typing import Any, Optional

from model_parallel.cli.recover_sources import decide
from model_parallel.cli.worker_recover import RecoveryRecord

# A world of 3: stage 0 on ranks 0 and 1 (replicated), stage 1 on rank 2.
STAGE_RANKS = [[0, 1], [2]]


def state(of: int, stages: list[int], step: int = 4, version: int = 0, stage_ranks: Any = None) -> dict[str, Any]:
    return {"of": of, "rank": of, "stages": stages, "step": step, "version": version,
            "stage_ranks": stage_ranks or STAGE_RANKS}


def post(*states: dict[str, Any], why: str = "", commit: bool = True) -> dict[str, Any]:
    return {"holdings": list(states), "why": why, "commit": commit}


def test_a_replicated_stage_that_lost_a_replica_comes_back_from_the_other() -> None:
    decision = decide({0: post(state(0, [0])), 2: post(state(2, [1]))}, (0, 1, 2), (1,), latest=3)
    assert decision == {"kind": "replica", "step": 4, "text": "the replica of stage 0 on original rank 0", "why": "",
                        "writers": [[0, 0, 0], [2, 2, 2]], "committer": 0}


def test_the_lowest_surviving_holder_writes_a_stage() -> None:
    ranks = [[1, 3, 0], [2]]
    posts = {1: post(state(1, [0], stage_ranks=ranks)), 2: post(state(2, [1], stage_ranks=ranks)),
             3: post(state(3, [0], stage_ranks=ranks))}
    decision = decide(posts, (0, 1, 2, 3), (0,), latest=None)
    assert decision["kind"] == "replica" and decision["writers"] == [[1, 1, 1], [2, 2, 2]]
    assert decision["text"] == "the replica of stage 0 on original rank 1"


def test_an_unreplicated_stage_that_was_lost_falls_back_to_the_checkpoint() -> None:
    decision = decide({0: post(state(0, [0])), 1: post(state(1, [0]))}, (0, 1, 2), (2,), latest=3)
    assert (decision["kind"], decision["step"], decision["text"]) == ("checkpoint", 3, "checkpoint step 3")
    assert decision["why"] == ("stage(s) [1] had no state of step 4 outside the lost original rank(s) [2] (no replica, "
                               "no --redundancy copy)")


def test_a_redundancy_copy_stands_in_for_the_lost_rank() -> None:
    ranks = [[0], [1], [2]]  # rank 1's buddy is rank 2: it holds rank 1's snapshot
    posts = {0: post(state(0, [0], 5, stage_ranks=ranks), state(0, [0], 4, stage_ranks=ranks)),
             2: post(state(2, [2], 5, stage_ranks=ranks), state(1, [1], 5, stage_ranks=ranks))}
    decision = decide(posts, (0, 1, 2), (1,), latest=3)
    assert decision == {"kind": "redundancy", "step": 5, "why": "", "committer": 0,
                        "text": "the redundancy copy of original rank 1's stage 1 on original rank 2",
                        "writers": [[0, 0, 0], [2, 1, 1], [2, 2, 2]]}


def test_a_copy_that_lags_a_snapshot_behind_gives_the_step_before() -> None:
    ranks = [[0], [1], [2]]
    posts = {0: post(state(0, [0], 5, stage_ranks=ranks), state(0, [0], 4, stage_ranks=ranks)),
             2: post(state(2, [2], 5, stage_ranks=ranks), state(2, [2], 4, stage_ranks=ranks),
                     state(1, [1], 4, stage_ranks=ranks))}
    decision = decide(posts, (0, 1, 2), (1,), latest=3)
    assert (decision["kind"], decision["step"]) == ("redundancy", 4)
    assert decide(posts, (0, 1, 2), (1,), latest=4)["kind"] == "checkpoint"  # nothing newer than the checkpoint


def test_survivors_at_different_steps_use_the_newest_step_every_stage_has() -> None:
    posts = {0: post(state(0, [0], step=4)), 2: post(state(2, [1], step=5))}
    decision = decide(posts, (0, 1, 2), (1,), latest=3)
    assert decision["kind"] == "checkpoint" and decision["why"].startswith("stage(s) [0] had no state of step 5")


def test_a_survivor_without_a_live_state_or_a_post_falls_back() -> None:
    missing: dict[int, Optional[dict[str, Any]]] = {0: post(state(0, [0])), 2: None}
    assert decide(missing, (0, 1, 2), (1,), 3)["why"].startswith("stage(s) [1] had no state of step 4")
    assert decide({0: None, 2: None}, (0, 1, 2), (1,), 3)["why"] == ("original rank 0 posted no live state in time; "
                                                                     "original rank 2 posted no live state in time")
    broken = {0: post(state(0, [0])), 2: post(why="a plan switch was under way")}
    assert decide(broken, (0, 1, 2), (1,), None)["why"].startswith("stage(s) [1] had no state of step 4")
    assert decide({0: post(why="no step had been completed")}, (0, 1), (1,), None) == {
        "kind": "checkpoint", "step": None, "text": "", "why": "original rank 0: no step had been completed",
        "writers": [], "committer": None}
    switched = {0: post(state(0, [0], version=1)), 2: post(state(2, [1], version=2))}
    assert decide(switched, (0, 1, 2), (1,), 3)["why"] == ("the states of step 4 belong to different plans (a plan "
                                                           "switch was under way)")
    assert decide({0: post(state(0, [0]), commit=False), 2: post(state(2, [1]), commit=False)}, (0, 1, 2), (1,),
                  3)["why"] == "no survivor holding a state of step 4 can commit it"


def test_a_checkpoint_of_the_live_step_is_used_as_it_is() -> None:
    decision = decide({0: post(state(0, [0])), 2: post(state(2, [1]))}, (0, 1, 2), (1,), latest=4)
    assert decision == {"kind": "checkpoint", "step": 4, "text": "checkpoint step 4", "why": "", "writers": [],
                        "committer": None}


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


def test_a_stage_state_survives_its_bytes() -> None:
    import torch

    from model_parallel.runtime.checkpoint.live import StageState, decode, encode

    sent = StageState(7, 1, (1,), 2, ((0,), (1,)), {"fc.weight": torch.randn(3, 2), "fc.bias": torch.randn(3).bfloat16()},
                      {"bn.num_batches_tracked": torch.tensor(4)}, {"fc.weight": {"momentum_buffer": torch.ones(3, 2), "step": 3}},
                      {"world": {"world_size": 2}, "fingerprint": "ab", "extra": {"next_step": 8}})
    got = decode(encode(sent), "test")
    assert (got.step, got.rank, got.stage_ids, got.plan_version, got.stage_ranks, got.fields) == (
        7, 1, (1,), 2, ((0,), (1,)), sent.fields)
    for name, value in {**sent.params, **sent.buffers}.items():
        mine = got.params.get(name, got.buffers.get(name))
        assert mine is not None and mine.dtype == value.dtype and torch.equal(mine, value), name
    assert got.optimizer["fc.weight"]["step"] == 3 and torch.equal(got.optimizer["fc.weight"]["momentum_buffer"], torch.ones(3, 2))
    assert got.nbytes() == sent.nbytes() == (6 + 6) * 4 + 3 * 2 + 8  # two float32 [3, 2], a bf16 [3], an int64


def test_malformed_state_bytes_are_a_checkpoint_error() -> None:
    import pytest

    from model_parallel.errors import CheckpointError
    from model_parallel.runtime.checkpoint.live import decode

    with pytest.raises(CheckpointError, match="copy: 3 bytes is no stage state"):
        decode(b"abc", "copy")
    header = b'{"step": 1, "scalars": {}, "tensors": [[["params", "w"], "object", [1], 0, 4]]}'
    with pytest.raises(CheckpointError, match=r"copy: tensor \['params', 'w'\] \(object, bytes 0..4\) is malformed"):
        decode(len(header).to_bytes(8, "little") + header + b"\0" * 4, "copy")


def test_redundancy_refuses_what_it_cannot_serve_before_joining() -> None:
    import pytest

    from model_parallel.cli import worker
    from model_parallel.errors import ConfigError

    base = ["--model", "mlp", "--rank", "0", "--world_size", "2", "--checkpoint_dir", "ck", "--redundancy", "1"]
    with pytest.raises(ConfigError, match="--redundancy 1 needs --recover: the copies it keeps only serve a recovery"):
        worker.main(base)
    with pytest.raises(ConfigError, match="--redundancy 1 with --schedule pipedream: that schedule updates after every "
                                          "microbatch"):
        worker.main([*base, "--recover", "--schedule", "pipedream"])
    with pytest.raises(ConfigError, match="--redundancy_every 0: give a number of steps >= 1"):
        worker.main([*base, "--recover", "--redundancy_every", "0"])
