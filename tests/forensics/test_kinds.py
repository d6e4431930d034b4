"""Every named kind is tied to what users see: its label, its exit code, how each renderer shows it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from forensics.core.kinds import ExitCode, HistoryPattern, Phase, Policy, TriggerKind, VerdictKind
from forensics.report import VERDICT_KINDS, render_html, render_markdown, render_verdict_text

sys.path.insert(0, str(Path(__file__).parent))
from report_factory import make_report


def test_kinds_compare_and_serialise_as_their_stored_strings():
    assert TriggerKind.LOSS_SPIKE == "loss_spike" and f"{TriggerKind.LOSS_SPIKE}" == "loss_spike"
    assert json.dumps({"kind": VerdictKind.BAD_SAMPLE}) == '{"kind": "bad_sample"}'
    assert Policy("skip") is Policy.SKIP
    with pytest.raises(ValueError, match="expected one of"):
        TriggerKind.parse("wobbly")


@pytest.mark.parametrize("kind", list(TriggerKind))
def test_every_trigger_kind_has_its_properties(kind):
    assert kind.words and kind.what_fails
    assert kind.spike == kind.value.endswith("_spike")
    assert kind.replayed in ("micro_batch_loss", "step_loss", "grad_norm", "exception", None)
    assert kind.data_independent == (
        kind in (TriggerKind.NONFINITE_PARAM, TriggerKind.PRECURSOR, TriggerKind.SILENT_CORRUPTION)
    )


def test_every_verdict_kind_is_documented_with_its_exit_code_in_the_report_format():
    """docs/REPORT_FORMAT.md's verdict table is what a user scripting on report.json reads: each kind a report may
    carry has its row there, with the exit code `forensics replay` gives it."""
    rows = {}
    for line in (Path(__file__).parents[2] / "docs" / "REPORT_FORMAT.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[2].isdigit():
            rows[cells[0].split("`")[1]] = cells[2]
    assert set(VERDICT_KINDS) <= set(rows), set(VERDICT_KINDS) - set(rows)
    for kind in VerdictKind:
        assert rows[kind.value] == str(int(kind.exit_code)), (kind, rows[kind.value])


@pytest.mark.parametrize("kind", list(VerdictKind))
def test_every_verdict_kind_has_a_label_an_exit_code_and_renders(kind):
    assert isinstance(kind.exit_code, ExitCode) and kind.exit_code is not ExitCode.INTERNAL
    assert kind.names_culprit == (kind.exit_code is ExitCode.OK)
    report = make_report(kind.value)
    assert f"Verdict: {kind.label}" in render_verdict_text(report)
    assert kind.label in render_markdown(report)
    html = render_html(report, plots=False)
    assert kind.label in html and f'class="verdict {kind.outcome}"' in html


@pytest.mark.parametrize("pattern", list(HistoryPattern))
def test_every_history_pattern_has_words(pattern):
    assert pattern.words and pattern.means().startswith(pattern.words)


def test_phases():
    assert [p.value for p in Phase] == ["forward", "backward", "optimizer", "between_steps"]
    assert Phase.FORWARD.is_pass and not Phase.OPTIMIZER.is_pass and not Phase.BETWEEN_STEPS.is_pass
    assert Phase.BETWEEN_STEPS.words == "between steps (data loading or user code)"
    assert not Phase.BETWEEN_STEPS.in_model_step and Phase.OPTIMIZER.in_model_step
