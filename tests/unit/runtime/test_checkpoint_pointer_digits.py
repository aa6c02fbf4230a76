"""A `latest` pointer with a step of thousands of digits is refused by name, never
int()'s ValueError (CPython refuses to convert more than 4300 digits)."""
from __future__ import annotations

import pytest

from model_parallel.errors import CheckpointError
from model_parallel.runtime.checkpoint.layout import latest_step


def test_a_pointer_with_thousands_of_digits_is_a_checkpoint_error(tmp_path):
    (tmp_path / "latest").write_text("step_" + "9" * 4080)  # under the pointer's size cap, over int()'s limit
    with pytest.raises(CheckpointError, match=r"latest: expected 'step_<N>'"):
        latest_step(tmp_path)

