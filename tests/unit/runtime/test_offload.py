"""runtime/step/offload.py: the chunked optimizer step is exact, holds at most a chunk of state, and streams state out and in."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from model_parallel.errors import ConfigError
from model_parallel.runtime.step.offload import attach, offload_of, optimizer_state_items, step_optimizer
from model_parallel.runtime.step.update import apply_update

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 4, bias=False))


def _groups(model: nn.Module) -> list[dict]:
    """Three param groups with their own hyperparameters (the last Linear has no gradient on step 0)."""
    first, second, third = model[0], model[2], model[3]
    return [{"params": list(first.parameters()), "lr": 0.01},
            {"params": list(second.parameters()), "lr": 0.02, "weight_decay": 0.1},
            {"params": list(third.parameters()), "lr": 0.005}]


OPTIMIZERS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01),
    "adam_amsgrad": lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True),
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.01, momentum=0.9, nesterov=True),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=0.01, momentum=0.5),  # not sliceable: measured ratio
}


def _train(kind: str, offload_dir: Path | None, chunk_bytes: int = 0, peak: list[int] | None = None) -> nn.Module:
    model = _model()
    optimizer = OPTIMIZERS[kind](_groups(model))
    if offload_dir is not None:
        attach(optimizer, offload_dir, chunk_bytes)
    if peak is not None:  # the state tensors alive at the end of each inner step (the most a chunk holds)
        def count(opt: torch.optim.Optimizer, *_: object) -> None:
            peak.append(sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0))
        optimizer.register_step_post_hook(count)
    torch.manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(5, 16)
        out = model[2](model[1](model[0](x)))
        loss = out.pow(2).mean() + (model[3](out).sum() if step > 0 else 0.0)
        loss.backward()
        apply_update(optimizer, step, lr_schedule="step:2:0.5")  # the lr schedule changes the groups' lr
    return model



def _step_both_equal(*runs: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    """One more step of each (model, optimizer); the models' parameters stay bitwise equal."""
    for model, optimizer in runs:
        model(torch.ones(3, 16)).sum().backward()
        step_optimizer(optimizer)
    first, *others = runs
    for other, _ in others:
        for p, q in zip(first[0].parameters(), other.parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("chunk_bytes", [200, 1 << 20])  # 200 B: every weight cut in slices (sliceable kinds)
def test_chunked_step_is_bitwise_the_plain_one(tmp_path: Path, kind: str, chunk_bytes: int) -> None:
    plain = _train(kind, None)
    offloaded = _train(kind, tmp_path, chunk_bytes)
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
def test_at_most_a_chunk_of_state_is_alive(tmp_path: Path, kind: str) -> None:
    chunk = 600  # bytes: AdamW's 2 moments of 75 floats, SGD's buffer of 150
    peak: list[int] = []
    _train(kind, tmp_path, chunk, peak)
    assert peak and max(peak) <= chunk
    assert max(peak) >= chunk // 2  # chunks are packed, not one element at a time
    plain_peak: list[int] = []
    _train(kind, None, 0, plain_peak)
    assert max(plain_peak) > 4 * chunk  # the plain optimizer holds all of it (the bound above means something)


def test_state_stays_on_disk_and_streams_out_whole(tmp_path: Path) -> None:
    model = _model()
    reference = _model()
    opt, ref = torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.AdamW(reference.parameters(), lr=0.1)
    offload = attach(opt, tmp_path, 256)
    for m, o in ((model, opt), (reference, ref)):
        m(torch.ones(2, 16)).sum().backward()
        step_optimizer(o)
    assert not any(isinstance(v, torch.Tensor) and v.dim() > 0 for s in opt.state.values() for v in s.values())
    assert list(offload.directory.glob("*.bin")) and offload.directory.parent == tmp_path
    streamed = {id(p): s for p, s in optimizer_state_items(opt)}
    for p, q in zip(model.parameters(), reference.parameters()):
        if q.grad is None:
            continue
        for key, value in ref.state[q].items():
            assert torch.equal(streamed[id(p)][key], value), key
            assert streamed[id(p)][key].shape == value.shape


def test_restored_state_moves_to_disk_and_training_goes_on_exactly(tmp_path: Path) -> None:
    a, b = _model(), _model()
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.1)
    for _ in range(2):
        a(torch.ones(3, 16)).sum().backward()
        opt_a.step()
        opt_a.zero_grad()
    b.load_state_dict(a.state_dict())
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1)
    opt_b.load_state_dict(opt_a.state_dict())
    attach(opt_b, tmp_path, 200)  # the restored state goes to disk, cut in slices
    assert not opt_b.state
    _step_both_equal((a, opt_a), (b, opt_b))


