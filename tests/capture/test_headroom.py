"""The precursor rules that see a slow climb to a dtype's hard limit (forensics/core/headroom.py): headroom, trend and
overflow on a healthy step, the limits per dtype, and a healthy series that never fires. Also: the monitor records the
dtype each statistic was measured in and says once, in plain words, what it cannot measure."""

from __future__ import annotations

import logging
import math

import torch

from forensics.capture import Guard, GuardConfig, PrecursorConfig
from forensics.core import headroom
from forensics.core.headroom import FP16_MAX, HORIZON, LimitWatch, forecast, limit_of, theil_sen
from forensics.core.kinds import PrecursorRule, PrecursorStatistic as S


def test_limits_per_dtype_and_statistic():
    assert limit_of(S.BLOCK_ABSMAX, "float16").value == FP16_MAX
    assert limit_of(S.OUTPUT_LOGIT, "float16").value == FP16_MAX
    assert limit_of(S.ATTENTION_LOGIT, "float16", head_dim=16).value == FP16_MAX / 4  # q·k before scaling
    assert limit_of(S.ATTENTION_LOGIT, "float16") is None  # no head size: no limit
    assert limit_of(S.ATTENTION_LOGIT, "bfloat16", 64).value == 256 and limit_of(S.OUTPUT_LOGIT, "bfloat16")
    assert limit_of(S.BLOCK_ABSMAX, "bfloat16") is None  # fp32's exponent: no activation overflows it
    assert limit_of(S.BLOCK_ABSMAX, "float32") is None and limit_of(S.GRAD_NORM, "float16") is None


def test_theil_sen_ignores_an_outlier_and_forecast_reads_steps_to_the_limit():
    points = [(s, 0.01 * s) for s in range(0, 160, 8)]
    points[5] = (40, 50.0)  # one wild value
    slope, positive = theil_sen(points)
    assert math.isclose(slope, 0.01, rel_tol=1e-6) and positive > 0.75
    climb = [(s, 1000 * math.exp(0.01 * s)) for s in range(0, 128, 8)]  # x e per 100 steps, from 1000
    left = forecast(climb, FP16_MAX)
    assert math.isclose(left, (math.log(FP16_MAX) - math.log(climb[-1][1])) / 0.01, rel_tol=1e-6)
    assert forecast(climb[:3], FP16_MAX) is None  # too few points
    noisy = [(s, 1000.0 * (2 if i % 2 else 1)) for i, s in enumerate(range(0, 128, 8))]
    assert forecast(noisy, FP16_MAX) is None  # no steady growth


def test_a_slow_climb_fires_the_trend_ahead_of_the_limit_and_headroom_at_half():
    """The issue's case: a bound rising ~2.6x over 80 steps in fp16 (each sample under 2x its recent median)."""
    limit = limit_of(S.BLOCK_ABSMAX, "float16")
    watch, fired = LimitWatch(limit, warmup=64), []
    for step in range(0, 400, 8):
        value = 2000 * math.exp(0.012 * step)
        alarm = watch.observe(step, value)
        if alarm is not None:
            fired.append((step, alarm.rule, alarm.steps_left))
    first_step, rule, left = fired[0]
    reaches = math.log(FP16_MAX / 2000) / 0.012
    assert rule is PrecursorRule.TREND and left <= HORIZON and reaches - first_step >= 100
    assert any(r is PrecursorRule.HEADROOM for _, r, _ in fired)
    said = headroom.describe_alarm(
        headroom.Alarm(PrecursorRule.TREND, 51500.0, limit, 20, 2.6, 80), "the bound of `h.0`"
    )
    assert said == (
        "the bound of `h.0` grew 2.6x over the last 80 steps to 5.15e+04 (79 % of fp16's max (65,504)); "
        "at that rate it reaches the limit in ~20 steps"
    )


