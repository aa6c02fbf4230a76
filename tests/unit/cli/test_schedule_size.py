"""`model-parallel schedule NAME -p P -m M` builds, checks and prints the whole grid: `-p 100000 -m 100000` ran on
towards tens of GB with no output. Sizes past the CSV reader's bound are refused before anything is built."""
from __future__ import annotations

import pytest

from model_parallel.cli import schedule as schedule_cli
from model_parallel.errors import ConfigError


@pytest.mark.parametrize("argv", [["1f1b", "-p", "100000", "-m", "100000"], ["zbv", "-p", "1000", "-m", "1000"],
                                  ["interleaved", "-p", "300", "-v", "4", "-m", "300"]])
def test_a_grid_past_the_bound_is_refused_before_it_is_built(argv, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("the grid was built")

    monkeypatch.setattr(schedule_cli, "make_schedule", never)
    monkeypatch.setattr(schedule_cli, "run_schedule", never)
    with pytest.raises(ConfigError, match="more than the 1,000,000 this command checks; give fewer stages or "
                                          "microbatches"):
        schedule_cli.main(argv)
    assert capsys.readouterr().out == ""


def test_a_grid_within_the_bound_still_prints(capsys):
    assert schedule_cli.main(["zbv", "-p", "4", "-m", "8"]) == 0
    assert capsys.readouterr().out.startswith("zbv p=8 ranks=4 m=8")


@pytest.mark.parametrize("times", ["1e308,1e308", "10,2e9", "1,1,1/1,1,1e300"])
def test_times_too_large_to_sum_are_refused(times, capsys):
    # 1e308 ms is finite, but the simulated step sums them to inf: it printed "inf ms, bubble nan %"
    with pytest.raises(ConfigError, match=r"a time above 1e\+09 ms \(11 days\) per microbatch"):
        schedule_cli.main(["1f1b", "-p", "2", "-m", "2", "--times", times])
    assert capsys.readouterr().out == ""
    assert schedule_cli.main(["1f1b", "-p", "2", "-m", "2", "--times", "1e6,2e6"]) == 0
