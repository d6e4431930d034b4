"""A failure that needs the dump's RNG (a dropout mask) gets its own answer; one that does not is left alone."""

from __future__ import annotations

import math
import random

import pytest
import torch

from forensics.demo.scenarios import SCENARIOS
from forensics.format import open_dump
from forensics.report import render_markdown, render_verdict_text, validate_report
from forensics.replay.engine import ReplayOptions, run_replay
from forensics.replay.load.session import load_session
from forensics.replay.run.execute import StepRunner
from forensics.replay.run.rng_dependence import DEFAULT_SEEDS, check_rng_dependence


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("rng")
    return {name: SCENARIOS[name].capture(root / name, device="cpu").dump_path for name in ("dropout_mask", "log_zero")}


@pytest.fixture(scope="module")
def dropout_report(dumps) -> dict:
    return run_replay(dumps["dropout_mask"], ReplayOptions(device="cpu"))


def test_dropout_mask_failure_is_reported_as_rng_dependent(dropout_report):
    report = dropout_report
    validate_report(report)
    assert report["reproduced"] is True
    rng = report["rng"]
    assert rng["checked"] is True and rng["rng_dependent"] is True
    assert rng["failed"][-1] is False and len(rng["seeds"]) == len(rng["failed"])
    verdict = report["verdict"]
    assert verdict["kind"] == "model_state"  # the schema's enum is unchanged
    assert "depends on the random state" in verdict["headline"]
    assert "suspect the model state" not in verdict["headline"]
    assert "aten::log" in verdict["headline"]
    assert "dropout mask" in verdict["suggestions"][0] and "Guard the log" in verdict["suggestions"][0]
    assert any("Do not blocklist" in s for s in verdict["suggestions"])
    assert "the failure depends on the random state" in verdict["explanation"]


def test_dropout_mask_text_and_markdown_say_the_rng_is_needed(dropout_report):
    text = render_verdict_text(dropout_report)
    assert "Random state: the failure needs the dump's RNG" in text
    assert "Random state: the failure needs the dump's RNG" in render_markdown(dropout_report)


def test_micro_batch_is_counted_from_one_in_words_and_from_zero_in_json(dropout_report):
    report = dropout_report
    assert report["trigger"]["micro_batch"] == 1 and report["dump"]["num_micro_batches"] == 2
    assert "micro-batch 2 of 2" in report["verdict"]["headline"]
    text = render_verdict_text(report)
    assert "micro-batch 2 of 2." in text and "loss of micro-batch 2 is inf" in text
    assert "micro-batch 1 of 2" not in text and "micro-batch 1 is" not in text


def test_a_data_failure_fails_from_every_seed_and_keeps_its_verdict(dumps):
    report = run_replay(dumps["log_zero"], ReplayOptions(device="cpu"))
    assert report["rng"] == {
        "checked": True,
        "seeds": list(DEFAULT_SEEDS),
        "failed": [True] * len(DEFAULT_SEEDS),
        "rng_dependent": False,
    }
    assert report["verdict"]["kind"] == "bad_sample"
    assert "random state is not the cause" in report["verdict"]["explanation"]


def test_check_leaves_the_callers_rng_and_the_weights_as_they_were(dumps):
    session = load_session(open_dump(dumps["dropout_mask"]), device="cpu")
    runner = StepRunner(session)
    before = {k: v.clone() for k, v in runner.model.state_dict().items()}
    random.seed(5)
    torch.manual_seed(5)
    block = check_rng_dependence(runner, "nonfinite_loss")
    drawn = (random.random(), torch.rand(3))
    random.seed(5)
    torch.manual_seed(5)
    assert block["rng_dependent"] is True
    assert drawn[0] == random.random() and torch.equal(drawn[1], torch.rand(3))
    after = runner.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    again = runner.run()  # the recorded RNG still brings the failure back
    assert again.losses[1] == math.inf


def test_rng_check_can_be_turned_off(dumps):
    report = run_replay(dumps["dropout_mask"], ReplayOptions(device="cpu", rng_check=False, bisect=False))
    assert report["rng"] is None
    assert "depends on the random state" not in report["verdict"]["headline"]
