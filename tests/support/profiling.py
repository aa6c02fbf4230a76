"""What profiling must leave alone in a model: a snapshot of it, and the check that nothing changed."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything profiling must leave alone."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()},
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(after["state"][key], value), f"profiling changed {key}"
    for key, grad in before["grads"].items():
        if grad is None:
            assert after["grads"][key] is None, f"profiling left a gradient on {key}"
        else:
            assert torch.equal(after["grads"][key], grad), f"profiling changed the gradient of {key}"
    assert after["training"] == before["training"]
    assert torch.equal(after["rng"], before["rng"])
