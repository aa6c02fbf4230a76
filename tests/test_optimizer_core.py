"""The optimizer's core without its optional parts: no numba, no search; and the one contiguous partitioner."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model_parallel.errors import PlanError
from model_parallel.graph.io import load_graph
from model_parallel.graph.plan import Hierarchy
from model_parallel.optimizer import synthetic
from model_parallel.optimizer.contiguous import even_stages, straight_plan
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.runtime.stages import even_plan

REPO = Path(__file__).resolve().parents[1]

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
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import model_parallel
from model_parallel.graph.io import load_graph
from model_parallel.graph.plan import Hierarchy
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from test_optimizer import VECTORS

got = []
for name, machines, bandwidths, flags, expected in VECTORS:
    flags = dict(flags)
    hierarchy = Hierarchy.from_lists(machines, bandwidths, flags.pop("memory", 16e9))
    graph = load_graph(f"{sys.argv[3]}/{name}.graph.txt")
    for search in (True, False):
        plan = partition(graph, hierarchy, PartitionOptions(activation_compression_ratio=1.0, search=search, **flags))
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
        [sys.executable, "-c", NO_NUMBA, str(REPO), str(REPO / "tests"), str(reference_profiles)],
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
        [sys.executable, "-c", "import sys, model_parallel.optimizer.partition, model_parallel.runtime.stages; print('numba' in sys.modules)"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


def test_default_plan_of_vgg16_is_balanced(reference_profiles):
    # The runtime's default plan (no plan given) was 680 / 0 / 7 / 3 ms here: it mixed bytes into the
    # node costs. Priced by time, its slowest stage is within 1.5x of the optimizer's balanced plan.
    graph = load_graph(reference_profiles / "vgg16.graph.txt")
    default = even_plan(graph, 4)
    balanced = partition(graph, Hierarchy.from_lists([4]), PartitionOptions(straight_pipeline=True))
    slowest = max(stage.compute_s for stage in default.stages)
    assert min(stage.compute_s for stage in default.stages) > 0
    assert slowest <= 1.5 * balanced.time_per_minibatch_s
    order = list(graph.topological_order)
    assert [n for stage in default.stages for n in stage.node_ids] == order  # contiguous, in order


def test_straight_plan_puts_stage_k_on_rank_k_and_checks_its_arguments():
    graph = synthetic.chain(6)
    plan = straight_plan(graph, [5, 3], [1.0, 2.0])
    assert [s.ranks for s in plan.stages] == [(5,), (3,)]
    assert plan.stages[0].compute_s <= plan.stages[1].compute_s  # the faster worker takes more
    with pytest.raises(PlanError, match="got 1 speed\\(s\\) for 2 worker"):
        straight_plan(graph, [0, 1], [1.0])
    with pytest.raises(PlanError, match="into 9 stage"):
        straight_plan(graph, range(9))


def test_a_graph_without_timings_or_parameters_splits_evenly_by_node_count():
    # (With parameters, an untimed graph splits by their bytes: tests/test_default_split.py.)
    graph = synthetic.chain(8)
    untimed = type(graph)(tuple(node.__class__(**{**node.__dict__, "forward_ms": 0.0, "backward_ms": 0.0,
                                                   "parameter_size": 0.0}) for node in graph.nodes), graph.edges)
    plan = even_stages(untimed, 4, {1: 2})
    assert [len([n for n in s.node_ids if not untimed[n].is_input]) for s in plan.stages] == [2, 2, 2, 2]
    assert [s.ranks for s in plan.stages] == [(0,), (1, 2), (3,), (4,)]
