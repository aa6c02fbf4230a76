"""The demo report's memory table: its peak column says it is the GPU allocator's (n/a on the CPU, where the run
records none; it was labelled cuda_max_allocated above a column of n/a), and its header names the row and the
stages the row holds once each (it read "stage stage")."""
from __future__ import annotations

from model_parallel.cli.report import peak_source
from model_parallel.runtime.observe.memory_table import Measured, format_memory


def test_the_peak_column_is_named_for_where_the_run_ran():
    assert peak_source([Measured(0, 1e6, 2e6, 3e6, None), Measured(1)]) == "GPU only: n/a on CPU"
    assert peak_source([Measured(0, 1e6, 2e6, 3e6, 5e6), Measured(1)]) == "cuda_max_allocated"


def test_the_header_names_the_row_then_its_stages():
    parts = [{"total": 4e6, "parameters": 1e6, "optimizer_state": 1e6, "activations": 2e6, "weight_stash": 0.0}]
    table = format_memory(parts, [("0", Measured(0, 2e6, 2e6, 1e6, None))], "stage", "GPU only: n/a on CPU")
    header, _, row = table.splitlines()[:3]
    assert header.split()[:2] == ["stage", "stages"] and header.endswith("peak MB (GPU only: n/a on CPU)")
    assert row.split()[:3] == ["0", "0", "4.000"]
