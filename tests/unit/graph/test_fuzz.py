"""Fuzz the readers of every file a user hands us: malformed input is a typed error, never a crash or a hang.

Inputs are random mutations of the PipeDream reference profiles (delete/duplicate/swap lines, corrupt
numbers, add cycle edges, truncate, random bytes) and random text. The contract for each reader:
return a valid object or raise a `ModelParallelError` subclass; nothing else escapes.
Examples are bounded and derandomized so the file runs in seconds and the same way in CI.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_parallel.errors import GraphError, GraphFormatError, ModelParallelError, PlanError
from model_parallel.graph.core import Graph
from model_parallel.graph.json_format import graph_from_dict, graph_to_dict, read_graph_json
from model_parallel.graph.pipedream_format import format_graph_txt, parse_graph_txt, read_graph_txt
from model_parallel.graph.hierarchy import Hierarchy
from model_parallel.graph.plan import Plan, parse_stage_to_num_ranks, plan_from_graph, read_plan
from support import REFERENCE_PROFILES

PROFILES = ("toy_dag", "vgg16", "gnmt", "vgg16_partitioned_3stages", "resnet50")
TEXTS = {name: (REFERENCE_PROFILES / f"{name}.graph.txt").read_text() for name in PROFILES}

# MP_FUZZ_EXAMPLES=5000 runs that many fresh random examples per test (bug hunting); CI uses a fixed set.
DEEP = int(os.environ.get("MP_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=DEEP or 300, deadline=None, derandomize=not DEEP, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# Text that is almost a number, or a number a reader must refuse: each once tripped a parser somewhere.
BAD_NUMBERS = ["", "-1", "-0.0", "nan", "NaN", "inf", "-inf", "1e999", "1e-999", "0x10", "1_000", "abc", "١٢",
               "²", "1,5", "[1; 2]", "[]", "[;]", "[1;", "1]", " ", "9" * 400, "1e308", "+3", "3.", ".5", "\x00"]


def check_reader(read: Callable[[], Any]) -> Any:
    """Call a reader; only a result or a ModelParallelError may come out (hypothesis reports anything else)."""
    try:
        return read()
    except ModelParallelError as error:
        assert str(error), "an error must carry a message"
        return error


# ---- graph.txt ---------------------------------------------------------------------------------------
@st.composite
def mutated_profile(draw: st.DrawFn) -> str:
    text = TEXTS[draw(st.sampled_from(PROFILES))]
    lines = text.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "number", "cycle", "truncate", "insert", "char", "field"]))
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        if kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(draw(st.integers(0, len(lines))), lines[i])
        elif kind == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "number":
            line = lines[i]
            spots = [k for k, c in enumerate(line) if c == "=" and k + 1 < len(line)]
            if spots:
                k = draw(st.sampled_from(spots)) + 1
                end = k
                while end < len(line) and line[end] not in ",]\n" and line[end:end + 4] != " -- ":
                    end += 1
                lines[i] = line[:k] + draw(st.sampled_from(BAD_NUMBERS) | st.text(max_size=8)) + line[end:]
        elif kind == "cycle":
            ids = [ln.split(" -- ")[0] for ln in lines if ln and ln[0] not in " \t"]
            if ids:
                a, b = draw(st.sampled_from(ids)), draw(st.sampled_from(ids))
                lines.append(f"\t{a} -- {b}")
        elif kind == "truncate":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
            lines = lines[: i + 1]
        elif kind == "insert":
            lines.insert(i, draw(st.text(max_size=40)))
        elif kind == "char":
            line = lines[i]
            if line:
                k = draw(st.integers(0, len(line) - 1))
                lines[i] = line[:k] + draw(st.characters()) + line[k + 1:]
        elif kind == "field":
            lines[i] = lines[i].replace(" -- ", draw(st.sampled_from([" --  -- ", " - ", "--", " -- stage_id=-1 -- ", ""])), 1)
    return "\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n", "\n\n"]))


def roundtrip_holds(graph: Graph) -> None:
    again = parse_graph_txt(format_graph_txt(graph))
    assert again.nodes == graph.nodes and again.edges == graph.edges


@pytest.mark.slow
@FUZZ
@given(mutated_profile())
def test_graph_txt_mutations_parse_or_raise_typed_error(text: str) -> None:
    result = check_reader(lambda: parse_graph_txt(text, "fuzz.txt"))
    if isinstance(result, Graph):
        roundtrip_holds(result)
    else:
        assert isinstance(result, (GraphFormatError, GraphError))
        assert "fuzz.txt" in str(result), f"message must name the file: {result}"


@FUZZ
@given(st.lists(st.sampled_from(list("ab01 -=\t\n[];.,e") + [" -- ", "forward_compute_time=", "stage_id=", "Input0"]), max_size=60).map("".join)
       | st.text(max_size=200))
def test_graph_txt_random_text_parses_or_raises(text: str) -> None:
    result = check_reader(lambda: parse_graph_txt(text, "random.txt"))
    if isinstance(result, Graph):
        roundtrip_holds(result)
    else:
        assert "random.txt" in str(result), f"message must name the file: {result}"


@settings(FUZZ, max_examples=60)
@given(st.binary(max_size=300), st.sampled_from(PROFILES), st.integers(0, 2000))
def test_graph_txt_file_with_random_bytes_or_truncated(tmp_path_factory: Any, data: bytes, name: str, cut: int) -> None:
    folder = tmp_path_factory.mktemp("fuzz")
    raw = TEXTS[name].encode()
    for payload in (data, raw[:cut] + data, raw[: len(raw) * cut // 2000]):
        path = folder / "graph.txt"
        path.write_bytes(payload)
        result = check_reader(lambda: read_graph_txt(path))
        assert isinstance(result, Graph) or str(path) in str(result), f"message must name the file: {result}"


def test_graph_txt_cycle_error_names_file_and_line() -> None:
    text = TEXTS["toy_dag"] + "\t1 -- 5\n"  # 5 -> 2 -> 3 -> 1 -> 5
    with pytest.raises(GraphFormatError, match=r"fuzz\.txt:\d+: graph has a cycle"):
        parse_graph_txt(text, "fuzz.txt")


def test_graph_txt_reader_missing_file_is_typed(tmp_path: Path) -> None:
    with pytest.raises(GraphFormatError, match="cannot read graph file"):
        read_graph_txt(tmp_path / "absent.txt")


# ---- graph.json --------------------------------------------------------------------------------------
JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(10**30), 10**400) | st.floats(allow_nan=True, allow_infinity=True)
                | st.text(max_size=6) | st.sampled_from(["Input0", "node1", "float32", "call_module", "placeholder"]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)


@st.composite
def mutated_tree(draw: st.DrawFn, tree: Any) -> Any:
    """Copy `tree` (JSON data) and change 1-4 random places: replace, delete or add a value."""
    tree = json.loads(json.dumps(tree))
    for _ in range(draw(st.integers(1, 4))):
        parent, key = None, None
        node = tree
        # Walk down a random path; stop at a random depth.
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            parent, key = node, draw(st.sampled_from(keys))
            node = node[key]
        if parent is None:
            continue
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[key] = draw(JSON_VALUES)
        elif action == "delete":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = draw(JSON_VALUES)
        else:
            parent.append(draw(JSON_VALUES))
    return tree


def _small_graph_dict() -> dict:
    return graph_to_dict(parse_graph_txt(TEXTS["toy_dag"]))


def _layered_graph_dict() -> dict:
    data = _small_graph_dict()
    data["nodes"][1]["layer"] = {"op": "call_module", "target": "fc", "args": [{"node": "0"}], "kwargs": {},
                                 "module": "torch.nn.Linear(4, 4)", "outputs": [{"shape": [2, 4], "dtype": "float32"}],
                                 "parameters": ["fc.weight", "fc.bias"]}
    data["metadata"] = {"model": "toy", "batch_size": 2}
    return data


@pytest.mark.slow
@FUZZ
@given(st.sampled_from([_small_graph_dict, _layered_graph_dict]).flatmap(lambda make: mutated_tree(make())))
def test_graph_json_mutations_parse_or_raise_typed_error(data: Any) -> None:
    result = check_reader(lambda: graph_from_dict(data, "fuzz.json"))
    if isinstance(result, Graph):
        assert graph_from_dict(graph_to_dict(result)) == result
    else:
        assert isinstance(result, GraphFormatError) and "fuzz.json" in str(result)


@FUZZ
@given(JSON_VALUES)
def test_graph_json_random_values_raise_typed_error(data: Any) -> None:
    check_reader(lambda: graph_from_dict(data))
    check_reader(lambda: graph_from_dict({"schema": "model_parallel.graph", "version": 1, "nodes": data, "edges": data}))


def test_graph_json_file_deeply_nested_or_binary(tmp_path: Path) -> None:
    path = tmp_path / "graph.json"
    for payload in (b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe\x00garbage", b"", b'{"schema": "model_parallel.graph", "version": 1, "nodes": [{"id": "a", "description": "x", "forward_ms": 1, "backward_ms": 1, "activation_size": 1, "parameter_size": 1, "stage_id": Infinity}], "edges": []}'):
        path.write_bytes(payload)
        with pytest.raises(GraphFormatError, match="graph.json"):
            read_graph_json(path)


@pytest.mark.parametrize("payload, message", [
    (b'{"schema": "model_parallel.graph", "version": 1, "nodes": [],\n "edges": ' + b"1" * 5000 + b"}", r"graph\.json:2: an integer of 5000 digits"),
    (b'{"nodes": ' + b"[" * 70 + b"]" * 70 + b"}", r"graph\.json: nested deeper than 64 levels at \.nodes"),
    (b'{"nodes": 1e999}', r"graph\.json:1: the number 1e999 does not fit"),
    (b'{"nodes": NaN}', r"graph\.json:1: NaN is not a number JSON allows"),
], ids=["huge-int", "deep", "overflowing-float", "nan"])
def test_graph_json_file_numbers_and_depth_are_bounded(tmp_path: Path, payload: bytes, message: str) -> None:
    # A 5000-digit integer once escaped as a bare ValueError (CPython's int-to-str limit).
    path = tmp_path / "graph.json"
    path.write_bytes(payload)
    with pytest.raises(GraphFormatError, match=message):
        read_graph_json(path)


def test_graph_json_huge_integer_cost_is_typed() -> None:
    data = _small_graph_dict()
    data["nodes"][0]["forward_ms"] = 10**400  # JSON allows integers that do not fit a float
    with pytest.raises(GraphFormatError, match=r"nodes\[0\]"):
        graph_from_dict(data, "fuzz.json")


# ---- plan.json ---------------------------------------------------------------------------------------
def _plan_dict() -> dict:
    graph = parse_graph_txt(TEXTS["vgg16_partitioned_3stages"])
    return plan_from_graph(graph, {0: 2}).to_dict()


@pytest.mark.slow
@FUZZ
@given(mutated_tree(_plan_dict()))
def test_plan_mutations_parse_or_raise_plan_error(data: Any) -> None:
    result = check_reader(lambda: Plan.from_dict(data, "plan.json"))
    if isinstance(result, Plan):
        assert Plan.from_dict(result.to_dict()) == result
        assert all(r >= 0 for s in result.stages for r in s.ranks)
    else:
        assert isinstance(result, PlanError) and "plan.json" in str(result)


@pytest.mark.slow
@FUZZ
@given(JSON_VALUES)
def test_plan_random_values_raise_plan_error(data: Any) -> None:
    check_reader(lambda: Plan.from_dict(data))
    check_reader(lambda: Plan.from_dict({"schema": "model_parallel.plan", "schema_version": 1, "stages": data}))


def test_plan_reader_on_bytes_and_nesting(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    for payload in (b"\x00\xff", b"{" * 50_000, b"[" * 100_000, b"{}", b'{"version": ' + b"9" * 4500 + b"}"):
        path.write_bytes(payload)
        with pytest.raises(PlanError, match="plan.json"):
            read_plan(path)


def test_plan_negative_rank_is_rejected() -> None:
    data = _plan_dict()
    data["stages"][0]["ranks"] = [-1, 0]
    with pytest.raises(PlanError, match="rank"):
        Plan.from_dict(data, "plan.json")


# ---- --stage_to_num_ranks and the machine hierarchy -------------------------------------------------
@FUZZ
@given(st.text(alphabet=st.sampled_from(list("0123456789:, -²١x")), max_size=20) | st.text(max_size=20))
def test_stage_to_num_ranks_parses_or_raises(text: str) -> None:
    result = check_reader(lambda: parse_stage_to_num_ranks(text))
    if isinstance(result, dict):
        assert result and all(isinstance(k, int) and k >= 0 and isinstance(v, int) and v >= 1 for k, v in result.items())
    else:
        assert isinstance(result, PlanError) and "--stage_to_num_ranks" in str(result)


def test_stage_to_num_ranks_superscript_digit_is_typed() -> None:
    with pytest.raises(PlanError, match="not '<stage>:<replicas>'"):
        parse_stage_to_num_ranks("0:²")


NUMBERS = st.integers(-3, 10**6) | st.floats(allow_nan=True, allow_infinity=True) | st.integers(10**300, 10**400)


@pytest.mark.slow
@FUZZ
@given(st.lists(NUMBERS, max_size=4), st.none() | st.lists(NUMBERS, max_size=4), NUMBERS)
def test_hierarchy_from_lists_builds_or_raises(machines: list, bandwidths: Any, memory: Any) -> None:
    result = check_reader(lambda: Hierarchy.from_lists(machines, bandwidths, memory))
    if isinstance(result, Hierarchy):
        assert result.levels and all(level.num_machines >= 1 for level in result.levels)
        assert all(math.isfinite(level.bandwidth) and level.bandwidth > 0 for level in result.levels)
        assert math.isfinite(result.memory_bytes) and result.memory_bytes > 0
    else:
        assert isinstance(result, PlanError)


def test_hierarchy_rejects_nan_memory() -> None:
    with pytest.raises(PlanError, match="memory"):
        Hierarchy.from_lists([4], None, float("nan"))


# ---- the optimizer on whatever the reader accepts ------------------------------------------------------
COST = st.sampled_from([0.0, 1e-9, 1.0, 3.5, 1e6, 1e15]) | st.floats(0, 1e4)


@st.composite
def random_graph_text(draw: st.DrawFn) -> str:
    """A valid graph.txt of a random DAG: any shape, zero and huge costs, inputs anywhere, list activations."""
    count = draw(st.integers(1, 14))
    lines = []
    for i in range(count):
        description = draw(st.sampled_from(["Input0", "Linear(4, 4)", "Add", "Concat(1)", "__getitem__(0)", "ReLU()"]))
        activation = draw(COST | st.lists(COST, min_size=2, max_size=3).map(lambda xs: "[" + "; ".join(map(str, xs)) + "]"))
        lines.append(f"n{i} -- {description} -- forward_compute_time={draw(COST)}, backward_compute_time={draw(COST)}, "
                     f"activation_size={activation}, parameter_size={draw(COST)}")
    for j in range(1, count):
        for i in sorted(draw(st.sets(st.integers(0, j - 1), max_size=3))):
            lines.append(f"\tn{i} -- n{j}")
    return "\n".join(lines) + "\n"


@settings(FUZZ, max_examples=DEEP or 60)
@given(mutated_profile() | random_graph_text(), st.integers(1, 4), st.booleans())
def test_partition_of_any_parsed_graph_is_a_plan_or_typed_error(text: str, workers: int, straight: bool) -> None:
    from model_parallel.optimizer.options import PartitionOptions
    from model_parallel.optimizer.partition import partition

    graph = check_reader(lambda: parse_graph_txt(text, "fuzz.txt"))
    if not isinstance(graph, Graph) or len(graph) > 120:  # resnet50-sized graphs are the optimizer tests' business
        return
    plan = check_reader(lambda: partition(graph, Hierarchy.from_lists([workers]), PartitionOptions(straight_pipeline=straight)))
    if isinstance(plan, Plan):
        assert sorted(plan.stage_of) == sorted(n.node_id for n in graph.nodes), "the plan must place every node"
        assert plan.num_ranks <= workers


@pytest.mark.parametrize("text", ["0:" + "9" * 5000, "9" * 5000 + ":1", "0:1," + "1" * 4301 + ":2"])
def test_stage_to_num_ranks_with_thousands_of_digits_is_typed(text: str) -> None:
    """int() of more than 4300 digits raises a bare ValueError (a traceback from generate and the worker)."""
    with pytest.raises(PlanError, match=r"--stage_to_num_ranks: .* holds a number of \d+ digits; .* at most 65536"):
        parse_stage_to_num_ranks(text)
