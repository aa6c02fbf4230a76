"""The one update step (runtime/step/update.py): lr schedule, clipping by global norm, step, zero_grad."""
from __future__ import annotations

import copy

import pytest
import torch

from model_parallel.errors import ConfigError
from model_parallel.runtime.step.update import apply_update, clip_coefficient, lr_factor, set_lr, squared_grad_norm


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    loss = model(torch.randn(4, 5)).pow(2).sum() * 10  # gradients well above the clip norms below
    loss.backward()
    return model


def _twins(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    a = _model_with_grads(seed)
    b = copy.deepcopy(a)
    for p, q in zip(a.parameters(), b.parameters()):
        q.grad = p.grad.clone()  # deepcopy leaves gradients behind
    return a, b


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_lr_factor_values():
    assert lr_factor("constant", 99) == 1.0
    assert lr_factor("cosine:4", 2) == pytest.approx(0.5) and lr_factor("cosine:4", 9) == pytest.approx(0.0)
    assert [lr_factor("warmup:3", s) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert [lr_factor("step:2:0.1", s) for s in (0, 1, 2, 4)] == pytest.approx([1.0, 1.0, 0.1, 0.01])


@pytest.mark.parametrize("spec", ["cosine:0", "warmup:x", "step:2", "linear"])
def test_a_bad_lr_schedule_is_a_config_error(spec):
    with pytest.raises(ConfigError, match=f"bad --lr_schedule '{spec}'; use constant"):
        lr_factor(spec, 0)


def test_set_lr_scales_every_group_from_its_initial_lr():
    w1, w2 = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([{"params": [w1], "lr": 0.4}, {"params": [w2], "lr": 0.2}])
    assert set_lr(optimizer, "warmup:4", 0) == pytest.approx(0.1)
    assert set_lr(optimizer, "warmup:4", 1) == pytest.approx(0.2)  # from the initial 0.4, not the 0.1 of step 0
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.2, 0.1])
    assert [g["initial_lr"] for g in optimizer.param_groups] == [0.4, 0.2]


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping, and a norm already below the limit
def test_clipping_equals_torch_clip_grad_norm(max_norm):
    ours, theirs = _twins()
    norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    assert squared_grad_norm(ours.parameters()) ** 0.5 == pytest.approx(float(norm), rel=1e-6)
    torch.optim.SGD(theirs.parameters(), lr=0.1).step()
    apply_update(torch.optim.SGD(ours.parameters(), lr=0.1), 0, clip_grad=max_norm)
    _assert_same_params(ours, theirs)
    assert all(p.grad is None for p in ours.parameters())  # zero_grad(set_to_none=True)


def test_a_given_global_norm_sets_the_clip_coefficient():
    # The pipeline clips each stage's gradients by the norm over all stages (all-reduced).
    ours, theirs = _twins()
    apply_update(torch.optim.SGD(ours.parameters(), lr=1.0), 0, clip_grad=1.0, total_norm=50.0)
    coef = clip_coefficient(50.0, 1.0)
    with torch.no_grad():
        for p in theirs.parameters():
            p -= p.grad * coef
    _assert_same_params(ours, theirs)


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
                                  lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1)], ids=["sgd", "adamw"])
def test_one_update_equals_the_plain_optimizer_step(make):
    ours, theirs = _twins()
    lr = apply_update(make(list(ours.parameters())), 0, lr_schedule="constant")
    plain = make(list(theirs.parameters()))
    plain.step()
    assert lr == plain.param_groups[0]["lr"]
    _assert_same_params(ours, theirs)


def test_the_update_uses_the_step_learning_rate():
    ours, theirs = _twins()
    lr = apply_update(torch.optim.SGD(ours.parameters(), lr=0.1), 3, lr_schedule="step:2:0.5")
    assert lr == pytest.approx(0.05)
    torch.optim.SGD(theirs.parameters(), lr=0.05).step()
    _assert_same_params(ours, theirs)


def test_no_gradients_no_norm():
    assert squared_grad_norm([torch.nn.Parameter(torch.ones(2))]) == 0.0


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("warmup, total", [(3, 10), (0, 5), (4, 4)])
def test_warmup_then_decay_equals_transformers_schedules(kind, warmup, total):
    """linear:W:T and cosine:W:T are transformers' get_linear/cosine_schedule_with_warmup(opt, W, T), stepped once per
    update (before, a port of them had no spec, and a scheduler built in the factory was overwritten: below)."""
    import transformers

    make = {"linear": transformers.get_linear_schedule_with_warmup, "cosine": transformers.get_cosine_schedule_with_warmup}
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5)
    scheduler = make[kind](theirs, warmup, total)
    ours = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5)
    for step in range(total + 1):
        assert set_lr(ours, f"{kind}:{warmup}:{total}", step) == pytest.approx(theirs.param_groups[0]["lr"], abs=1e-12)
        theirs.step()
        scheduler.step()
    assert lr_factor(f"{kind}:{warmup}:{total}", total + 5) == 0.0  # past T: 0 (transformers' cosine would rise again)


@pytest.mark.parametrize("spec", ["linear:5:3", "cosine:-1:4", "linear:0:0", "cosine:1:2:3"])
def test_a_bad_warmup_then_decay_is_a_config_error(spec):
    with pytest.raises(ConfigError, match="linear:<warmup>:<total>"):
        lr_factor(spec, 0)


def test_a_torch_lr_scheduler_built_in_the_factory_is_refused_naming_the_spec():
    """Before, set_lr rewrote every group's lr from the scheduler's own `initial_lr` each step: a port that built
    get_linear_schedule_with_warmup in its factory (and stepped it after each train(1)) trained at the peak lr
    throughout, without a word."""
    model = _model_with_grads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step / 4)
    with pytest.raises(ConfigError, match="linear:W:T"):
        apply_update(optimizer, 0)
    assert all(p.grad is not None for p in model.parameters())  # refused before any update
