"""Any value a node produces crosses a stage boundary exactly: a module's tuple (nn.MultiheadAttention),
a dict, a ModelOutput, small Python values - flattened to tensors plus a JSON structure, rebuilt on the
other side, with every gradient flowing back through the container."""
from __future__ import annotations

import collections
import copy
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import model_parallel  # noqa: F401  (installs the torchvision repair: transformers imports below)
from model_parallel.codegen.naming import original_state_from_stage
from model_parallel.errors import PlanError, ProtocolError
from model_parallel.graph.arguments import OutputDict
from model_parallel.runtime.config import TrainConfig
from model_parallel.runtime.launch import free_port, launch
from model_parallel.runtime.step.output import float_output
from model_parallel.runtime.trainer import SingleProcessRunner, single_process_reference
from model_parallel.runtime.wire import comm
from model_parallel.runtime.wire.structure import cross, flatten, flatten_values, make_header, unflatten
from support import TESTS
from support import boundary_models as bm

STEPS = 3
CONFIG = TrainConfig(batch_size=bm.BATCH, num_microbatches=2)


def _sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ---- (a) the structure: pure ---------------------------------------------------------------------
def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a is b
    if type(a) is not type(b) and not (isinstance(a, tuple) and isinstance(b, tuple)):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # nan


def test_nested_values_round_trip_through_json() -> None:
    t = [torch.randn(2, 3), torch.arange(4), torch.ones(1, dtype=torch.bfloat16)]
    Pair = collections.namedtuple("Pair", "left right")
    value = [(t[0], None, 3, [t[1], {"a": t[2], 7: 2.5}]), OutputDict(logits=t[0], loss=None),
             torch.Size([4, 5]), torch.float16, torch.device("cpu"), float("inf"), float("nan"), "name", True,
             torch.max(torch.tensor([[1.0, 3.0]]), 1), Pair(1, t[1]), ()]
    leaves, structure = flatten(value, "x")
    assert [id(v) for v in leaves] == [id(t[0]), id(t[1]), id(t[2]), id(t[0]), *[id(v) for v in value[9]], id(t[1])]
    wire = json.loads(json.dumps(structure))  # pure JSON
    rebuilt = unflatten(leaves, wire)
    assert _same(rebuilt[:9], value[:9])
    assert isinstance(rebuilt[1], OutputDict) and rebuilt[1].logits is t[0]
    assert type(rebuilt[9]) is torch.return_types.max and rebuilt[9].indices is value[9].indices
    assert rebuilt[10].right is t[1] and rebuilt[10][0] == 1 and rebuilt[11] == ()
    # A message's list: leaves numbered across values; what single-process mode passes on.
    leaves, structure = flatten_values([t[0], (t[1], t[2])], ["a", "b"])
    assert leaves == [t[0], t[1], t[2]] and structure == {"list": [{"leaf": 0}, {"tuple": [{"leaf": 1}, {"leaf": 2}]}]}
    assert _same(cross([t[0], (t[1], t[2])], ["a", "b"]), [t[0], (t[1], t[2])])


def test_the_receiver_shortcuts_only_a_flat_list_of_leaves_in_order() -> None:
    """StepExecutor skips the structure walk for the usual boundary ([t0, t1, ...]); anything else,
    a bool index included, goes through `unflatten` (and its checks) every time."""
    from types import SimpleNamespace

    from model_parallel.runtime.step.executor import StepExecutor, _is_flat

    leaves = [torch.zeros(1), torch.ones(2)]
    flat = {"list": [{"leaf": 0}, {"leaf": 1}]}
    assert _is_flat(flat, 2) and not _is_flat(flat, 3)
    for other in ({"list": [{"leaf": 1}, {"leaf": 0}]}, {"list": [{"leaf": 0}, {"leaf": True}]},
                  {"tuple": [{"leaf": 0}, {"leaf": 1}]}, {"list": [{"leaf": 0}, {"tuple": [{"leaf": 1}]}]}):
        assert not _is_flat(other, 2), other
    executor = SimpleNamespace(_flat_trees={}, device=torch.device("cpu"))
    for _ in range(2):  # the first call verifies, the second takes the shortcut: same result
        got = StepExecutor._unflatten(executor, leaves, flat)
        assert isinstance(got, list) and len(got) == 2 and got[0] is leaves[0] and got[1] is leaves[1]
    assert list(executor._flat_trees.values()) == [flat]
    nested = {"list": [{"tuple": [{"leaf": 0}, {"leaf": 1}]}]}
    for _ in range(2):
        got = StepExecutor._unflatten(executor, leaves, nested)
        assert isinstance(got[0], tuple) and got[0][1] is leaves[1]
    with pytest.raises(ProtocolError, match="leaf index"):
        StepExecutor._unflatten(executor, leaves, {"list": [{"leaf": 0}, {"leaf": 0}]})


