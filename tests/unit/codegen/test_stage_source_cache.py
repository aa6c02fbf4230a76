"""torch.fx keeps the source of every GraphModule it ever compiled (its loader's cache and linecache, for
tracebacks) for the life of the process; a run rebuilds its stages at every plan switch, recovery and admission, so a
rank's heap grew by every stage's source at every switch (200 switches: 200 cache entries, ~1 KB each on a tiny MLP,
the size of the stage's generated forward on a large model). A stage's entries go with the stage now; a live stage
still has its source for tracebacks."""
import gc
import linecache

import torch
import torch.fx.graph_module as fx_graph_module

from model_parallel.codegen.build import build_stages
from model_parallel.profiler.trace import trace_model
from model_parallel.runtime.build.stages import even_plan
from model_parallel.runtime.build.zoo import recipe


def test_rebuilt_stages_leave_no_source_behind():
    r = recipe("mlp")
    graph, _ = trace_model(r.model(0), r.example(2))
    plan = even_plan(graph, 2)
    build_stages(graph, plan)
    gc.collect()
    before = len(fx_graph_module._loader.eval_cache), len(linecache.cache)
    for _ in range(40):  # what 40 plan switches rebuild
        stages = build_stages(graph, plan)
    key = type(stages[0]).forward.__code__.co_filename
    assert key in fx_graph_module._loader.eval_cache and linecache.getline(key, 1)  # a live stage keeps its source
    assert len(stages[0](torch.randn(4, *r.example(2)[0].shape[1:]))) == 1
    del stages
    gc.collect()
    assert (len(fx_graph_module._loader.eval_cache), len(linecache.cache)) <= before
