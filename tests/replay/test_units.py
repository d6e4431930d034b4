"""replay/run/units.py: a recorded number that is the replayed one times a recorded factor."""

from forensics.replay.run.units import explaining_factor


def test_the_loss_scale_explains_a_ratio_and_nothing_explains_a_real_difference():
    factors = [("the loss scale", 65536.0), ("the world size", 8.0), ("the gradient-accumulation count", 4.0)]
    unit = explaining_factor(7.288e4, 1.112, factors)
    assert unit is not None and unit.name == "the loss scale" and unit.recorded_larger
    assert "times the loss scale (65536)" in unit.words()
    assert explaining_factor(0.25, 1.0, factors).name == "the gradient-accumulation count"
    assert explaining_factor(3.0, 1.0, factors) is None  # a real difference
    assert explaining_factor(float("nan"), 1.0, factors) is None and explaining_factor(1.0, 0.0, factors) is None