def test_files_go_with_the_optimizer_and_lbfgs_is_refused(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    directory = attach(opt, tmp_path, 1024).directory
    opt.add_param_group({"params": [nn.Parameter(torch.ones(3))], "momentum": 0.0})  # priced when it first steps
    opt.param_groups[-1]["params"][0].grad = torch.ones(3)
    step_optimizer(opt)
    assert offload_of(opt) is not None and directory.is_dir()
    del opt
    import gc

    gc.collect()
    assert not directory.exists()
    with pytest.raises(ConfigError, match="LBFGS"):
        attach(torch.optim.LBFGS(model.parameters()), tmp_path, 1024)


def test_checkpoint_state_by_name_round_trips_through_the_files(tmp_path: Path) -> None:
    from model_parallel.runtime.checkpoint.state import load_optimizer_state_by_name, optimizer_state_by_name

    a, b = _model(), _model()
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.1)
    attach(opt_a, tmp_path / "a", 300)
    a(torch.ones(3, 16)).sum().backward()
    step_optimizer(opt_a)
    opt_a.zero_grad()
    saved = optimizer_state_by_name(opt_a, dict(a.named_parameters()))  # read from disk, slices joined
    assert saved["0.weight"]["exp_avg"].shape == a[0].weight.shape
    b.load_state_dict(a.state_dict())
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1)
    attach(opt_b, tmp_path / "b", 300)
    load_optimizer_state_by_name(opt_b, dict(b.named_parameters()), saved)  # a resume: onto b's files, not its dict
    assert not opt_b.state
    _step_both_equal((a, opt_a), (b, opt_b))


def test_a_torch_lr_scheduler_drives_the_chunked_step(tmp_path: Path) -> None:
    def run(offload: bool) -> nn.Module:
        model = _model()
        optimizer = torch.optim.AdamW(_groups(model), lr=0.01)
        if offload:
            attach(optimizer, tmp_path, 256)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for step in range(3):
            model[2](model[1](model[0](torch.ones(2, 16)))).sum().backward()
            step_optimizer(optimizer)
            optimizer.zero_grad()
            scheduler.step()  # rewrites every group's lr: the chunked step reads it from the same group dicts
        assert [g["lr"] for g in optimizer.param_groups] == [0.01 / 8, 0.02 / 8, 0.005 / 8]
        return model

    for a, b in zip(run(False).parameters(), run(True).parameters()):
        assert torch.equal(a, b)


def test_the_meter_counts_the_chunk_as_what_is_resident(tmp_path: Path) -> None:
    from model_parallel.runtime.observe.memory_probe import state_bytes

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    offload = attach(optimizer, tmp_path, 1000)
    assert state_bytes(model, optimizer)["optimizer_state"] == 0  # before the first update: nothing anywhere
    model(torch.ones(2, 16)).sum().backward()
    step_optimizer(optimizer)
    held = state_bytes(model, optimizer)
    assert held["optimizer_state"] == offload.peak_state_bytes and 0 < held["optimizer_state"] <= 1000
    whole = 2 * held["parameters"]  # AdamW's two moments, as the plain optimizer would hold them
    assert held["optimizer_state"] < whole / 4
