"""Tests for replay/judge/history_pattern.py: loss-curve shapes and the field notes' other signals."""

import math
import random

import pytest

from forensics.core.kinds import HistoryPattern
from forensics.replay.judge.history_pattern import classify_history, history_signals

NAN = float("nan")
FIELD_NOTES = {
    "sudden_jump": [1.6, 1.5, 1.4, 87234.5, NAN],
    "exponential_growth": [2.1, 2.3, 2.8, 4.5, 12.3, 89.7, NAN],
    "oscillating_divergence": [2.0, 1.8, 2.2, 1.6, 2.5, 1.4, 3.2, NAN],
}


@pytest.mark.parametrize("pattern", sorted(FIELD_NOTES))
def test_field_notes_examples_exactly(pattern):
    assert classify_history(FIELD_NOTES[pattern]) == pattern


@pytest.mark.parametrize("pattern", sorted(FIELD_NOTES))
def test_noisy_variants_after_a_stable_stretch(pattern):
    rng = random.Random(sorted(FIELD_NOTES).index(pattern))
    for _ in range(200):
        prefix = [2.0 * math.exp(rng.gauss(0, 0.03)) for _ in range(rng.randint(0, 60))]
        noisy = [v * math.exp(rng.gauss(0, 0.03)) if not math.isnan(v) else v for v in FIELD_NOTES[pattern]]
        assert classify_history(prefix + noisy) == pattern, prefix + noisy


def test_stable_then_nan_out_of_nowhere():
    rng = random.Random(7)
    wrong = 0
    for _ in range(500):
        sigma = rng.choice([0.01, 0.05, 0.1])
        losses = [2.0 * math.exp(rng.gauss(0, sigma)) for _ in range(rng.randint(10, 200))] + [NAN]
        wrong += classify_history(losses) != "stable"
    assert wrong <= 2  # pure noise is (almost) never read as a pattern
    decaying = [3 * math.exp(-i / 50) for i in range(200)] + [NAN]
    assert classify_history(decaying) == "stable"
    assert classify_history([2.0] * 30 + [NAN]) == "stable"


def test_sudden_jump_variants():
    assert classify_history([1.6, 1.55, 1.58, 1.5, 1.52, 1.44, 87234.5]) == "sudden_jump"  # noisy, alternating
    assert classify_history([1.4, 1.45, 1.5, 1.55, 87234.5, NAN]) == "sudden_jump"  # slow drift, then jump
    assert classify_history([1.6, 1.5, 1.4, 1.4, 40.0, 41.0, NAN]) == "sudden_jump"  # jump one step back
    assert classify_history([2.0, None, 1.9, 1.8, None, 1.85, 9.5]) == "sudden_jump"  # gaps ignored


def test_exponential_growth_variants():
    assert classify_history([2.1, 2.3, 2.8, 4.5, 4.4, 12.3, 89.7, NAN]) == "exponential_growth"  # one dip
    assert classify_history([2.1, 2.3, 2.8, 4.5, 12.3, 89.7, 1e6]) == "exponential_growth"  # ends in a blow-up
    assert classify_history([1.0, 1.5, 2.25, 3.4, 5.1, 7.6]) == "exponential_growth"  # steady x1.5


def test_negative_losses_use_signed_log():
    assert classify_history([-1.0, -1.1, -0.9, -1.05, -1.0]) == "stable"
    assert classify_history([-1.0, -1.1, -1.05, -1.0, 5e4]) == "sudden_jump"


def test_insufficient_history():
    assert classify_history([]) == "insufficient_history"
    assert classify_history([1.0, 2.0, NAN, None, 3.0]) == "insufficient_history"
    assert classify_history([1.0, float("inf"), 1.1, 1.2, 1.3]) == "stable"
    assert isinstance(classify_history([1.0, 1.1, 1.0, 1.2, 1.1]), HistoryPattern)


def healthy(n=200):
    return {
        "step": list(range(1000, 1000 + n)),
        "loss": [2.0] * n,
        "grad_norm": [1.0] * n,
        "lr": [3e-4] * n,
        "loss_scale": [None] * n,
        "clipped": [False] * n,
        "skipped": [False] * n,
    }


def test_healthy_history_has_no_signals():
    assert history_signals(healthy()) == []
    assert history_signals({}) == []
    assert history_signals({"step": [1], "loss": [None]}) == []


def test_clipping_on_more_than_one_percent_of_steps():
    h = healthy()
    h["clipped"][10] = h["clipped"][50] = True  # 1%: fine
    assert history_signals(h) == []
    h["clipped"][90] = True  # 1.5%
    (signal,) = history_signals(h)
    assert "clipping fired on 3 of 200" in signal


def test_grad_norm_long_below_point_one_and_suddenly_zero():
    h = healthy()
    h["grad_norm"][-25:] = [0.05] * 25
    (signal,) = history_signals(h)
    assert "below 0.1 for the last 25 recorded steps" in signal
    h = healthy()
    h["grad_norm"][-1] = 0.0
    h["grad_norm"][-2] = 0.83
    (signal,) = history_signals(h)
    assert "dropped to exactly 0 at step 1199 (it was 0.83" in signal


