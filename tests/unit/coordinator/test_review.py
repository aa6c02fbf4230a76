"""Judging a switch: delivered, a miss that teaches the noise level, a change that did not last, not judged."""
import pytest

from model_parallel.coordinator.review import judge, speed_change

EVEN = {0: 1.0, 1: 1.0}
SLOW1 = {0: 1.0, 1: 0.5}


def test_speed_change_is_normalised_by_the_fastest_worker():
    assert speed_change(EVEN, SLOW1) == 1.0
    assert speed_change({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, {0: 1.0, 1: 0.5, 2: 0.5, 3: 1.0}) == 1.0  # half slowed
    assert speed_change(EVEN, {0: 0.5, 1: 0.5}) == 0.0  # everyone alike: calibration, not a change
    assert speed_change(EVEN, {0: 1.0, 1: 1.0, 2: 1.0}) == 1.0  # a rank new to the baseline


def test_a_delivered_switch_forgives_a_miss_and_halves_the_noise():
    review, misses, noise = judge(1, (30.0, 20.0), 21.0, SLOW1, SLOW1, EVEN, 0.5, 1, 0.1)
    assert (review.delivered, review.judged, review.reverted, misses, noise) == (True, True, False, 0, 0.05)


def test_a_shortfall_at_the_solved_for_speeds_is_noise():
    review, misses, noise = judge(1, (20.0, 10.0), 18.0, SLOW1, SLOW1, EVEN, 0.5, 0, 0.0)
    assert (review.delivered, review.judged, review.reverted, misses, noise) == (False, True, False, 1, 0.4)


def test_a_change_that_reverted_teaches_its_whole_gain():
    review, misses, noise = judge(1, (36.0, 21.0), 21.0, EVEN, SLOW1, EVEN, 0.5, 0, 0.1)
    assert (review.delivered, review.judged, review.reverted, misses) == (False, True, True, 1)
    assert noise == pytest.approx(15 / 36)


def test_a_new_change_is_not_judged():
    review, misses, noise = judge(1, (36.0, 21.0), 42.0, {0: 1.0, 1: 0.5, 2: 0.5}, {0: 1.0, 1: 0.5, 2: 1.0},
                                  None, 0.5, 0, 0.0)
    assert (review.judged, misses, noise) == (False, 0, 0.0)