def test_a_hugging_face_model_output_arrives_as_an_output_dict() -> None:
    import transformers

    out = transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.ones(2), hidden_states=None)
    leaves, structure = flatten(out)
    rebuilt = unflatten(leaves, structure)
    assert structure == {"record": [["last_hidden_state", {"leaf": 0}]]}
    assert isinstance(rebuilt, OutputDict) and rebuilt.last_hidden_state is leaves[0] and rebuilt[0] is leaves[0]


@pytest.mark.parametrize("structure, match", [
    ({"pickle": "os.system"}, "unknown kind 'pickle'"),
    ({"leaf": 1}, "leaf index must be an unused int in 0..0"),
    ({"tuple": [{"leaf": 0}, {"leaf": 0}]}, "leaf index must be an unused int"),
    ({"tuple": []}, "1 of 1 tensors are not placed"),
    ({"dtype": "load"}, "not a torch dtype"),
    ({"return_type": "Tensor", "items": []}, "unknown torch.return_types member"),
    ({"namedtuple": [["__class__", {"leaf": 0}]]}, "distinct public identifiers"),
    ({"dict": [[[1], {"leaf": 0}]]}, "keys of type str/int"),
    ({"value": {"leaf": 0}}, "a value is None, bool, int"),
    ({"leaf": 0, "tuple": []}, "unexpected keys"),
    ([{"leaf": 0}], "expected an object with one kind"),
])
def test_a_structure_from_the_wire_is_refused_unless_it_is_one_of_the_known_kinds(structure: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        unflatten([torch.zeros(1)], structure)


def test_deep_nesting_is_refused() -> None:
    structure: object = {"leaf": 0}
    for _ in range(100):
        structure = {"list": [structure]}
    with pytest.raises(ProtocolError, match="nested deeper than 64"):
        unflatten([torch.zeros(1)], structure)


def test_an_unsupported_value_names_its_type_its_node_and_the_remedy() -> None:
    with pytest.raises(PlanError, match=r"boundary value 'attn'\[1\]\['cache'\] is a builtins.object, which cannot "
                                        r"cross a stage boundary \(allowed: tensors.*move the cut so that node 'attn'"):
        flatten_values([torch.ones(1), (torch.ones(1), {"cache": object()})], ["x", "attn"])
    with pytest.raises(PlanError, match=r"'d' is a dict with a key of type tuple"):
        flatten({(1, 2): torch.ones(1)}, "d")


def test_comm_headers_carry_the_structure_after_the_flat_values() -> None:
    header = make_header([torch.zeros(2, requires_grad=True)], {"tuple": [{"leaf": 0}]})
    assert header[-1] == {"t": "structure", "v": {"tuple": [{"leaf": 0}]}}
    with pytest.raises(comm.PeerError, match=r"nested inside a tuple or list as one message value: flatten"):
        make_header([(torch.zeros(2, 3),)])


# ---- (b) a 2-rank gloo world: the tuple and the dict cross between ranks ---------------------------------
_WORKER = r'''
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from support import boundary_models as bm
from model_parallel.graph.loader import allow_model
from model_parallel.runtime.config import RunOptions, TrainConfig
from model_parallel.runtime.engine import PipelineEngine

torch.set_num_threads(1)
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
model = bm.build()
graph, plan = bm.traced_job(model)
allow_model(model)
for schedule in ("1f1b", "gpipe"):
    model = bm.build()
    engine = PipelineEngine(graph=graph, plan=plan, model=model, criterion=bm.criterion,
                            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                            dataset=bm.TupleData(), config=TrainConfig(batch_size=bm.BATCH, num_microbatches=2,
                                                                       schedule=schedule),
                            options=RunOptions(timeout=60))
    engine.train(int(sys.argv[5]))
    state = {k: v.tolist() for k, v in engine.named_state().items()}
    with open(f"{out}/{schedule}-rank{rank}.json", "w") as f:
        json.dump(state, f)
dist.barrier()
dist.destroy_process_group()
'''


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(initial, trained) parameters of single-process training, by the original model's names."""
    model = bm.build()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    single_process_reference(model, bm.criterion, _sgd, bm.TupleData(), CONFIG, STEPS)
    return initial, {k: v.detach() for k, v in model.named_parameters()}


def _check(got: dict[str, torch.Tensor], what: str) -> None:
    initial, want = _reference()
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {key}: {m}")
        # Stage 0's parameters learn only through the tuple and dict sent back: none was dropped.
        assert not torch.equal(got[key], initial[key]), f"{what}: {key} never received a gradient"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tuple_and_a_dict_cross_between_ranks_and_training_matches_single_process(tmp_path: Path) -> None:
    graph, plan = bm.traced_job(bm.build())
    assert plan.stages[0].node_ids[-2:] == ("attn", "pair")  # the cut falls between the modules and their getitems
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port, tests = free_port(), str(TESTS)  # the worker imports `support`
    result = launch([[sys.executable, str(script), str(rank), str(port), str(tmp_path), tests, str(STEPS)]
                     for rank in range(2)], timeout=240)
    assert result.ok, result.summary()
    for schedule in ("1f1b", "gpipe"):
        got: dict[str, torch.Tensor] = {}
        for rank in range(2):
            got.update({k: torch.tensor(v) for k, v in json.loads((tmp_path / f"{schedule}-rank{rank}.json").read_text()).items()})
        _check(original_state_from_stage(graph, got), f"{schedule} on 2 ranks")


# ---- (c) single-process mode, the same split ------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_single_process_mode_runs_the_same_split(schedule: str) -> None:
    model = bm.build()
    graph, plan = bm.traced_job(model)
    config = TrainConfig(batch_size=bm.BATCH, num_microbatches=2, schedule=schedule)
    runner = SingleProcessRunner(graph, plan, model, bm.criterion, _sgd, bm.TupleData(), config)
    runner.train(STEPS)
    got = {k: v.detach() for k, v in model.named_parameters()}  # the stages share its layers
    if schedule == "1f1b":
        _check(got, "single-process mode")
    else:  # PipeDream updates per microbatch on stashed weights: no flush oracle, but every parameter learns
        initial, _ = _reference()
        assert all(not torch.equal(got[k], initial[k]) for k in initial)


def test_a_bf16_model_output_in_a_dict_becomes_float32_wherever_it_sits() -> None:
    out = OutputDict(logits=torch.ones(2, dtype=torch.bfloat16), extra=(torch.zeros(1, dtype=torch.bfloat16), 3),
                     ids=torch.arange(2))
    got = float_output(out)
    assert isinstance(got, OutputDict) and got.logits.dtype == got.extra[0].dtype == torch.float32
    assert got.extra[1] == 3 and got.ids.dtype == torch.int64  # was AttributeError: 'OutputDict' has no .float()


def test_bf16_crossing_rounds_float32_values_and_their_gradients_like_the_wire() -> None:
    # What a bf16 pipeline does at a cut (comm.py: float32 travels as bf16, widened back; its gradient
    # likewise), single-process mode does with `cross`: the oracle and the pipeline round alike.
    x = torch.tensor([1.0 + 2.0 ** -10, 3.0], requires_grad=True)  # 1 + 2^-10 is not a bf16 value
    half = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.arange(2)
    ((y, (h, i)),) = cross([(x * 1.0, (half * 1.0, ids))], ["out"], torch.bfloat16)
    assert y.dtype == torch.float32 and torch.equal(y.detach(), torch.tensor([1.0, 3.0]))
    assert h.dtype == torch.bfloat16 and i is ids  # already bf16 / not floating point: as they are
    y.backward(torch.tensor([1.0 + 2.0 ** -10, 1.0]))
    assert torch.equal(x.grad, torch.tensor([1.0, 1.0]))  # the gradient crossed back rounded too
    exact, = cross([x * 1.0], ["out"])
    assert torch.equal(exact.detach(), x.detach())  # without a wire dtype nothing changes


# ---- (d) Hugging Face GPT-2 cut inside a block, where `split`'s list crosses ------------------------------------
class _Tokens:
    batch_size = 4

    def batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        return {"input_ids": torch.randint(0, 100, (4, 8), generator=gen)}, torch.randint(0, 100, (4, 8), generator=gen)


def _lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def test_gpt2_cut_inside_an_attention_block_trains_like_the_model() -> None:
    import transformers

    from model_parallel.graph.plan import plan_from_graph
    from model_parallel.profiler.api import profile

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=False)).train()
    reference = copy.deepcopy(model)
    example = {"input_ids": _Tokens().batch(0)[0]["input_ids"][:2]}
    graph = profile(model, example, lambda out: out.logits.float().mean(), warmup=0, iterations=1,
                    subtract_overhead=False)
    order = graph.topological_order
    cut = next(i for i, n in enumerate(order) if graph[n].layer.target == "torch.ops.aten.split.Tensor")
    plan = plan_from_graph(graph.with_stages({n: int(i > cut) for i, n in enumerate(order)}))
    config = TrainConfig(batch_size=4, num_microbatches=2)
    runner = SingleProcessRunner(graph, plan, model, _lm_loss, _sgd, _Tokens(), config)
    assert order[cut] in runner.stages[0].output_names  # `split`'s list of q, k, v crosses the boundary
    bf16 = SingleProcessRunner(graph, plan, copy.deepcopy(model), _lm_loss, _sgd, _Tokens(), replace(config, bf16=True))
    got = [r.loss for r in runner.train(2)]
    want = single_process_reference(reference, _lm_loss, _sgd, _Tokens(), config, 2)
    assert got == pytest.approx(want, rel=1e-5)
    trained = dict(model.named_parameters())
    for name, value in reference.named_parameters():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # bf16 autocast: the output is an OutputDict of bf16 logits, made float32 for the loss (was AttributeError)
    assert bf16.train_step(0).loss == pytest.approx(want[0], rel=0.02)
