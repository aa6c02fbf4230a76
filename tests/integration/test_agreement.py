"""Ranks holding different jobs are refused at activation, naming the ranks and what differs
(runtime/wire/agreement.py): before, a rank with another plan or batch size could train silently; and ranks whose
stage times differ (zero bubble's order is list-built from them: runtime/step/list_order.py), or whose copies of the
data differ (stage 0's inputs were paired with other samples' targets on the last stage, exit 0)."""
from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import free_port, launch
from model_parallel.runtime.wire.agreement import config_digest, graph_digest, plan_digest

RANK = """
import os, sys, datetime, torch, torch.distributed as dist
from model_parallel.errors import PlanError
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.config import RunOptions, TrainConfig
from model_parallel.runtime.engine import PipelineEngine
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe
rank, port, differ = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
r = recipe("mlp")
graph, _ = trace_model(r.model(0), r.example(2))
plan = even_plan(graph, 2)
if rank == 1 and differ == "plan":  # one layer moved: the messages could still fit
    first, second = plan.stages
    plan = type(plan)(stages=(type(first)(0, first.node_ids[:-1], ranks=(0,)),
                              type(second)(1, (first.node_ids[-1],) + second.node_ids, ranks=(1,))))
batch = 16 if rank == 1 and differ == "config" else 8
schedule = "zbh1" if differ in ("times", "none") else "1f1b"  # zero bubble: its order is built from stage times
if differ == "times":  # each rank would build another order: the messages would not match
    from dataclasses import replace
    plan = replace(plan, extra={"stage_times": [[1.0, 1.0, 1.0], [2.0 if rank == 1 else 1.0, 1.0, 1.0]]})
data = r.data(batch, 0)
from model_parallel.runtime.data.sources import as_source
if differ == "data":  # each rank reads its own copy: rank 1's holds other samples under the same name
    from torch.utils.data import TensorDataset
    from model_parallel.runtime.data.sources import as_source
    g = torch.Generator().manual_seed(rank)
    (x,) = r.example(64)
    data = as_source(TensorDataset(torch.randn(x.shape, generator=g), torch.randint(0, 10, (64,), generator=g)), batch, 0)
if differ == "batch_object":  # a user's batch(step) object: rank 1's copy draws from another seed
    class Steps:
        def batch(self, step):
            g = torch.Generator().manual_seed(1000 * (rank + 1) + step)
            return (torch.randn(batch, *r.example(1)[0].shape[1:], generator=g),), torch.randint(0, 10, (batch,), generator=g)
    data = as_source(Steps(), batch, 0)
if differ == "iterable":  # an IterableDataset: rank 1's stream holds other samples
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(rank)
            for _ in range(64):
                yield torch.randn(r.example(1)[0].shape[1:], generator=g), int(torch.randint(0, 10, (), generator=g))
    data = as_source(Stream(), batch, 0)
eval_data = None
if differ == "eval_data":  # the validation data's copies differ, the training data's agree
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(rank)
    (x,) = r.example(16)
    eval_data = as_source(TensorDataset(torch.randn(x.shape, generator=g), torch.randint(0, 10, (16,), generator=g)), batch, 0)
try:
    engine = PipelineEngine(graph=graph, plan=plan, model=r.model(0), criterion=r.criterion,
                            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1), dataset=data,
                            config=TrainConfig(batch_size=batch, num_microbatches=2, schedule=schedule),
                            options=RunOptions(timeout=60, progress=False), eval_dataset=eval_data)
    engine.train(2)
except PlanError as error:
    print("REFUSED", error, flush=True)
    os._exit(3)  # as the worker CLI leaves: no interpreter teardown under live gloo threads (exit -6)
print("TRAINED", flush=True)
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.parametrize("differ", ["plan", "config", "times", "data", "batch_object", "iterable", "eval_data", "none"])
def test_ranks_with_different_jobs_are_refused_naming_what_differs(differ: str) -> None:
    port = free_port()
    result = launch([[sys.executable, "-c", RANK, str(rank), str(port), differ] for rank in range(2)], timeout=120)
    outputs = [result.output(rank) for rank in range(2)]
    if differ == "none":
        assert result.ok and all("TRAINED" in out for out in outputs), result.summary()
        return
    assert all(worker.returncode == 3 for worker in result.workers), result.summary()
    for out in outputs:
        data = "data (its contents: a token file's size and sampled blocks"
        part = {"times": "stage times (the profile's or the plan's stage_times", "data": data, "batch_object": data,
                "iterable": data, "eval_data": f"validation {data}"}.get(differ, f"{differ} than rank 0")
        assert f"rank(s) [1] hold another {part}" in out, out
        assert "TRAINED" not in out


def test_digests_see_structure_and_config_but_not_timings() -> None:
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    retimed = replace(graph, nodes=tuple(replace(n, forward_ms=n.forward_ms + 1.0) for n in graph.nodes))
    assert graph_digest(retimed) == graph_digest(graph)
    renamed = {graph.nodes[-1].node_id: "renamed"}
    other = replace(graph, nodes=graph.nodes[:-1] + (replace(graph.nodes[-1], node_id="renamed"),),
                    edges=tuple(tuple(renamed.get(end, end) for end in edge) for edge in graph.edges))
    assert graph_digest(other) != graph_digest(graph)
    plan = even_plan(graph, 2)
    assert plan_digest(plan) == plan_digest(even_plan(graph, 2)) != plan_digest(replace(plan, version=1))
    assert config_digest(TrainConfig()) != config_digest(TrainConfig(seed=1))