def test_a_healthy_series_never_fires_and_an_overflow_on_a_healthy_step_fires_at_once():
    limit = limit_of(S.ATTENTION_LOGIT, "float16", head_dim=64)
    watch = LimitWatch(limit, warmup=64)
    # early training: fast, decelerating growth to a plateau far below the limit
    assert all(watch.observe(s, 40 * (1 - math.exp(-s / 30)) + 1) is None for s in range(0, 2000, 8))
    assert watch.observe(2000, math.inf).rule is PrecursorRule.NONFINITE
    assert watch.observe(2008, math.nan, healthy=False) is None  # the step's own incident: not a precursor
    assert watch.observe(2016, None) is None  # not measured


class _Attention(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.q_proj, self.k_proj = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return self.q_proj(x) + self.k_proj(x)


class _Model(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Attention(width) for _ in range(2))
        self.lm_head = torch.nn.Linear(width, 4)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


def test_a_statistic_that_cannot_be_measured_is_named_once_in_plain_words(caplog):
    model = _Model()  # query / key projections, but no head size anywhere
    with caplog.at_level(logging.WARNING, logger="forensics.capture.precursors.statistics"):
        guard = Guard(model, torch.optim.Adagrad(model.parameters()), config=GuardConfig(precursors=PrecursorConfig()))
    said = [r.getMessage() for r in caplog.records]
    assert any("attention-logit bound is not measured for layers.0, layers.1: no head size found" in m for m in said)
    caplog.clear()
    x = torch.randn(2, 8)
    for _ in range(3):
        guard.record_batch({"x": x})
        loss = model(x).square().mean()
        guard.record_loss(loss)
        loss.backward()
        if guard.check():
            guard.optimizer.step()
        guard.optimizer.zero_grad()
    guard.close()
    said = [r.getMessage() for r in caplog.records if "not measured" in r.getMessage()]
    assert len(said) == 1 and "Adagrad" in said[0], said  # once, not per sampled step


def test_the_dtype_of_each_forward_statistic_is_recorded_under_autocast(tmp_path):
    from transformers import GPT2LMHeadModel

    from forensics.demo.models import gpt2_config

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(n_layer=2, n_embd=32, n_head=2))
    guard = Guard(
        model,
        torch.optim.AdamW(model.parameters()),
        config=GuardConfig(dump_dir=str(tmp_path), precursors=PrecursorConfig(every=1)),
    )
    ids = torch.randint(0, 60, (2, 8))
    for _ in range(2):
        guard.record_batch({"input_ids": ids})
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
            guard.record_loss(loss)
        loss.backward()
        if guard.check():
            guard.optimizer.step()
        guard.optimizer.zero_grad()
    monitor = guard.precursors
    guard.close()
    assert monitor.stats.dtypes[("transformer.h.0", S.ATTENTION_LOGIT)] == torch.float16
    columns = {(c["layer"], c["statistic"]): c for c in monitor.meta["columns"]}
    attention = columns[("transformer.h.0", "attention_logit_bound")]
    assert attention["dtype"] == "float16" and math.isclose(attention["limit"], FP16_MAX / 4)


def test_a_crash_dump_names_the_runs_earlier_dumps_from_the_listing_only(helpers, tmp_path):
    """replay/judge/precursor.earlier_dumps: sibling step directories of the same run id, newest first; another run's
    dump, a symlinked step directory and a directory that is not a step are left out."""
    from forensics.format import open_dump
    from forensics.replay.judge.precursor import earlier_dumps

    for step in (3, 5):
        helpers.write_synthetic_dump(tmp_path, step=step)
    crash = open_dump(helpers.write_synthetic_dump(tmp_path, step=7))
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    other = helpers.write_synthetic_dump(tmp_path / "elsewhere", step=4, run_id="another")
    (run_dir / "step-000000004").symlink_to(other.parent, target_is_directory=True)
    (run_dir / "notes").mkdir()
    found = earlier_dumps(crash)
    assert [d["step"] for d in found] == [5, 3] and all(d["path"].startswith(str(run_dir)) for d in found)
