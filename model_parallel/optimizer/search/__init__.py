"""The search layers: exact plans where PipeDream's antichain DP is out of reach (`options.search`).

- `bounded.py` (with `bounds.py`, `cells.py`, `relaxation.py`; numpy): the exact optimum over PipeDream's
  antichains and every topological prefix, bounded by a known plan's time, or a proven lower bound.
- `flat_search.py` (with `flattened.py`, `flat_kernel.py`, `inner_rows.py`): plans with unreplicated
  outermost stages where even that does not fit, and on three levels their proof of optimality. Its
  loops are compiled by numba when installed (`pip install 'model_parallel[search]'`, `jit.py`); without
  it they run as plain Python, so `partition` runs this part only on small problems.
- `auto.py`: the order `cuts="auto"` tries them in.

Nothing outside this package needs it: `PartitionOptions(search=False)` solves with PipeDream's DP and
prefix plans alone. What each layer gains, measured, is in docs/optimizer.md.
"""
