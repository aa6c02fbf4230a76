"""The optimizer's core in a fresh interpreter where numba cannot load: the PipeDream vectors with and without the search."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model_parallel.graph.io import load_graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from support import REPO, TESTS


# Runs in a fresh interpreter where `import numba` fails, as after `pip install -e .` without the
# [search] extra: the package imports, PipeDream's 11 vectors reproduce with and without the search
# layers, numba is never loaded, and the flattened search's loops still run as plain Python.
NO_NUMBA = r"""
import importlib.abc, json, math, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numba", "llvmlite"):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocker())
sys.path[:0] = [sys.argv[1], sys.argv[2], sys.argv[4]]  # the package, test_optimizer's folder, tests/ (support)
import model_parallel
from model_parallel.graph.io import load_graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.search import searched_partition
from test_optimizer import VECTORS

got = []
for name, machines, bandwidths, flags, expected in VECTORS:
    flags = dict(flags)
    hierarchy = Hierarchy.from_lists(machines, bandwidths, flags.pop("memory", 16e9))
    graph = load_graph(f"{sys.argv[3]}/{name}.graph.txt")
    for solver in (searched_partition, partition):
        plan = solver(graph, hierarchy, PartitionOptions(activation_compression_ratio=1.0, **flags))
        got.append([plan.time_per_minibatch_s, expected])

from model_parallel.optimizer import synthetic
from model_parallel.optimizer.search import jit
from model_parallel.optimizer.search.flattened import flat_plan_cuts, flat_states
from model_parallel.optimizer.states import cut_costs, preprocess, prefix_states

work = preprocess(synthetic.chain(6))
hierarchy = Hierarchy.from_lists([2, 2, 2], [4e10, 1e10, 1.25e9])
time_s = float(sum(work.compute_s))
states = flat_states(cut_costs(work, list(prefix_states(work).members)), hierarchy, time_s)
cuts = flat_plan_cuts(states, hierarchy, PartitionOptions(activation_compression_ratio=1.0), time_s)
print(json.dumps({"vectors": got, "numba_loaded": "numba" in sys.modules, "jit": jit.AVAILABLE, "flat_cuts": cuts}))
"""


@pytest.mark.slow
def test_everything_but_the_search_extra_works_without_numba(reference_profiles):
    done = subprocess.run(
        [sys.executable, "-c", NO_NUMBA, str(REPO), str(TESTS / "unit" / "optimizer"), str(reference_profiles), str(TESTS)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["numba_loaded"] is False and result["jit"] is False
    assert len(result["vectors"]) == 22
    for time_s, expected in result["vectors"]:
        assert time_s == pytest.approx(expected, rel=1e-12)
    assert result["flat_cuts"]  # the plain-Python pass found a plan


@pytest.mark.slow
def test_importing_the_package_does_not_load_numba():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, model_parallel.optimizer.partition, model_parallel.runtime.build.stages; print('numba' in sys.modules)"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"
