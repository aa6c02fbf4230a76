"""The search layers, opt-in: exact plans where PipeDream's antichain DP is out of reach (`searched_partition`).

- `bounded.py` (with `bounds.py`, `cells.py`, `relaxation.py`; numpy): the exact optimum over PipeDream's
  antichains and every topological prefix, bounded by a known plan's time, or a proven lower bound.
- `flat_search.py` (with `flattened.py`, `flat_kernel.py`, `inner_rows.py`): plans with unreplicated
  outermost stages where even that does not fit, and on three levels their proof of optimality. Its
  loops are compiled by numba when installed (`pip install 'model_parallel[search]'`, `jit.py`); without
  it they run as plain Python, so the search runs this part only on small problems.
- `auto.py`: the order `cuts="auto"` tries them in.

Nothing in the package imports this one (the runtime and the rebalancer use `optimizer/contiguous.py`,
`partition` the core alone); the optimizer command opts in with `--search`. Its budgets count states and
array elements (`tuning.Tuning`), never seconds, so its plans do not depend on the machine's load either.
What each layer gains, measured, is in docs/optimizer.md.
"""
from __future__ import annotations

from typing import Optional

from model_parallel.graph.core import Graph
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import Plan
from model_parallel.optimizer.antichains import Antichains, finish_antichains
from model_parallel.optimizer.options import PartitionOptions
from model_parallel.optimizer.partition import partition
from model_parallel.optimizer.search.auto import search_auto
from model_parallel.optimizer.search.bounded import solve_antichains
from model_parallel.optimizer.solve import Solution
from model_parallel.optimizer.states import Workload


def search_solver(work: Workload, hierarchy: Hierarchy, options: PartitionOptions, affordable: int, small: Optional[Antichains]) -> Solution:
    """`cuts="auto"` with the search: PipeDream's DP bounded by a quick plan (the same optimum and plan,
    faster) when its antichains are few, else the bounded solves and the flattened search (`auto.py`)."""
    if small is not None:
        return solve_antichains(work, finish_antichains(work, small), hierarchy, options)
    return search_auto(work, hierarchy, options, affordable)


def searched_partition(graph: Graph, hierarchy: Hierarchy, options: PartitionOptions = PartitionOptions()) -> Plan:
    """`partition` with the search layers: proves the optimum on graphs such as inception_v3."""
    return partition(graph, hierarchy, options, search=search_solver)
