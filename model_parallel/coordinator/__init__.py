"""The control plane: wire protocol, coordinator server, worker/ctl clients and the rebalancing policy.

Names load on first use: `model-parallel ctl` imports only the client, and the server's policy and
solver (which bring torch through the optimizer) stay unloaded there.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Coordinator": "server", "CoordinatorChannel": "client", "CtlClient": "client", "Decision": "policy",
    "PolicyConfig": "policy", "PolicyState": "policy", "Samples": "policy", "decide": "policy",
    "estimate_speeds": "policy",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
