"""Healthy samples are not blamed at a learning rate far too high (issue 50, item 1).

A GPT-2 of 2 layers x 32 from a config, plain SGD at lr 18, bf16 autocast on the CPU, eight samples per step, nothing
wrong with the data (tests/natural/gpt2_lr_job.py). Before issue 50 its NaN dump replayed (on the dev box) as bad data
with a blocklist and exit 0 — 4 samples "together", on the sole evidence that their losses alone (2e11, 3.6e11) stood
out against the others' median (6.3e10) — while the same report said the culprit was healthy on the Guard's earlier
snapshot, that dropping the culprits was not enough and that the failure needed the dump's RNG. Now: no record is
blamed, no blocklist, and the report says why what stood against the records does not hold. Kinds, not one machine's
step: on another machine the run may cross elsewhere, and the same holds there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from forensics_test_helpers import load_test_module

from forensics.format import open_dump

_job = load_test_module("forensics_gpt2_lr_job", Path(__file__).with_name("gpt2_lr_job.py"))


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2-lr18")
    dumps = _job.train(root, lr=18.0, bf16=True)
    assert dumps, "the run must go non-finite within 5 epochs and dump it"
    out = _job.replay(dumps[-1], root / "report")
    print(json.dumps(out))
    return dumps[-1], out, json.loads((root / "report" / "report.json").read_text())


def test_the_crash_is_a_nan_dump_of_a_run_whose_loss_grew_geometrically(replayed):
    dump, out, report = replayed
    assert open_dump(dump).trigger.kind in ("nonfinite_loss", "nonfinite_grad")
    assert report["history_pattern"] in ("exponential_growth", "diverged")


def test_no_record_is_blamed_and_no_blocklist_is_written(replayed):
    _, out, report = replayed
    assert _job.problems(out) == [], out
    assert out["verdict"] in ("model_state", "numerical_precision", "optimizer_update"), out["headline"]


def test_the_report_does_not_contradict_itself(replayed):
    """Evidence measured against a culprit is shown as set aside, with the finding that refutes it."""
    _, out, report = replayed
    evidence = report.get("evidence") or {}
    blames = bool(evidence) and evidence["bad_data"] is not False  # the key is always written with the block
    if evidence.get("against"):
        assert evidence["refuted_by"] and not blames, evidence
    earlier = str(evidence.get("earlier_state") or "")
    if "is healthy" in earlier:
        assert not blames, evidence
    remedies = {row["kind"]: row.get("healthy") for row in (report.get("remedies") or {}).get("tested", [])}
    if remedies.get("drop_samples") is False:
        assert not blames, evidence
    if remedies.get("fp32") is False:  # running the step in fp32 was tried and was not enough
        assert out["verdict"] != "numerical_precision", out["headline"]


def test_a_transient_nan_in_a_healthy_run_of_the_same_model_stays_not_reproduced(tmp_path):
    """The other side of reading a replay against the run's history (the GPU dumps of this model replay on the CPU as
    the run's divergence: tests/natural/test_gpu_dumps.py): at a sane learning rate, one gradient value turned NaN once
    (as a bit flip on the device would leave it) replays in the run's normal range — not reproduced, hardware advice,
    nobody named."""
    dumps = _job.train(tmp_path, lr=1.0, transient_nan_at=6)
    assert dumps and open_dump(dumps[-1]).trigger.kind == "nonfinite_grad"
    out = _job.replay(dumps[-1], tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert out["verdict"] == "not_reproduced" and out["exit_code"] == 3, out["headline"]
    assert _job.problems(out) == [] and not out["samples"]
    assert "diverged" not in report["fidelity"] and report["fidelity"]["replayed_grad_norm"] < 10
    assert "NOT reproduced" in (tmp_path / "report" / "report.md").read_text()
    assert any("DCGM" in s for s in out["suggestions"])
