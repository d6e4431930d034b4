"""The natural-run verdict suite made on a GPU (issues 41 and 50), replayed here on the CPU: 21 dumps that runs nobody
planted left on an H100 under the default GuardConfig (fp16 + GradScaler with the user's own autocast inside the loss
at two learning rates, bf16, an HF GPT-2 in fp16, attention-logit growth in fp16, a fused-AdamW fp32 divergence, fp16
weights under Adam; and the new user's GPT-2 at a learning rate far too high, plain SGD, bf16 at lr 12, 18 and 30 and
fp32 at lr 18), packed by `forensics pack` (tests/data/natural_gpu; how they were made: scripts/natural_gpu/make_dumps.py
and scripts/gpu_newuser.sh, each entry's `made` in verdicts.json; BENCHMARKS.md "Natural runs on a GPU").

What a user relies on: no replay blames data (no bad_sample, no blocklist, no "Filter"; a sample named only as
the first to cross, none where the GPU named none: `names_no_sample`), and the verdict on this CPU is the verdict the same dump got on the GPU (`verdicts.json`: `gpu_verdict`,
recorded there) — also where this CPU computes a finite gradient norm for the job's NaN (the new user's lr 18 and 30
dumps: reproduced as the run's divergence, not bit for bit), with words that agree with the numbers. One dump per
scenario runs by default; all 21 with --runslow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from forensics.cli import main

DATA = Path(__file__).parents[1] / "data" / "natural_gpu"
REPO = Path(__file__).parents[2]
INDEX = json.loads((DATA / "verdicts.json").read_text())["dumps"]


def _first_of_each_scenario() -> set[str]:
    seen: dict[str, str] = {}
    for name, entry in sorted(INDEX.items(), key=lambda item: (item[1]["scenario"], -item[1]["step"])):
        seen.setdefault(entry["scenario"], name)  # the last dump of each run: its crash when it had one
    return set(seen.values())


DEFAULT = _first_of_each_scenario()
CASES = [pytest.param(name, marks=() if name in DEFAULT else pytest.mark.slow) for name in sorted(INDEX)]


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # the job's own autocast("cuda") in its loss, inert here
@pytest.mark.parametrize("name", CASES)
def test_a_natural_gpu_dump_blames_no_data_and_gets_its_gpu_verdict_on_the_cpu(name, tmp_path):
    entry = INDEX[name]
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(DATA / name),
            "--device",
            "cpu",
            "--trust",
            "--path",
            str(REPO),
            "--no-rng-check",
            "-o",
            str(out),
        ],
    )
    assert (out / "report.json").exists(), (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    verdict = report["verdict"]
    assert report["trigger"]["kind"] == entry["trigger"] and report["dump"]["step"] == entry["step"]
    assert verdict["kind"] not in ("bad_sample", "exception"), verdict["headline"]
    assert not (out / "blocklist.jsonl").exists()
    assert not any(s.startswith("Filter") for s in verdict["suggestions"]), verdict["suggestions"]
    assert (report.get("evidence") or {}).get("bad_data") in (None, False)
    assert verdict["kind"] == entry["gpu_verdict"], verdict["headline"]  # the same dump, the same verdict
    named = report["culprit"]["samples"]
    assert all(s.get("trigger") for s in named), named  # a sample named only as the first to cross
    if entry.get("names_no_sample"):  # as on the GPU: the state, not the data, and nobody crossed first
        assert not named, named
    _words_agree_with_numbers(report, (out / "report.md").read_text())
    assert result.exit_code == (
        4 if verdict["kind"] in ("trigger_sample", "model_state", "spike_no_single_cause") else 0
    ), result.output


def _words_agree_with_numbers(report: dict, markdown: str) -> None:
    """The headline, the reproduction line and the per-sample table say the same thing: a step replayed finite where
    the job's was not is either not reproduced (and the verdict says so) or reproduced as the run's divergence, with
    every sample's own gradient norm past the bar the report states and the replayed norm in the headline."""
    verdict, fidelity = report["verdict"], report["fidelity"]
    diverged = fidelity.get("diverged")
    if report["reproduced"]:
        assert diverged is None and "NOT reproduced" not in markdown
        return
    if diverged is None:
        assert verdict["kind"] == "not_reproduced" and "NOT reproduced" in markdown, verdict["headline"]
        return
    assert verdict["kind"] == "model_state" and "NOT reproduced" not in markdown
    assert "Reproduced as the run's divergence" in markdown
    bar = diverged["bar_times_healthy"] * diverged["healthy_grad_norm"]
    scale = diverged["sample_scale"]  # a sample's own norm in the step's units (verdict_facts.step_units)
    norms = [row["grad_norm"] for row in report["per_sample"]]
    assert norms and all(isinstance(n, float) and n * scale >= bar for n in norms), (bar, scale, norms)
    # two healthy steps before the loss left its start: only the Guard's host snapshot (fed the same samples, healthy
    # there) tells the state from a batch of bad records, and the verdict says it ran
    assert diverged["earlier_state"] and "snapshot" in diverged["earlier_state"], diverged
    assert diverged["earlier_largest_grad_norm"] < bar
    assert "healthy" in verdict["explanation"] and "not the data" in verdict["headline"]
    assert diverged["samples_over"] == len(norms) and f"all {len(norms)} diverging alone" in markdown
    assert diverged["replayed_grad_norm"] == fidelity["replayed_grad_norm"] >= bar
    assert f"{fidelity['replayed_grad_norm']:.6g}" in verdict["headline"], verdict["headline"]
    assert "not reproduced bit for bit" in verdict["explanation"].lower()
