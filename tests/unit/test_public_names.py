"""`import model_parallel` exports its public names lazily (model_parallel/__init__.py `_LAZY`): each must resolve,
or a module moved inside the package breaks `from model_parallel import X` only where a user imports it."""
from __future__ import annotations

import model_parallel


def test_every_lazy_public_name_resolves() -> None:
    for name in model_parallel._LAZY:
        assert getattr(model_parallel, name) is not None, name
