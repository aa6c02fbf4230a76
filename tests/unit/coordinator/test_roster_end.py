"""How the coordinator judges a run whose workers all left (`Roster.done` and its `stop_reason`, which the command
line turns into its exit code: 1 with a reason, 0 without). Under `--recover` a survivor says bye "recovering: ..."
and, when it cannot recover (no committed checkpoint, too few survivors), exits 3 without another word: the
coordinator gave those ranks up after the grace period and exited 0, as if every step had run."""
from model_parallel.coordinator.status import UNREACHABLE_GRACE_S, Roster, WorkerState


def roster(statuses: list[str]) -> Roster:
    r = Roster(len(statuses))
    r.workers = {k: WorkerState(rank=k, host="h", pid=k, world_size=len(statuses), last_seen=0.0)
                 for k in range(len(statuses))}
    for k, status in enumerate(statuses):
        r.workers[k].status = status
    return r


def test_survivors_that_never_came_back_from_a_recovery_are_a_failed_run() -> None:
    r = roster(["running", "running", "running"])
    r.bye(r.workers[0], "recovering: [rank 0 stage 0] rank 1 stopped responding")
    r.bye(r.workers[2], "recovering: [rank 2 stage 2] rank 1 stopped responding")
    r.unreachable(r.workers[1], "its control connection closed without a goodbye")
    assert not r.done(now=1.0) and r.stop_reason is None  # within the grace: they may still register again
    assert r.done(now=UNREACHABLE_GRACE_S + 1.0)
    assert r.stop_reason is not None
    assert r.stop_reason.startswith("rank 0: recovering: [rank 0 stage 0] rank 1 stopped responding"), r.stop_reason
    assert "rank(s) 0 (recovering), 1 (unreachable), 2 (recovering) never came back" in r.stop_reason, r.stop_reason
    assert "no worker finished training" in r.stop_reason, r.stop_reason


def test_every_worker_killed_without_a_word_is_a_failed_run() -> None:
    r = roster(["unreachable", "unreachable"])
    assert r.done(now=UNREACHABLE_GRACE_S + 1.0)
    assert r.stop_reason is not None and "no worker finished training" in r.stop_reason, r.stop_reason


def test_a_finished_run_stays_a_success() -> None:
    r = roster(["running", "running"])
    r.bye(r.workers[0], "training finished")
    r.bye(r.workers[1], "training finished")
    assert r.done(now=1.0) and r.stop_reason is None
    # A control connection that never came back while the others finished: the data plane ran every step.
    r = roster(["finished", "unreachable"])
    assert r.done(now=UNREACHABLE_GRACE_S + 1.0) and r.stop_reason is None


def test_a_rank_left_recovering_while_the_others_finished_is_a_failed_run() -> None:
    r = roster(["finished", "recovering"])
    r.workers[1].note = "recovering: rank 0 stopped responding"
    assert r.done(now=UNREACHABLE_GRACE_S + 1.0)
    assert r.stop_reason is not None and "not every worker finished training" in r.stop_reason, r.stop_reason


def test_a_recovery_is_waited_for_as_long_as_the_workers_timeout_allows() -> None:
    """A survivor may wait JOIN_TIMEOUTS (3) x its --timeout for the membership, then restore: with --timeout 60 that
    is minutes, and a coordinator that gave it up after 60 s exited 1 while the recovered job trained on."""
    from model_parallel.coordinator.status import RECOVERY_TIMEOUTS

    r = roster(["running", "running"])
    for worker in r.workers.values():
        worker.peer_timeout = 60.0
    r.bye(r.workers[0], "recovering: [rank 0 stage 0] rank 1 stopped responding")
    r.unreachable(r.workers[1], "its control connection closed without a goodbye")
    assert not r.done(now=UNREACHABLE_GRACE_S + 1.0)  # rank 0 may still come back
    assert r.done(now=RECOVERY_TIMEOUTS * 60.0 + 1.0)
    assert r.stop_reason is not None and f"never came back within {RECOVERY_TIMEOUTS * 60.0:.0f} s" in r.stop_reason
