"""Unit tests of the Guard's parts: SpikeDetector (warm-up, NaN-safety, threshold maths), History ring
buffer, config validation, IndexedDataset."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

from forensics.capture import DetectionConfig, DumpConfig, GuardConfig, IndexedDataset, RecordConfig, SpikeConfig
from forensics.capture.detection.detectors import MAD_TO_SIGMA, SpikeDetector
from forensics.capture.recording.history import FIELDS, History


def detector(values=(), **config) -> SpikeDetector:
    d = SpikeDetector(SpikeConfig(**{"window": 8, "warmup": 4, **config}))
    for v in values:
        d.observe(v)
    return d


def test_no_threshold_during_warmup():
    d = detector()
    for value in (1.0, 1.0, 1.0):
        assert d.threshold() is None
        assert d.observe(value * 1000) is None  # even a huge value cannot fire before warm-up
    d.observe(1.0)
    assert d.threshold() is not None


def test_threshold_is_median_plus_mad_sigmas_or_the_ratio_whichever_is_higher():
    d = detector([1.0, 2.0, 3.0, 4.0, 5.0], mad_factor=8.0, min_ratio=1.5)
    # median 3, MAD median(|v-3|) = 1 -> 3 + 8 * 1.4826 * 1
    assert d.threshold() == pytest.approx(3.0 + 8.0 * MAD_TO_SIGMA * 1.0)
    assert d.observe(3.0 + 8.0 * MAD_TO_SIGMA + 0.01) == pytest.approx(3.0 + 8.0 * MAD_TO_SIGMA)
    flat = detector([2.0] * 6, min_ratio=1.5)  # MAD 0: the ratio test decides
    assert flat.threshold() == pytest.approx(3.0)
    assert flat.observe(3.0) is None  # not strictly above
    assert flat.observe(3.0001) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "window",
    [
        [1.0, 2.0, 3.0, 4.0, 5.0],  # spread: the robust threshold (median + 8 sigmas) decides
        [2.0, 2.0, 2.0, 2.0, 2.0],  # no spread: median x min_ratio (3.0) decides
    ],
)
def test_a_value_exactly_at_the_threshold_is_not_a_spike_and_the_next_float_up_is(window):
    """'Above the threshold' is strict: the value the Guard's message calls the threshold never fires itself."""
    limit = detector(window).threshold()
    assert detector(window).observe(limit) is None
    assert detector(window).observe(math.nextafter(limit, math.inf)) == limit


def test_negative_or_zero_median_uses_the_robust_test_only():
    d = detector([-1.0, -2.0, -3.0, -4.0, -5.0])
    assert d.threshold() == pytest.approx(-3.0 + 8.0 * MAD_TO_SIGMA)


def test_non_finite_and_missing_values_never_fire_and_never_enter_the_window():
    d = detector([1.0, 1.1, 0.9, 1.0])
    before = d.threshold()
    for value in (float("nan"), float("inf"), -float("inf"), None):
        assert d.observe(value) is None
    assert d.threshold() == before and len(d._window) == 4


def test_window_rolls_over():
    d = detector([100.0] * 8, window=8, warmup=4)
    for _ in range(8):
        d.observe(1.0)
    assert d.threshold() == pytest.approx(1.5)  # the old level has left the window


def test_disabled_detector_never_fires():
    d = detector([1.0] * 10, enabled=False)
    assert d.threshold() is None and d.observe(1e9) is None


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 3, "warmup": 3}, {"window": 8, "warmup": 9}, {"warmup": 2}, {"mad_factor": 0}, {"min_ratio": 0.5}],
)
def test_spike_config_validation(kwargs):
    with pytest.raises(ValueError, match="SpikeConfig"):
        SpikeConfig(**kwargs)


@pytest.mark.parametrize(
    "group, kwargs",
    [
        (DetectionConfig, {"on_nonfinite": "ignore"}),
        (DetectionConfig, {"on_spike": "stop"}),
        (DumpConfig, {"max_dumps": -1}),
        (DumpConfig, {"min_spike_gap": -1}),
        (RecordConfig, {"history_size": 0}),
    ],
)
def test_guard_config_validation(group, kwargs):
    with pytest.raises(ValueError, match=group.__name__):
        group(**kwargs)


def test_guard_config_defaults_raise_on_nonfinite_and_continue_on_spikes():
    config = GuardConfig()
    assert (config.detection.on_nonfinite, config.detection.on_spike, config.dumping.max_dumps) == (
        "raise",
        "continue",
        3,
    )


def test_the_flat_spelling_still_works_for_one_release_and_says_what_to_write():
    with pytest.warns(
        FutureWarning,
        match=r"GuardConfig\(detection=DetectionConfig\(on_nonfinite=\.\.\.\), "
        r"dumping=DumpConfig\(max_dumps=\.\.\.\)\)",
    ):
        config = GuardConfig(dump_dir="d", on_nonfinite="skip", max_dumps=5)
    assert config == GuardConfig(
        dump_dir="d", detection=DetectionConfig(on_nonfinite="skip"), dumping=DumpConfig(max_dumps=5)
    )
    with pytest.warns(FutureWarning, match="GuardConfig.detection.loss_divisor"):
        config.loss_divisor = 2.0
    assert config.detection.loss_divisor == 2.0
    with pytest.warns(FutureWarning, match="GuardConfig.dumping.max_dumps"):
        assert config.max_dumps == 5
    with pytest.raises(ValueError, match="DumpConfig"), pytest.warns(FutureWarning):
        GuardConfig(max_dumps=-1)
    with pytest.raises(TypeError, match="max_dump"):
        GuardConfig(max_dump=1)


