"""The optimizer's budgets count states, array elements and passes, never seconds: the same input gives
the same plan on any machine at any load (a 2 s wall-clock cap once returned inception_v3 unproven
under load and proven on a quiet machine)."""
from __future__ import annotations

import ast
import dataclasses

import pytest

from model_parallel.errors import PlanError
from model_parallel.optimizer.tuning import Tuning
from support import REPO

OPTIMIZER = REPO / "model_parallel" / "optimizer"
# Where the optimizer may read the clock: to report how long a solve took (`Plan.optimizer_seconds`,
# never written to plan.json) and the converter's "wrote ... in N s"; neither decides anything.
CLOCK_ALLOWED = {"partition.py", "convert_graph_to_model.py"}
CLOCKS = {"time", "perf_counter", "monotonic", "process_time", "perf_counter_ns", "monotonic_ns", "time_ns"}


def test_no_tuning_budget_is_in_seconds():
    names = [field.name for field in dataclasses.fields(Tuning)]
    timed = [name for name in names if "second" in name or name.endswith("_s") or "deadline" in name]
    assert not timed, f"Tuning budgets must count states or elements, not seconds: {timed}"
    assert "work_budget" in names and "enumeration_limit" in names  # the real budgets are still there


def test_the_optimizer_never_reads_the_clock_to_decide():
    readers = []
    for path in sorted(OPTIMIZER.rglob("*.py")):
        if path.name in CLOCK_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr in CLOCKS and getattr(node.value, "id", "") == "time":
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module == "time":
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not readers, f"the optimizer reads the clock (plans would depend on load): {readers}"


def _imports(module: str) -> set[str]:
    """The package modules `module` imports anywhere in its file (function bodies too)."""
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = REPO / module.replace(".", "/") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else [a.name for a in getattr(node, "names", [])] if isinstance(node, ast.Import) else []
        for name in names:
            while name.startswith("model_parallel.") and not (REPO / (name.replace(".", "/") + ".py")).exists() \
                    and not (REPO / name.replace(".", "/") / "__init__.py").exists():
                name = name.rsplit(".", 1)[0]
            if name.startswith("model_parallel."):
                found.add(name)
    return found


@pytest.mark.parametrize("entry", ["model_parallel.optimizer.contiguous", "model_parallel.optimizer.partition",
                                   "model_parallel.coordinator.solver", "model_parallel.runtime.build.stages"])
def test_the_core_imports_no_search_layer(entry):
    # The runtime's even split and the live rebalancer use the small contiguous partitioner; `partition`
    # is the core. None of them reaches optimizer/search, even through an import inside a function.
    seen, todo = set(), [entry]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_imports(module) - seen)
    search = sorted(m for m in seen if m.startswith("model_parallel.optimizer.search"))
    assert not search, f"{entry} reaches the opt-in search layers: {search}"


def test_budgets_are_checked():
    with pytest.raises(PlanError, match="below_budgets"):
        Tuning(below_budgets=())
    with pytest.raises(PlanError, match="work_budget"):
        Tuning(work_budget=-1.0)
