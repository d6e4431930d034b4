"""Issue 52's done-when: a natural spiky run (nothing planted) on two ranks (torchrun + gloo, DDP) gives one run page
that shows the curves of both ranks, where each spike, precursor and dump sits, which were dumped, which rank saw each
first and what each replay concluded — and it renders in headless Chromium with no console message.

The run is tests/natural's `spiky_late` (tests/integrations/timeline_worker.py). Kinds and ranges only: the step it
dies at, and which spikes the budget keeps, vary with the machine's rounding.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from forensics_test_helpers import load_test_module

from forensics.cli import main
from forensics.commands.timeline import build_timeline
from forensics.core.kinds import VerdictKind

WORKER = Path(__file__).with_name("timeline_worker.py")
NATURAL = Path(__file__).resolve().parents[1] / "natural"
browser = load_test_module("forensics_test_browser", Path(__file__).parents[1] / "forensics" / "browser.py")


def test_a_natural_two_rank_run_gives_one_page_with_its_faults_dumps_and_verdicts(harness, tmp_path):
    dumps = tmp_path / "dumps"
    result = harness.launch_script(str(WORKER), [str(dumps)])
    assert result.returncode == 0, result.explain()
    run = dumps / "spiky-two-ranks"
    before = build_timeline(run)
    assert sorted(r.rank for r in before.ranks) == [0, 1] and before.world_size == 2
    for rank in before.ranks:  # both ranks logged every step until the run died by itself
        assert [s.step for s in rank.steps] == list(range(len(rank.steps)))
        assert 100 < len(rank.steps) <= 1000
    kinds = {f.trigger for f in before.faults}
    assert kinds & {"loss_spike", "grad_norm_spike"} and kinds & {"nonfinite_loss", "nonfinite_grad"}, kinds
    spikes = [f for f in before.faults if f.trigger.endswith("spike")]
    assert any(f.dumped for f in spikes) and any(not f.dumped and f.why_not for f in spikes)  # kept and skipped
    assert all(f.first_ranks and set(f.first_ranks) <= {0, 1} for f in before.faults)
    assert len(before.dumps) >= 2

    # replay the first spike dump and the crash (rank 0), as a user would; the page then shows their verdicts
    crash = next(d for d in before.dumps if d.trigger.startswith("nonfinite"))
    spike = next(d for d in before.dumps if d.trigger.endswith("spike"))
    runner = CliRunner()
    for dump in (spike, crash):
        replay = runner.invoke(main, ["replay", f"{dump.path}/rank-00000", "--trust", "--path", str(NATURAL)])
        assert replay.exception is None or isinstance(replay.exception, SystemExit), replay.output
    page = tmp_path / "run.html"
    shown = runner.invoke(main, ["timeline", str(dumps), "-o", str(page)])
    assert shown.exit_code == 0, shown.output
    after = build_timeline(run)
    verdicts = {d.step: d.verdict for d in after.dumps if d.verdict}
    assert set(verdicts) == {spike.step, crash.step}
    assert all(v in {k.value for k in VerdictKind} for v in verdicts.values())
    assert f"{crash.step}" in shown.output and verdicts[crash.step] in shown.output  # the terminal summary

    html = page.read_text()
    assert html.count('data-step="') >= len(after.faults)  # every fault has its row
    # without -o the page goes beside the run log, where each replay's report links back to it with the run's curve
    assert runner.invoke(main, ["timeline", str(dumps)]).exit_code == 0
    default = dumps / "runlogs" / "spiky-two-ranks" / "run.html"
    report = Path(crash.path) / "report-rank0" / "report.html"
    link = re.search(r'<section id="run">.*?<a href="([^"]+)"', report.read_text(), re.S)
    assert link and (report.parent / link.group(1)).resolve() == default.resolve() and default.is_file()
    assert '<svg class="run-curve"' in report.read_text()
    if browser.browser() is None:
        pytest.skip(f"no Chromium: the page was not opened ({browser.INSTALL})")
    dom, console, took = browser.render(page)
    print(f"two-rank natural run: page {page.stat().st_size / 1e3:.0f} KB, rendered in {took:.1f} s")
    assert console == []
    drawn = re.findall(r'<g class="marker"[^>]*data-kind="(\w+)" data-step="(\d+)"', dom)
    expected = len(after.faults) + len(after.dumps)
    assert len(drawn) == expected
    assert ("dump", str(crash.step)) in drawn and ("nonfinite", str(crash.step)) in drawn
    assert len(re.findall(r'class="series"', dom)) >= 2 * 3  # loss, grad norm and lr of each rank
