"""`downsets.enumerate_downsets`: the cuts of PipeDream's antichain states without its walk, the same set.

The search's bounded solves read only these cuts; the walk took ~15 us a state in Python (BERT profiled
in situ: 68,726 states, over a second), the recursion a few hundredths of a second.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from support import TESTS

from model_parallel.errors import InfeasibleError
from model_parallel.graph.io import load_graph
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.antichains import enumerate_antichains
from model_parallel.optimizer.downsets import Downsets, enumerate_downsets
from model_parallel.optimizer.search.bounded import enumerate_or_none
from model_parallel.optimizer.states import preprocess

from support.traced import traced_graph

FIXTURES = TESTS / "fixtures"


@pytest.mark.parametrize("seed", range(12))
def test_same_cuts_as_the_walk_on_small_graphs(seed: int) -> None:
    for graph in (synthetic.random_dag(10 + seed, seed=seed, max_fan_in=3), synthetic.branches(2 + seed % 3, 3, 3, seed=seed),
                  traced_graph(seed)):
        work = preprocess(graph)
        walk = enumerate_antichains(work).downsets()
        found = enumerate_downsets(work).downsets()
        assert len(found) == len(set(found)) == len(set(walk))
        assert set(found) == set(walk)


def test_same_cuts_as_the_walk_on_reference_profiles_and_bert() -> None:
    paths = [FIXTURES / "bert_insitu.graph.txt"] + sorted((FIXTURES / "reference_profiles").glob("*.graph.txt"))
    for path in paths:
        work = preprocess(load_graph(path, use_sidecar=False))
        started = time.process_time()
        found = enumerate_downsets(work, 250_000)
        seconds = time.process_time() - started
        assert set(found.downsets()) == set(enumerate_antichains(work, 250_000).downsets()), path.name
        assert seconds < 1.0, f"{path.name}: {len(found)} cuts took {seconds:.2f} s of CPU"  # the walk: ~1.2 s on BERT


def test_limit_refuses_and_the_search_gets_only_cuts() -> None:
    work = preprocess(load_graph(FIXTURES / "bert_insitu.graph.txt", use_sidecar=False))
    with pytest.raises(InfeasibleError, match="more than 1000 antichain states"):
        enumerate_downsets(work, 1000)
    assert enumerate_or_none(work, 1000) is None
    assert isinstance(enumerate_or_none(work, 250_000), Downsets)
