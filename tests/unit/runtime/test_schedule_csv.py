"""torch's schedule CSV: ours written and read back, torch's own orders read and checked by our rules, refusals."""
from __future__ import annotations

import csv
import io
import re
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from model_parallel.cli import schedule as schedule_cli
from model_parallel.errors import ScheduleError
from model_parallel.runtime.step.schedule import gpipe, make_schedule, one_f_one_b
from model_parallel.runtime.step.schedule_csv import parse_torch_csv, read_torch_csv, torch_csv_text, write_torch_csv


def _torch_csv(order: dict) -> str:
    """What torch's `_dump_csv` writes for a pipeline order (one row per rank, `str(action)` per cell)."""
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in sorted(order):
        writer.writerow(["" if a is None else str(a) for a in order[rank]])
    return out.getvalue()


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (4, 8)])
def test_ours_round_trip(name, p, m, tmp_path):
    ours = make_schedule(name, p, m)
    path = write_torch_csv(ours, tmp_path / "s.csv")
    back = read_torch_csv(path)
    assert back.grid == ours.grid and back.num_microbatches == m and back.flush


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_torch_gpipe_order_reads_as_ours(p, m):
    # torch's own schedule IR for its single-stage GPipe (REDUCE_GRAD cells included), read through our rules.
    order = torch_schedules.ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
    text = _torch_csv(order)
    assert "REDUCE_GRAD" in text
    read, expected = parse_torch_csv(text), gpipe(p, m)
    assert [read.stage_actions(s) for s in range(p)] == [expected.stage_actions(s) for s in range(p)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_torch_1f1b_order_is_checked(p, m):
    # torch 2.13's IR of Schedule1F1B (what its CSV dump shows; execution takes another path) numbers the last
    # rank's forwards from 1 (1F1..1F4 for m=4): our rules refuse it at that cell; every other rank equals ours.
    order = torch_schedules.Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
    with pytest.raises(ScheduleError, match=f":{p}: {p - 1}F1 is stage {p - 1}'s forward number 0; expected {p - 1}F0"):
        parse_torch_csv(_torch_csv(order))
    expected = one_f_one_b(p, m)
    for rank in range(p - 1):
        assert [a for a in map(str, filter(None, order[rank])) if "REDUCE" not in a] == list(map(str, expected.stage_actions(rank)))


def test_torch_parses_what_we_write():
    for row in csv.reader(io.StringIO(torch_csv_text(one_f_one_b(4, 8)))):
        for cell in row:
            action = torch_schedules._Action.from_str(cell)
            assert cell == "" and action is None or str(action) == cell


@pytest.mark.parametrize("text,words", [
    ("0F0,0W0,0I0\n", "t.csv:1: cell 2: 0W0 runs before 0I0 (cell 3), which it waits for: a weight gradient comes "
                      "after its own input gradient (I, then W)"),
    ("0F0,0B0\n0F1\n", "rank 1 runs stage 0, which rank 0 runs"),
    ("0F0,0B0\n2F0,2B0\n", "no row runs stage(s) [1]"),
    ("0F0,0SEND_F0,0B0\n", "compute_comms"),
    ("0F0,hello,0B0\n", "not an action"),
    ("0F0,0F" + "9" * 5000 + "\n", "not an action"),
    ("0B0,0F0\n", "t.csv:1: cell 1: 0B0 runs before 0F0 (cell 2), which it waits for: a backward (B or I) comes "
                  "after its own forward"),
    ("0F0,0F2,0B0,0B2\n", "t.csv:1: 0F2 is stage 0's forward number 1; expected 0F1"),
    ("0F0,0B0\n1B0,1F0\n", "t.csv:2: cell 1: 1B0 runs before 1F0 (cell 2)"),
    ("0F0,1F0,1B0,0B0\n", None),  # one rank running both stages in a valid order
    ("0F0,0F1,,0B0,0B1\n1F0,1F1,1B1,1B0\n", "t.csv:2: 1B1 is stage 1's backward number 0; expected 1B0"),
    ("\n\n", "no actions"),
    # A blank line between two ranks was read as a rank running nothing: 3 ranks, stage 1 on rank 2, bubble 56 %.
    ("0F0,0F1,,0B0,0B1\n\n,1F0,1F1,1B0,1B1\n", "t.csv:2: line 2 holds no action, so rank 1 would run no stage"),
    ("\n0F0,0B0\n", "t.csv:1: line 1 holds no action"),
    ("0F0,0B0\n0REDUCE_GRAD\n1F0,1B0\n", "t.csv:2: line 2 holds no action"),
    ("0F0,0B0\n\n\n", None),  # trailing blank lines are no ranks
])
def test_refusals_name_the_cause(text, words):
    if words is None:
        parse_torch_csv(text, where="t.csv")
        return
    with pytest.raises(ScheduleError, match=re.escape(words)):
        parse_torch_csv(text, where="t.csv")


@pytest.mark.parametrize("text, words", [
    # QA D4: "per-stage orders deadlock: waiting actions ['0B0', '1F1']", no line, no cell, no hint.
    ("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n",
     "deadlock.csv:1: the rows deadlock, none can run its next action: line 1, cell 2: 0B0 waits for 1B0 (line 2, "
     "cell 3), which line 2 runs only after 1F1 (cell 2); line 2, cell 2: 1F1 waits for 0F1 (line 1, cell 3), which "
     "line 1 runs only after 0B0 (cell 2): lines 1 and 2 wait on each other; reorder one of them"),
    # Three rows in a circle (the idle cells count: cells are the file's columns).
    ("0F0,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n,,2F0,2F1,2B0,2B1\n",
     "deadlock.csv:1: the rows deadlock, none can run its next action: line 1, cell 3: 0B0 waits for 1B0 (line 2, "
     "cell 3), itself waiting; line 2, cell 3: 1B0 waits for 2B0 (line 3, cell 5), which line 3 runs only after 2F1 "
     "(cell 4); line 3, cell 4: 2F1 waits for 1F1 (line 2, cell 4), which line 2 runs only after 1B0 (cell 3): "
     "lines 2 and 3 wait on each other"),
    # QA D4: a W before its own I was "deadlock: waiting actions ['0W0']", not the rule.
    ("0F0,0F1,0W0,0I0,0B1\n,1F0,1B0,1F1,1B1\n",
     "deadlock.csv:1: cell 3: 0W0 runs before 0I0 (cell 4), which it waits for: a weight gradient comes after its "
     "own input gradient (I, then W)"),
    # QA D4: a duplicated cell was told "expected 0B2", a microbatch that does not exist at m = 2.
    ("0F0,0F1,0B0,0B1,0B1\n,1F0,1B0,1F1,1B1\n", "deadlock.csv:1: 0B1 appears twice on line 1 (cells 4 and 5): delete one"),
    ("0F0,0F0,0B0\n", "deadlock.csv:1: 0F0 appears twice on line 1 (cells 1 and 2): delete one"),
    ("0F0,0I0,0W0,0B0\n", "deadlock.csv:1: cell 4: 0B0 runs the input gradient of stage 0, microbatch 0 again, after "
                          "0I0 (cell 2): a backward is B, or I then W: delete one"),
])
def test_a_bad_order_names_its_line_cell_and_rule(text, words):
    with pytest.raises(ScheduleError, match="^" + re.escape(words)):
        parse_torch_csv(text, where="deadlock.csv")


def test_a_missing_backward_is_named():
    with pytest.raises(ScheduleError, match=":1: 0B1 never runs"):
        parse_torch_csv("0F0,0F1,0B0\n")


def test_command_line(tmp_path, capsys):
    out = tmp_path / "1f1b.csv"
    assert schedule_cli.main(["1f1b", "-p", "2", "-m", "3", "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bubble 25.0 %" in printed and "in flight per stage: [2, 1]" in printed
    assert schedule_cli.main([str(out)]) == 0
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0\n1F0\n")
    with pytest.raises(ScheduleError, match="bad.csv"):
        schedule_cli.main([str(bad)])


def test_the_check_reads_each_row_once():
    # A row of n cells, each its own stage, was filtered once per stage and phase: n^2 work (a 0.8 MB row of
    # 100k cells ran for minutes). Counted, not timed: how often the check walks the row.
    from model_parallel.runtime.step.actions import Action
    from model_parallel.runtime.step.schedule_csv import _check_orders

    class Row(list):
        walks = 0

        def __iter__(self):
            Row.walks += 1
            return super().__iter__()

    n = 300
    row = Row(Action(s, "F", 0) for s in range(n))
    with pytest.raises(ScheduleError, match=r"<csv>:1: 0B0 never runs"):
        _check_orders([row], (tuple(range(n)),), 1, "<csv>")
    assert Row.walks <= 2


@pytest.mark.parametrize("text, where", [("0F0,\"" + "x" * 200_000 + "\"\n", r"<csv>:1: not a schedule CSV row \(field larger"),
                                         ("0F0,0B0\n1F0,\"" + "y" * 200_000 + "\"\n", r"<csv>:2: not a schedule CSV row")])
def test_a_field_over_the_csv_limit_is_a_schedule_error_naming_the_line(text, where):
    with pytest.raises(ScheduleError, match=where):
        parse_torch_csv(text)


def test_more_actions_than_any_pipeline_runs_are_refused_at_the_row(monkeypatch):
    # ~12 us an action to check: a 16 MiB file of 4M short cells ran for minutes. The cap is lowered here so the
    # test reads a few rows; the refusal names the row where the count went over.
    from model_parallel.runtime.step import schedule_csv

    monkeypatch.setattr(schedule_csv, "MAX_ACTIONS", 5)
    assert parse_torch_csv("0F0,0B0\n").num_microbatches == 1  # under the cap: read as before
    with pytest.raises(ScheduleError, match=r"<csv>:3: more than 5 actions by this row; .*\(fewer microbatches"):
        parse_torch_csv("0F0,1F0\n0F1,1F1\n0B0,1B0\n")
