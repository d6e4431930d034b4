"""Acceptance cases of replay: every planted-fault scenario is captured by a real training run with the
Guard, replayed on the CPU, and the report must name what was planted (verdict, samples, where, phase)."""

from __future__ import annotations

import logging
import math
import struct
from pathlib import Path

import pytest
import torch

from forensics.demo.scenarios import SCENARIOS, Captured
from forensics.format import open_dump
from forensics.core.kinds import TriggerKind
from forensics.replay.engine import ReplayOptions, run_replay
from forensics.replay.load.session import load_session
from forensics.replay.run.execute import StepRunner


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture(scope="module")
def warned() -> _Warnings:
    """The warnings logged while the scenarios train and replay (transformers' once-only ones included)."""
    logging.Logger.warning_once.cache_clear()  # transformers' warning_once: said again in this module
    handler = _Warnings()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def captured(tmp_path_factory, warned) -> dict[str, Captured]:
    """Each scenario's dump, captured once per test module."""
    root = tmp_path_factory.mktemp("scenarios")
    return {name: scenario.capture(root / name, device="cpu") for name, scenario in SCENARIOS.items()}


@pytest.fixture(scope="module")
def reports(captured) -> dict[str, dict]:
    """Each scenario's replay report: CPU, and no --trust (the demo recipes are forensics' own code)."""
    return {name: run_replay(run.dump_path, ReplayOptions(device="cpu")) for name, run in captured.items()}


def test_the_demos_print_no_warning_of_their_own(captured, reports, warned):
    """The project's own models and Guard settings draw no warning from transformers or from the Guard (issue 31):
    a user would take it for a problem of their job."""
    noise = [line for line in warned.lines if "loss_type=None" in line or "is not a Hugging Face model" in line]
    assert noise == []


def _bits(value) -> object:
    """A loss as the report writes it, compared bit for bit ("nan"/"inf" strings stay as they are)."""
    return struct.pack("<d", value) if isinstance(value, float) else value


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_replay_names_the_planted_fault(name, captured, reports):
    run, report = captured[name], reports[name]
    expected = run.expected
    assert report["trigger"]["kind"] == expected.trigger
    assert report["reproduced"] is expected.reproduced
    assert report["verdict"]["kind"] == expected.verdict, report["verdict"]["headline"]
    culprit = report["culprit"]
    assert sorted(s["sample_id"] for s in culprit["samples"]) == sorted(expected.samples)
    for key in ("module", "op", "parameter", "phase"):
        if getattr(expected, key) is not None:
            assert culprit[key] == getattr(expected, key), f"{key}: {culprit}"
    for word in expected.optimizer_state_words:
        assert word in (culprit["optimizer_state"] or "")
    if expected.top_sample is not None:
        ranked = sorted(
            (r for r in report["per_sample"] if isinstance(r["loss"], float)), key=lambda r: r["loss"], reverse=True
        )
        assert ranked[0]["sample_id"] == expected.top_sample


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "sdc"])
def test_reproduced_cpu_step_replays_the_recorded_losses_bitwise(name, captured, reports):
    report = reports[name]
    fidelity = report["fidelity"]
    assert report["reproduced"] and fidelity["mode"] == "bitwise"
    recorded = open_dump(captured[name].dump_path).manifest["loss"]["per_micro_batch"]
    assert [_bits(v) for v in fidelity["replayed_losses"]] == [_bits(v) for v in fidelity["recorded_losses"]]
    assert [_bits(v) for v in fidelity["recorded_losses"]] == [
        _bits(v if math.isfinite(v) else str(v)) for v in recorded
    ]
    assert fidelity["bitwise_equal"] is True


def test_sdc_is_not_reproduced_and_the_in_job_recheck_agreed(captured, reports):
    report = reports["sdc"]
    assert report["verdict"]["kind"] == "not_reproduced"
    assert report["culprit"]["samples"] == [] and report["culprit"]["phase"] is None
    assert report["fidelity"]["recorded_losses"][0] == "nan"
    assert math.isfinite(report["fidelity"]["replayed_losses"][0])
    recheck = open_dump(captured["sdc"].dump_path).manifest["recheck"]
    assert recheck["performed"] and recheck["reproduced"] is False


def test_dropout_mask_nan_needs_the_dumps_rng(captured):
    """With each micro-batch's recorded RNG the all-dropping gate mask comes back; from another seed
    it does not, and the same step is finite."""
    session = load_session(open_dump(captured["dropout_mask"].dump_path), device="cpu")
    runner = StepRunner(session)
    with_rng = runner.run()
    assert with_rng.trigger_reproduced("nonfinite_loss")
    assert with_rng.losses[1] == math.inf
    torch.manual_seed(1234)  # any other RNG state: the gate mask is drawn afresh
    without_rng = runner.run(restore_rng=False)
    assert not without_rng.trigger_reproduced("nonfinite_loss")
    assert all(math.isfinite(v) for v in without_rng.losses) and without_rng.grads_finite


def test_pair_fails_only_together(captured, reports):
    """Neither culprit alone (with the rest of its micro-batch) breaks the step; the pair does."""
    report = reports["pair"]
    assert report["bisection"]["culprit_size"] == 2
    session = load_session(open_dump(captured["pair"].dump_path), device="cpu")
    runner = StepRunner(session)
    refs = session.sample_refs
    a, b = [r for r in refs if r.sample_id in captured["pair"].expected.samples]
    assert a.micro_batch == b.micro_batch
    assert not runner.run([r for r in refs if r != a]).trigger_reproduced(TriggerKind.NONFINITE_LOSS)
    assert not runner.run([r for r in refs if r != b]).trigger_reproduced(TriggerKind.NONFINITE_LOSS)
    assert runner.run([a, b]).trigger_reproduced(TriggerKind.NONFINITE_LOSS)


def test_demo_dumps_name_only_builtin_recipes(captured):
    """Replay may rebuild every scenario without --trust: each dump names forensics' own code only."""
    from forensics.recipes import is_builtin

    for name, run in captured.items():
        recipe = open_dump(run.dump_path).recipe
        assert is_builtin(recipe["factory"]), (name, recipe["factory"])
        assert is_builtin(recipe["loss"]), (name, recipe["loss"])


def test_scenario_sample_ids_look_real(captured):
    dump = open_dump(captured["bad_sample"].dump_path)
    ids = [i for mb in range(dump.num_micro_batches) for i in dump.sample_ids(mb)]
    assert len(ids) == 8 and len(set(ids)) == 8
    assert all(Path(i).parent.name.startswith("shard-") and Path(i).name.startswith("rec-") for i in ids)
