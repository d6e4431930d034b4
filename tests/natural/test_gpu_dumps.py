"""The natural-run verdict suite made on a GPU (issue 41), replayed here on the CPU: 17 dumps that runs nobody planted
left on an H100 under the default GuardConfig (fp16 + GradScaler with the user's own autocast inside the loss at two
learning rates, bf16, an HF GPT-2 in fp16, attention-logit growth in fp16, a fused-AdamW fp32 divergence, fp16 weights
under Adam), packed by `forensics pack` (tests/data/natural_gpu; how they were made: scripts/natural_gpu/make_dumps.py,
BENCHMARKS.md "Natural runs on a GPU").

What a user relies on: no replay blames data (no bad_sample, no blocklist, no "Filter"), and the verdict on this CPU
is the verdict the same dump got on the GPU (`verdicts.json`: `gpu_verdict`, recorded there). One dump per scenario
runs by default; all 17 with --runslow."""

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
    assert result.exit_code == (
        4 if verdict["kind"] in ("trigger_sample", "model_state", "spike_no_single_cause") else 0
    ), result.output
