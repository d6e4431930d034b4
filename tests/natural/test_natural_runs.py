"""The natural-instability suite (issue 30, item 7): runs that diverge by themselves — nothing planted — under the
DEFAULT GuardConfig, and what a user relies on afterwards: the crash dump exists, its replay gives the scenario's
verdict kind and blames no sample; with PrecursorConfig() (opt-in) a precursor comes >= 10 steps ahead naming a block
where the physics gives a warning, and the crash dump's verdict tells the growth before it and the run's earlier
dumps. Kinds and ranges only: a run that dies 20 steps earlier on another machine's rounding passes the same.
tests/natural/natural_job.py holds the scenarios (and runs them on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from forensics_test_helpers import load_test_module

from forensics.format import open_dump
from forensics.core.kinds import TriggerKind, VerdictKind

_job = load_test_module("forensics_natural_job", Path(__file__).with_name("natural_job.py"))
SCENARIOS, AHEAD = _job.SCENARIOS, _job.AHEAD


FUSED = ("lr_too_high", "spiky_late")  # without a GradScaler: a fused optimizer makes the default check sync-free


@pytest.fixture(scope="module", params=sorted(SCENARIOS) + [f"{name}/fused" for name in FUSED])
def default_run(request, tmp_path_factory):
    """Each scenario under the default GuardConfig, its crash dump replayed on the CPU; the scenarios without a
    GradScaler once more with their optimizer fused (the sync-free check: a crash judged one step late)."""
    name, _, fused = request.param.partition("/")
    scenario = SCENARIOS[name]
    run = _job.train(scenario, tmp_path_factory.mktemp(scenario.name), fused=bool(fused))
    out = _job.summarize(scenario, run)
    print(json.dumps(out))  # pytest -s: what BENCHMARKS.md "natural_runs" records
    return scenario, run, out


def test_the_run_diverges_by_itself_and_its_crash_is_dumped_under_the_default_config(default_run):
    scenario, run, out = default_run
    assert run.nonfinite_at is not None, f"{scenario.name} did not diverge within {scenario.steps} steps"
    assert run.guard.config.precursors is None  # the pure default: no precursor monitor
    crash = open_dump(run.dumps[-1])
    assert crash.trigger.kind in (TriggerKind.NONFINITE_LOSS, TriggerKind.NONFINITE_GRAD)
    assert crash.step == run.nonfinite_at == out["crash_step"]
    fused = run.guard.optimizer.defaults.get("fused")
    assert ("one step late" in crash.trigger.detail) == bool(fused)  # sync-free exactly where the default picks it


def test_the_crash_replays_to_the_scenarios_verdict_and_blames_no_sample(default_run):
    scenario, _, out = default_run
    assert out["verdict"] in scenario.verdicts, out["headline"]
    assert out["samples"] == [], out["headline"]  # nothing was planted: no sample is the cause


LEAD = sorted(name for name, s in SCENARIOS.items() if s.precursor_lead)


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """The same runs with PrecursorConfig() (opt-in), each trained once, when a test first asks for it; the crash
    dump is not replayed except for the fp16 climb."""
    runs: dict = {}

    def run_of(name: str):
        if name not in runs:
            scenario = SCENARIOS[name]
            run = _job.train(scenario, tmp_path_factory.mktemp(f"{name}-watched"), precursors=True)
            out = _job.summarize(scenario, run, replay=name == "attention_fp16")
            print(json.dumps(out))
            runs[name] = scenario, run, out
        return runs[name]

    return run_of


@pytest.mark.parametrize("name", LEAD)
def test_a_precursor_comes_ten_steps_ahead_naming_a_block(watched, name):
    scenario, run, out = watched(name)
    assert out.get("crash_step") is not None, out
    assert out.get("ahead") is not None and out["ahead"] >= AHEAD, out
    assert str(out["precursor_layer"]).startswith("layers."), out
    if scenario.lead_statistics:
        assert out["precursor_statistic"] in scenario.lead_statistics, out


def test_the_slow_fp16_climb_is_seen_by_its_limit_and_the_crash_verdict_tells_the_growth_before(watched):
    """attention_fp16: the bound of a block climbs toward fp16's limit; the headroom or trend rule fires (not only
    the relative one), and the crash dump's replay says how the bound grew and points to the run's earlier dumps."""
    scenario, run, out = watched("attention_fp16")
    assert out["precursor_rule"] in ("headroom", "trend"), out
    assert out["verdict"] == VerdictKind.NUMERICAL_PRECISION and out["samples"] == [], out
    history = out["precursor_history"]
    assert "attention-logit bound" in history and "fp16" in history and "`layers." in history, history
    assert f"step {out['precursor_step']} (precursor)" in history, history


def test_the_monitor_does_not_change_the_run(tmp_path):
    """The precursor hooks only read: with them the same seeded run takes bitwise the same first 20 steps."""
    import dataclasses

    short = dataclasses.replace(SCENARIOS["lr_too_high"], steps=20)
    a = _job.train(short, tmp_path / "a").guard.model
    b = _job.train(short, tmp_path / "b", precursors=True).guard.model
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
