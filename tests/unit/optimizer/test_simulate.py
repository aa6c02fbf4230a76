"""The schedule simulator (optimizer/simulate.py): makespans and bubbles with known answers."""
from __future__ import annotations

from typing import NamedTuple

import pytest

from model_parallel.errors import ScheduleError
from model_parallel.optimizer.simulate import StageTimes, simulate
from model_parallel.runtime.step.auto import simulate_schedule
from model_parallel.runtime.step.interleaved import analytic_bubble, interleaved_1f1b
from model_parallel.runtime.step.schedule import make_schedule


class Act(NamedTuple):
    """An action the simulator reads (I and W kinds too, which the runtime's Action does not have yet)."""

    stage: int
    kind: str
    microbatch: int


def even(p: int, forward: float = 1.0, backward: float = 1.0) -> list[StageTimes]:
    return [StageTimes(forward, backward)] * p


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_one_stage_per_rank_at_p4_m4_has_the_textbook_bubble(name: str) -> None:
    result = simulate_schedule(make_schedule(name, 4, 4), even(4))
    assert result.makespan_ms == 14.0  # 2 (m + p - 1)
    assert result.busy_ms == (8.0,) * 4
    assert result.bubbles == pytest.approx([3 / 7] * 4)  # (p-1)/(m+p-1) = 43 %
    assert round(100 * result.bubble) == 43


def test_interleaved_two_stages_per_rank_at_p4_m4_is_27_percent() -> None:
    # Each of a rank's 2 stages holds half its layers: F = B = 0.5 per action.
    result = simulate_schedule(interleaved_1f1b(4, 2, 4), even(8, 0.5, 0.5))
    assert result.makespan_ms == 11.0
    assert result.bubbles == pytest.approx([3 / 11] * 4)
    assert result.bubble == pytest.approx(analytic_bubble(4, 2, 4))  # 27 %


def test_an_unequal_stage_sets_each_ranks_own_bubble() -> None:
    # p=2, m=2, stage 1 twice as slow. s1: F0 1-3, B0 3-5, F1 5-7, B1 7-9; s0: F0 0-1, F1 1-2, B0 5-6, B1 9-10.
    result = simulate_schedule(make_schedule("1f1b", 2, 2), [StageTimes(1, 1), StageTimes(2, 2)])
    assert result.makespan_ms == 10.0
    assert result.busy_ms == (4.0, 8.0)
    assert result.bubbles == pytest.approx([0.6, 0.2])
    assert result.times[(0, "B", 0)] == (5.0, 6.0)


def test_a_transfer_delays_each_crossing_both_ways() -> None:
    # p=2, m=1: F0 0-1, send 0.5, F0' 1.5-2.5, B0' 2.5-3.5, send 0.5, B0 4-5.
    result = simulate_schedule(make_schedule("1f1b", 2, 1), even(2), transfer_ms=0.5)
    assert result.makespan_ms == 5.0
    assert result.times[(1, "F", 0)] == (1.5, 2.5)
    per_edge = simulate_schedule(make_schedule("gpipe", 3, 1), even(3), transfer_ms=[0.0, 2.0])
    assert per_edge.makespan_ms == 6.0 + 2 * 2.0  # only the second edge costs, forward and backward


def test_an_edge_carries_one_message_at_a_time_each_way() -> None:
    # GPipe p=2, m=3, F = B = 1, 2 ms a message: the forwards leave at 1, 2, 3 and arrive at 3, 5, 7 (queued),
    # stage 1 runs F 3-4, 5-6, 7-8 and B 8-9, 9-10, 10-11; the gradients arrive at 11, 13, 15; stage 0's B ends at 16.
    result = simulate_schedule(make_schedule("gpipe", 2, 3), even(2), transfer_ms=2.0)
    assert [result.times[(1, "F", j)][0] for j in range(3)] == [3.0, 5.0, 7.0]
    assert [result.times[(0, "B", j)][0] for j in range(3)] == [11.0, 13.0, 15.0]
    assert result.makespan_ms == 16.0


