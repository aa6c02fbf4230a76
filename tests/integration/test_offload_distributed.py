"""Offloaded optimizer state (runtime/step/offload.py) on 2 processes equals single-process training: a tiny GPT-2 with
AdamW and a cosine lr schedule, its state stepped from disk in 20 KB chunks, checkpointed after 3 steps, resumed
(the checkpoint's state loaded into the offload files) and trained to 6 with a live switch that moves a block (its
state read from one rank's files, sent, written into the other's) - parameters and losses as the oracle's; and
straight runs under zbh1, interleaved (two stages per rank), one stage replicated on both ranks and pipedream (an
update per microbatch; against the plain pipedream run only)."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model_parallel import profile
from model_parallel.codegen.naming import original_state_from_stage
from model_parallel.graph.core import Graph
from model_parallel.graph.plan import Plan, StagePlan, plan_from_graph, write_plan
from model_parallel.runtime.launch import free_port, launch
from model_parallel.runtime.trainer import single_process_reference
from support import TESTS
from support import offload_worker as worker
from support.hf_zoo import BATCH, CASES

pytestmark = [pytest.mark.slow]


def _cut_before(graph: Graph, prefix: str) -> Plan:
    """Two stages: stage 1 starts at the first read of a parameter under `prefix`."""
    order = graph.topological_order
    start = next(i for i, n in enumerate(order)
                 if graph[n].layer.op == "get_attr" and graph[n].layer.target.startswith(prefix))
    return plan_from_graph(graph.with_stages({n: int(i >= start) for i, n in enumerate(order)}))


@pytest.mark.timeout(600)
# zbh1, interleaved (two stages per rank) and replicas (one stage on both ranks, gradients all-reduced before the
# chunked update): the offloaded run trains straight (no resume, no switch)
@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "interleaved", "replicas", "pipedream"])
def test_offloaded_adamw_with_checkpoint_resume_and_switch_equals_single_process(tmp_path: Path, schedule: str) -> None:
    case = CASES["gpt2"]
    micro = BATCH // worker.MICROBATCHES
    graph = profile(case.build(), case.example(micro), lambda out: case.loss(out, case.data.batch(0)[1][:micro]),
                    warmup=0, iterations=1)
    plan = _cut_before(graph, "transformer.h.1.")
    if schedule == "replicas":
        plan = Plan((StagePlan(0, graph.topological_order, num_replicas=2, ranks=(0, 1)),))
    write_plan(plan, tmp_path / "plan.json")
    write_plan(replace(_cut_before(graph, "transformer.h.0."), version=1), tmp_path / "switch.json")
    port = free_port()
    result = launch([[sys.executable, str(TESTS / "support" / "offload_worker.py"), str(rank), "2", str(port),
                      str(tmp_path), schedule] for rank in range(2)], timeout=500)
    assert result.ok, result.summary()
    saved = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]

    def merged(run: str) -> dict[str, torch.Tensor]:
        return original_state_from_stage(graph, {k: v for entry in saved for k, v in entry[run]["state"].items()})

    if schedule == "replicas":  # both replicas stepped their own offloaded copy of the state to the same values
        first, second = (entry["offloaded"]["state"] for entry in saved)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    plain, offloaded = merged("plain"), merged("offloaded")
    assert plain.keys() == offloaded.keys() and len(plain) > 10
    for key, value in offloaded.items():  # the offload changes nothing: bit for bit the plain pipeline's values
        assert torch.equal(value, plain[key]), key
    assert [e["offloaded"]["losses"] for e in saved] == [e["plain"]["losses"] for e in saved]
    assert [entry["offloaded"]["plan_version"] for entry in saved] == ([1, 1] if schedule == "1f1b" else [0, 0])
    assert saved[0]["offloaded"]["num_stages"] == {"interleaved": 4, "replicas": 1}.get(schedule, 2)

    if schedule == "pipedream":  # asynchronous (stale weights, an update per microbatch): no synchronous oracle;
        return  # bit for bit the plain pipedream run is the check
    model = case.build()
    want_losses = single_process_reference(model, case.loss, worker.adamw, case.data,
                                           replace(worker.CONFIG, schedule=schedule.replace("replicas", "1f1b")),
                                           worker.STEPS)
    want = model.state_dict()
    for key, value in offloaded.items():
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    assert saved[-1]["offloaded"]["losses"] == pytest.approx(want_losses, rel=1e-5)
    for entry in saved:  # the state lived in files; between steps only the scalars stayed in memory
        run = entry["offloaded"]
        assert run["files"] and run["resident_state_bytes"] == 0
        assert 0 < run["metered_state_bytes"] <= worker.CHUNK_MB * 1e6  # the meter counts the chunk, as resident