def test_fp16_loss_scale_overflows_down_to_the_minimum():
    h = healthy(40)
    h["loss_scale"] = [65536.0] * 20 + [2.0 ** (15 - i) for i in range(20)]  # halves every step
    h["skipped"] = [False] * 20 + [True] * 20
    (signal,) = history_signals(h)
    assert "overflowed on 20 recorded steps" in signal and "6.55e+04 -> 0.0625" in signal
    assert "collapsed to the minimum" in signal
    h = healthy(40)
    h["loss_scale"] = [65536.0] * 35 + [32768.0, 32768.0, 16384.0, 8192.0, 8192.0]
    (signal,) = history_signals(h)
    assert "overflowed on 3 recorded steps" in signal and "minimum" not in signal


def test_diverged_long_ago_only_when_the_run_left_its_first_losses_for_a_while():
    from forensics.replay.judge.history_pattern import diverged_long_ago

    healthy = {
        "step": list(range(40)),
        "loss": [4.0 - 0.02 * i for i in range(39)] + [40.0],
        "summary": {"first_losses": [4.0, 3.98, 3.96]},
    }
    assert diverged_long_ago(healthy, uniform_loss=4.16) is None  # a spike after a healthy run: not diverged
    gone = {
        "step": list(range(40)),
        "loss": [4.0] + [150.0 + (i % 5) * 20 for i in range(38)] + [900.0],
        "summary": {"first_losses": [4.0, 150.0, 170.0]},
    }
    sentence = diverged_long_ago(gone, uniform_loss=4.16)
    assert sentence and "since step 1" in sentence and "uniform guess" in sentence
    assert diverged_long_ago({"step": [1, 2], "loss": [1.0, 2.0]}) is None  # an old dump without a summary


def test_a_sudden_failure_at_the_analysed_step_is_not_told_as_the_loss_leaving_its_start():
    """The history's 'left its start' sentence is about what came before the failure, not the failure itself."""
    from forensics.replay.judge.history_pattern import read_history

    history = {
        "step": list(range(7)),
        "loss": [4.16, 4.18, 4.16, 4.16, 4.17, 4.18, float("nan")],
        "grad_norm": [0.5] * 6 + [float("nan")],
        "lr": [1e-3] * 7,
    }
    reading = read_history(history, 6, uniform_loss=4.16)
    assert reading.onset == 6 and not any("left it" in s for s in reading.sentences)
    gradual = read_history({**history, "loss": [4.16, 4.2, 9.0, 30.0, 90.0, 400.0, float("nan")]}, 6)
    assert any("left it at step 3 (over 3 x its start)" in s for s in gradual.sentences)  # 30 > 3 x 4.16


@pytest.mark.parametrize(
    "lr, words",
    [
        ([1e-4, 2e-4, 3e-4, 6e-4, 5e-4, 4e-4, 3e-4], "falling since step 3 (from 0.0006)"),  # warm-up, then decay
        ([1e-4, 2e-4, 3e-4, 3e-4, 3e-4, 3e-4, 3e-4], "constant since step 2, after rising"),  # warm-up, then flat
        ([1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 6e-4, 7e-4], "still rising (warm-up) from 0.0001 at step 0"),
    ],
)
def test_the_learning_rate_words_follow_the_recorded_schedule(lr, words):
    """'still rising (warm-up)' only while the LR rises at the failure, never for one that fell or stayed flat since
    (issue 31: the demo's schedule had been falling since step 3)."""
    from forensics.replay.judge.history_pattern import read_history

    history = {"step": list(range(7)), "loss": [2.0] * 6 + [float("nan")], "grad_norm": [0.5] * 7, "lr": lr}
    said = " ".join(read_history(history, 6).sentences)
    assert words in said and ("still rising" in said) == ("still rising" in words), said


def test_a_one_step_spike_before_the_failure_is_not_the_loss_leaving_its_start():
    """Issue 42 item 10: a loss that spiked once at step 3 and came back, or a first loss that fell, did not 'leave
    its start'; the history tells only a departure that lasted up to the analysed step."""
    from forensics.replay.judge.history_pattern import read_history

    spiky = {
        "step": list(range(9)),
        "loss": [0.216, 0.165, 0.0287, 40.0, 0.02, 0.016, 0.019, 0.02, 316.0],
        "grad_norm": [0.5] * 9,
        "lr": [1e-3] * 9,
        "summary": {"first_losses": [0.216, 0.165, 0.0287]},
    }
    reading = read_history(spiky, 8)
    assert reading.onset == 8 and not any("left it" in s for s in reading.sentences)
    assert reading.healthy_grad_norm == 0.5
    lasting = {
        **spiky,
        "loss": [0.216, 0.165, 0.0287, 0.02, 0.019, 0.021, 0.5, 0.08, 2.0, 316.0],
        "step": list(range(10)),
        "grad_norm": [0.5] * 10,
        "lr": [1e-3] * 10,
    }
    assert any("left it at step 6" in s for s in read_history(lasting, 9).sentences)  # 0.08: swings back once