def test_two_stages_on_one_rank_hand_off_without_a_transfer() -> None:
    rows = [[Act(0, "F", 0), Act(1, "F", 0), Act(1, "B", 0), Act(0, "B", 0)]]
    result = simulate(rows, [0, 0], even(2), transfer_ms=5.0)
    assert result.makespan_ms == 4.0
    assert result.bubbles == (0.0,)


def test_input_and_weight_gradients_split_the_backward() -> None:
    # p=2, m=1, F = I = W = 1: s0 F 0-1; s1 F 1-2, I 2-3, W 3-4; s0 I 3-4 (after s1's I, not its W), W 4-5.
    rows = [[Act(0, "F", 0), Act(0, "I", 0), Act(0, "W", 0)], [Act(1, "F", 0), Act(1, "I", 0), Act(1, "W", 0)]]
    result = simulate(rows, [0, 1], [StageTimes(1, 2, input_ms=1, weight_ms=1)] * 2)
    assert result.times[(0, "I", 0)] == (3.0, 4.0)
    assert result.makespan_ms == 5.0
    assert result.bubbles == pytest.approx([2 / 5, 2 / 5])


def test_bad_inputs_are_refused_with_the_reason() -> None:
    rows = [[Act(0, "F", 0), Act(0, "I", 0)]]
    with pytest.raises(ScheduleError, match=r"stage 0 runs I actions but its times give no I split"):
        simulate(rows, [0], even(1))
    with pytest.raises(ScheduleError, match=r"deadlock: waiting actions \['0B0', '1F0'\]"):
        simulate([[Act(0, "B", 0), Act(0, "F", 0)], [Act(1, "F", 0), Act(1, "B", 0)]], [0, 1], even(2))
    with pytest.raises(ScheduleError, match=r"row 0 runs an action of stage 1, which row 1 holds"):
        simulate([[Act(1, "F", 0)], []], [0, 1], even(2))
    with pytest.raises(ScheduleError, match=r"transfer_ms: give one time >= 0 for every edge \(1\)"):
        simulate([[Act(0, "F", 0)], []], [0, 1], even(2), transfer_ms=[1.0, 2.0])
    with pytest.raises(ScheduleError, match=r"got times for 1 stage\(s\), the schedule has 2"):
        simulate([[], []], [0, 1], even(1))
    with pytest.raises(ScheduleError, match=r"StageTimes.forward_ms must be a finite number of ms >= 0, got -1"):
        StageTimes(-1, 0)


def test_the_schedule_command_simulates_given_times(capsys: pytest.CaptureFixture[str]) -> None:
    from model_parallel.cli import schedule as schedule_cli
    from model_parallel.errors import ConfigError

    assert schedule_cli.main(["1f1b", "-p", "2", "-m", "2", "--times", "1,1/2,2"]) == 0
    assert "simulated: 10.0 ms per step, bubble 40.0 % (per stage: 60.0, 20.0 %)" in capsys.readouterr().out
    assert schedule_cli.main(["interleaved", "-p", "4", "-v", "2", "-m", "4", "--times", "0.5,0.5"]) == 0
    assert "simulated: 11.0 ms per step, bubble 27.3 %" in capsys.readouterr().out
    # F,I,W: the backward split, which zbh1 fills the drain with (p = 4, m = 8: 11 % against 1F1B's 27 %)
    assert schedule_cli.main(["zbh1", "-p", "4", "-m", "8", "--times", "1,1,1"]) == 0
    assert "simulated: 27.0 ms per step, bubble 11.1 %" in capsys.readouterr().out
    assert schedule_cli.main(["1f1b", "-p", "4", "-m", "8", "--times", "1,1,1"]) == 0  # B = I + W = 2
    assert "simulated: 33.0 ms per step, bubble 27.3 %" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"the zbv schedule splits the backward into I and W: give forward,input-grad"):
        schedule_cli.main(["zbv", "-p", "4", "-m", "8", "--times", "1,2"])
    assert capsys.readouterr().out == ""  # refused before anything is printed
    with pytest.raises(ConfigError, match=r"--times '1,2,3,4': give forward,backward \(e.g. 10,20\) or forward,input"):
        schedule_cli.main(["1f1b", "-p", "2", "-m", "2", "--times", "1,2,3,4"])
