"""A profile whose own samples disagree (layers vs step, or a wide step spread) warns and names the fix."""
from model_parallel.profiler.image_classification.classifier import profile_disagreement


def test_the_seeds_numbers_warn_with_the_fix():
    warnings = profile_disagreement(3510.0, [452.0, 1689.0, 1689.0, 6559.0], "wall", None)
    assert len(warnings) == 2
    assert "sum of layers 3510 ms, measured step 1689 ms (ratio 2.078, outside 0.9-1.1)" in warnings[0]
    assert "spread 452-6559 ms" in warnings[1]
    assert all("--clock cpu" in w and "--threads N" in w for w in warnings)


def test_an_agreeing_profile_is_quiet():
    assert profile_disagreement(100.0, [98.0, 100.0, 104.0], "wall", 2) == []
    cpu = profile_disagreement(50.0, [100.0, 100.0], "cpu", 2)
    assert len(cpu) == 1 and "--clock cpu" not in cpu[0] and "now 2" in cpu[0]