def test_replace_copies_the_groups_an_adapter_fills_in():
    config = GuardConfig(detection=DetectionConfig(max_grad_norm=1.0))
    filled = config.replace(loss_divisor=4.0, run_id="r")
    assert (filled.detection.loss_divisor, filled.detection.max_grad_norm, filled.run_id) == (4.0, 1.0, "r")
    assert config.detection.loss_divisor is None and filled.detection is not config.detection


def test_history_is_a_ring_buffer_of_its_capacity():
    history = History(capacity=4)
    empty = history.to_dict()
    assert {k: v for k, v in empty.items() if k != "summary"} == {"capacity": 4, **{name: [] for name in FIELDS}}
    for step in range(10):
        history.append(step, float(step), 0.5, 1e-3, None, False, step == 9)
    assert len(history) == 4
    rows = history.to_dict()
    assert rows["step"] == [6, 7, 8, 9] and rows["loss"] == [6.0, 7.0, 8.0, 9.0]
    assert rows["skipped"] == [False, False, False, True] and rows["loss_scale"] == [None] * 4
    assert list(rows) == ["capacity", *FIELDS, "summary"]
    summary = rows["summary"]  # the whole run, not just the ring: its first losses and minimum survive
    assert summary["steps"] == 10 and summary["first_losses"][:3] == [0.0, 1.0, 2.0]
    assert summary["min_loss"] == 0.0 and summary["min_loss_step"] == 0 and summary["skipped_steps"] == 1


def test_history_keeps_non_finite_values_for_the_dump():
    history = History(capacity=2)
    history.append(0, float("nan"), float("inf"), None, None, None, True)
    rows = history.to_dict()
    assert math.isnan(rows["loss"][0]) and rows["grad_norm"] == [math.inf]


def test_indexed_dataset_attaches_dataset_indices_as_sample_ids():
    data = [{"x": torch.tensor([float(i)])} for i in range(5)]
    loader = DataLoader(IndexedDataset(data), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    seen = []
    for batch in loader:
        assert torch.equal(batch["x"].reshape(-1), batch["sample_ids"].float())
        seen += batch["sample_ids"].tolist()
    assert sorted(seen) == list(range(5))
    assert IndexedDataset(data, key="idx")[3]["idx"] == 3
    with pytest.raises(TypeError, match="sample_ids= to Guard.record_batch"):
        IndexedDataset([1, 2])[0]


def test_the_kept_sorted_window_gives_the_thresholds_of_a_full_recomputation():
    """The window is kept sorted and its MAD taken only above the lowest possible threshold: the verdicts, the
    suppressed warm-up values and the thresholds are those of statistics.median over the whole window."""
    import random
    import statistics

    def reference(values: list[float], config: SpikeConfig) -> float:
        median = statistics.median(values)
        robust = median + config.mad_factor * MAD_TO_SIGMA * statistics.median(abs(v - median) for v in values)
        return max(robust, median * config.min_ratio) if median > 0 else robust

    rng = random.Random(0)
    for window, draw in (
        (8, lambda: rng.gauss(2, 0.3)),
        (9, lambda: float(rng.randint(-2, 3))),
        (16, lambda: rng.choice([1.0, 1.1, 50.0, -3.0, 1e-30])),
    ):
        d = detector(window=window, warmup=4, min_ratio=1.5)
        values: list[float] = []
        for _ in range(200):
            value = draw()
            limit = reference(values, d.config) if len(values) >= 4 else None
            assert d.threshold() == limit
            assert d.observe(value) == (limit if limit is not None and value > limit else None)
            values = (values + [value])[-window:]


def test_a_loss_spike_on_a_grad_scaler_overflow_step_fires_and_its_norm_is_never_observed():
    """fp16 (issue 42 item 3): a step whose gradients overflow (the GradScaler skips it) still has a real loss, judged
    for a spike; its non-finite norm is no measurement and never enters the grad-norm window."""
    from forensics.capture.detection.detectors import StepDetectors
    from forensics.core.kinds import TriggerKind

    detectors = StepDetectors(
        GuardConfig(
            detection=DetectionConfig(
                loss_spike=SpikeConfig(window=8, warmup=4), grad_norm_spike=SpikeConfig(window=8, warmup=4)
            )
        )
    )
    for value in (1.0, 1.1, 0.9, 1.0, 1.05):
        assert detectors.detect([value], 2.0, value, 65536.0) is None
    norms_before = list(detectors.grad_norm._window)
    trigger = detectors.detect([50.0], math.inf, 50.0, 65536.0)
    assert trigger is not None and trigger.kind is TriggerKind.LOSS_SPIKE and trigger.value == 50.0
    assert list(detectors.grad_norm._window) == norms_before
    assert detectors.detect([1.0], math.inf, 1.0, 65536.0) is None  # an ordinary overflow stays silent
