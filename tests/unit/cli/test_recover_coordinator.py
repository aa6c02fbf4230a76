"""cli/recover_coordinator.py without processes: the plan version a re-formed world agrees on, and what it knew."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed import HashStore

from model_parallel.cli.recover_coordinator import Recovered, agree_plan_version, known_version
from model_parallel.errors import PeerError


def test_every_member_gets_the_newest_known_version_plus_one() -> None:
    store = HashStore()
    store.set("plan_floor/2", "7")  # original rank 2 knew of plan v7 (rank 0 had admitted a switch to it)
    assert agree_plan_version(store, 0, (0, 2), known=3, timeout=5) == 8
    assert agree_plan_version(store, 2, (0, 2), known=7, timeout=5) == 8  # the same answer on every member


def test_a_member_that_never_publishes_is_a_peer_error_naming_the_wait() -> None:
    with pytest.raises(PeerError, match="original rank 0: the survivors did not agree on the recovered plan's version "
                                        "within 0.2 s"):
        agree_plan_version(HashStore(), 0, (0, 2), known=1, timeout=0.2)


def test_known_version_takes_the_plan_run_a_switch_admitted_and_what_the_coordinator_spent() -> None:
    channel = SimpleNamespace(plan_floor=4, issued=6)
    assert known_version(SimpleNamespace(plan=SimpleNamespace(version=2), channel=channel)) == 6
    wrapped = SimpleNamespace(inner=SimpleNamespace(plan_floor=5, issued=0))  # a static-plan wrapper
    assert known_version(SimpleNamespace(plan=SimpleNamespace(version=2), channel=wrapped)) == 5
    assert known_version(None) == 0
    assert Recovered(1, (0, 2), (1,), 4, 8).membership() == {"members": [0, 2], "lost": [1], "from_step": 4}
