"""`forensics timeline` and the run log (issue 52): what the Guard writes, what the reader refuses, what the page shows.

The page is checked twice: here without a browser (every string escaped, every marker in the data, decimation keeps
the events) and in headless Chromium (it renders with no console message, every marker is drawn, hostile strings
stay text, a 1,000,000-step log gives a small page that renders). tests/integrations/test_timeline_run.py makes the
page of a natural two-rank run.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forensics_test_helpers import load_test_module

from forensics.capture import Guard, GuardConfig
from forensics.capture.recording.run_log import RunLog, log_dir
from forensics.cli import main
from forensics.commands.timeline import build_timeline, summary_text
from forensics.format import run_log as fmt
from forensics.report.timeline_html import decimate, page_data, render_timeline_html

browser = load_test_module("forensics_test_browser", Path(__file__).with_name("browser.py"))
HOSTILE = ["<script>alert(1)</script>", '"><img src=x onerror=alert(2)>', "</script><script>alert(3)</script>"]


def write_log(root: Path, run: str, rank: int, rows: list[list], events: list[dict], level: int = 0, seg: int = 0):
    """One segment, as the Guard writes it (forensics/format/run_log.py)."""
    path = log_dir(root, run, rank) / "20260101T000000-aaaa" / f"seg-{seg:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"run_id": run, "rank": rank, "world_size": 2, "segment": seg, "level": level}
    path.write_bytes(fmt.encode_segment(header, rows, events))
    return path


def train(dump_dir: Path, steps: int, spike_at: tuple = ()) -> Guard:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(dump_dir), run_id="lin"))
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 4, generator=data) * (30 if step in spike_at else 1)
        guard.record_batch({"x": x, "sample_ids": [f"s{step}-{i}" for i in range(8)]})
        loss = model(x).pow(2).mean()
        guard.record_loss(loss)
        loss.backward()
        if guard.check(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
            optimizer.step()
        optimizer.zero_grad()
    guard.close()
    return guard


# -- the run log ---------------------------------------------------------------------------------------


def test_the_guard_logs_every_step_and_each_spike_with_its_dump(tmp_path):
    train(tmp_path, 120, spike_at=(60, 62))
    t = build_timeline(tmp_path)
    (rank,) = t.ranks
    assert [s.step for s in rank.steps] == list(range(120))
    assert rank.steps[60].loss > 100 * rank.steps[59].loss
    spikes = [f for f in t.faults if f.trigger == "loss_spike"]
    assert [(f.step, f.dumped) for f in spikes] == [(60, True), (62, False)]
    assert "min_spike_gap" in spikes[1].why_not  # why the second was not dumped
    assert [d.step for d in t.dumps] == [60] and spikes[0].dump is t.dumps[0]
    kinds = [e.kind for e in rank.events]
    assert fmt.EventKind.DUMP_WRITTEN in kinds and kinds[-1] is fmt.EventKind.END
    assert rank.events[-1].budget["spike_dumps_kept"] == [60]


def test_a_healthy_run_writes_no_log_and_the_first_trigger_writes_it_from_step_0(tmp_path):
    train(tmp_path / "healthy", 40)
    assert not (tmp_path / "healthy").exists()
    log = RunLog(tmp_path / "late", "late", 0, 1)
    for step in range(3 * fmt.SEGMENT_ROWS):
        log.step(step, 1.0, 1.0, 0.1, None, False, False, None)
    assert not (tmp_path / "late").exists()
    log.event(fmt.EventKind.TRIGGER, 3 * fmt.SEGMENT_ROWS - 1, trigger="loss_spike", message="m", dumped=False)
    log.close()
    (rank,) = build_timeline(tmp_path / "late").ranks
    assert [s.step for s in rank.steps] == list(range(3 * fmt.SEGMENT_ROWS))


KILLED_JOB = """
import os, signal, sys, torch
from forensics.capture import Guard, GuardConfig
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
guard = Guard(model, optimizer, config=GuardConfig(dump_dir=sys.argv[1], run_id="lin"))
data = torch.Generator().manual_seed(1)
for step in range(700):
    x = torch.randn(8, 4, generator=data) * (30 if step == 300 else 1)
    guard.record_batch({"x": x, "sample_ids": [f"s{step}-{i}" for i in range(8)]})
    loss = model(x).pow(2).mean()
    guard.record_loss(loss)
    loss.backward()
    if guard.check(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
        optimizer.step()
    optimizer.zero_grad()
    if step == 600:  # killed once the writer thread has flushed something (a busy machine delays it; bounded)
        import glob, time
        deadline = time.monotonic() + 60
        while not glob.glob(os.path.join(sys.argv[1], "runlogs", "**", "seg-*"), recursive=True):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_job_leaves_its_log_up_to_the_last_flush(tmp_path):
    """The job spikes at step 300 and is killed at step 600 without closing anything (a process of its own)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", KILLED_JOB, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    (rank,) = build_timeline(tmp_path).ranks
    assert 301 <= len(rank.steps) <= 601  # the spike's event flushed the log through step 300 (then every 256 steps)
    assert [s.step for s in rank.steps] == list(range(len(rank.steps)))
    assert any(e.kind is fmt.EventKind.TRIGGER and e.step == 300 for e in rank.events)


def test_old_segments_are_thinned_but_keep_every_event_and_anomalous_step(tmp_path):
    log = RunLog(tmp_path, "long", 0, 1)  # written on this thread
    total = (fmt.FULL_SEGMENTS + 3) * fmt.SEGMENT_ROWS
    for step in range(total):
        bad = step == 1000
        log.step(step, math.nan if bad else 2.0 + (step % 7), 1.0, 1e-3, None, False, bad, None)
        if step in (700, 1500):
            log.event(fmt.EventKind.TRIGGER, step, trigger="loss_spike", message="m", dumped=False, why_not="gap")
    log.close()
    segments = sorted(log.directory.iterdir())
    assert len(segments) == fmt.FULL_SEGMENTS + 4  # the last one holds the few steps after the last full one
    levels = [json.loads(p.read_text().splitlines()[0])["level"] for p in segments]
    assert levels == [1, 1, 1] + [0] * (fmt.FULL_SEGMENTS + 1)
    assert segments[0].stat().st_size < segments[-2].stat().st_size / 10  # thinned
    (rank,) = build_timeline(tmp_path).ranks
    assert sum(s.count for s in rank.steps) == total
    by_step = {s.step: s for s in rank.steps}
    assert math.isnan(by_step[1000].loss) and by_step[1000].skipped  # kept whole
    assert by_step[700].count == 1 and by_step[1500].count == 1  # an event's step is kept whole
    assert [e.step for e in rank.events if e.kind is fmt.EventKind.TRIGGER] == [700, 1500]
    bucket = next(s for s in rank.steps if s.count > 1)
    assert bucket.loss == 8.0 and bucket.span[0] == 2.0  # min and max survive


def test_the_reader_skips_what_breaks_the_format_and_says_so(tmp_path):
    run = tmp_path / "r"
    write_log(tmp_path, "r", 0, [[0, 1.0, 1.0, 0.1, None, 0], [1, 1.0, 1.0, 0.1, None, 0]], [], seg=0)
    bad = write_log(tmp_path, "r", 0, [], [], seg=1)
    bad.write_text(bad.read_text().replace('"version":1', '"version":99'))
    wrong_rank = write_log(tmp_path, "r", 0, [], [], seg=2)
    wrong_rank.write_text(wrong_rank.read_text().replace('"rank":0', '"rank":5'))
    write_log(tmp_path, "r", 0, [["x"]], [], seg=3)
    big = write_log(tmp_path, "r", 0, [], [], seg=4)
    with open(big, "ab") as f:
        f.truncate(fmt.MAX_SEGMENT_BYTES + 1)
    write_log(tmp_path, "r", 0, [], [{"event": "no-such", "step": 1}], seg=5)
    deep = write_log(tmp_path, "r", 0, [], [], seg=6)
    with open(deep, "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
    t = build_timeline(run)
    assert [s.step for s in t.ranks[0].steps] == [0, 1]
    text = " ".join(t.problems)
    for what in ("version 99", "names rank 5", "a row", "above", "unknown event", "a line is refused"):
        assert what in text, text


def test_no_run_log_is_a_clear_error_with_exit_code_2(tmp_path):
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["timeline", str(tmp_path)])
    assert result.exit_code == 2 and "no run log under" in result.output


# -- the page, without a browser ----------------------------------------------------------------------------


def hostile_run(root: Path) -> Path:
    """A run whose log carries markup in every string field, in a directory whose name is markup."""
    run = HOSTILE[1].replace("/", "")
    rows = [[s, 1.0 + s % 3, 0.5, 0.1, 1024.0, 0] for s in range(50)]
    events = [
        {"event": "trigger", "step": 10 + n, "trigger": "loss_spike", "message": h, "dumped": False, "why_not": h}
        for n, h in enumerate(HOSTILE)
    ] + [{"event": "trigger", "step": 40, "trigger": HOSTILE[0], "message": "x", "dumped": True, "local": True}]
    write_log(root, run, 0, rows, events)
    return root / run


def test_every_string_from_the_run_is_escaped(tmp_path):
    t = build_timeline(hostile_run(tmp_path))
    page = render_timeline_html(t, tmp_path / "run.html")
    body, script_block = page.split('<script type="application/json"', 1)
    for h in HOSTILE:
        assert h not in page
    assert "<img" not in page and "alert(1)</script>" not in page
    data = script_block.split(">", 1)[1].split("</script>", 1)[0]
    assert "<" not in data and json.loads(data)["markers"][0]["message"] == HOSTILE[0]  # the same string, as data
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert page.count("<script") == 2  # the data block and the page's own script


def test_every_event_has_a_marker_and_decimation_keeps_them(tmp_path):
    rows = [[s, 2.0 + math.sin(s / 50), 1.0, 1e-3, None, 0] for s in range(200_000)]
    steps = [fmt._step(r) for r in rows]
    events = [12_345, 77_777, 150_001]
    out = decimate(steps, 0, 199_999, events)
    assert len(out["x0"]) < 6000  # 200,000 steps drawn as a few thousand buckets ...
    for e in events:  # ... but each event's neighbourhood step by step
        i = out["x0"].index(e)
        assert out["x1"][i] == e and out["loss"][i] == pytest.approx(2.0 + math.sin(e / 50), rel=1e-5)
    assert max(out["loss"]) == pytest.approx(3.0, rel=1e-4) and min(out["loss_lo"]) == pytest.approx(1.0, rel=1e-4)
    write_log(
        tmp_path,
        "m",
        0,
        rows[:300],
        [
            {"event": "trigger", "step": s, "trigger": k, "message": k, "dumped": s % 2 == 0}
            for s, k in (
                (20, "loss_spike"),
                (21, "grad_norm_spike"),
                (90, "precursor"),
                (150, "exception"),
                (299, "nonfinite_loss"),
            )
        ],
    )
    data = page_data(build_timeline(tmp_path / "m"))
    assert sorted((m["step"], m["kind"]) for m in data["markers"]) == [
        (20, "spike_dumped"),
        (21, "spike_not_dumped"),
        (90, "precursor"),
        (150, "exception"),
        (299, "nonfinite"),
    ]


# -- the page in a real browser -----------------------------------------------------------------------------

needs_browser = pytest.mark.skipif(browser.browser() is None, reason=f"no Chromium here: {browser.INSTALL}")


def elements(dom: str) -> list[tuple[str, list[str]]]:
    """Every element of the DOM: (tag, attribute names)."""
    from html.parser import HTMLParser

    found: list[tuple[str, list[str]]] = []

    class Collect(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.append((tag, [name for name, _ in attrs]))

    Collect().feed(dom)
    return found


def markers_drawn(dom: str) -> list[tuple[str, int]]:
    return sorted(
        (kind, int(step))
        for kind, step in re.findall(r'<g class="marker"[^>]*data-kind="(\w+)" data-step="(\d+)"', dom)
    )


@needs_browser
def test_the_page_renders_every_marker_with_no_console_message(tmp_path):
    train(tmp_path, 120, spike_at=(60, 62))
    t = build_timeline(tmp_path)
    page = tmp_path / "run.html"
    page.write_text(render_timeline_html(t, page))
    dom, console, _ = browser.render(page)
    assert console == []
    expected = sorted((m["kind"], m["step"]) for m in page_data(t, page)["markers"])
    assert markers_drawn(dom) == expected == [("dump", 60), ("spike_dumped", 60), ("spike_not_dumped", 62)]
    assert dom.count('class="series"') == 3  # loss, grad norm, lr of the one rank (no loss scale)


@needs_browser
def test_hostile_strings_stay_text_in_the_browser(tmp_path):
    page = tmp_path / "run.html"
    page.write_text(render_timeline_html(build_timeline(hostile_run(tmp_path)), page))
    dom, console, _ = browser.render(page)
    assert console == []  # no alert, no script refused by the page's policy, no error
    tags = elements(dom)
    assert not [t for t in tags if t[0] == "img" or any(name.startswith("on") for name in t[1])]
    assert [t[0] for t in tags].count("script") == 2  # the data block and the page's own script
    assert len(markers_drawn(dom)) == 4
    assert dom.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 2  # shown as text: the table and the marker title


def million_step_log(root: Path) -> Path:
    """What RunLog leaves after 1,000,000 steps (its segments, thinned as it thins them) with 40 events."""
    events = list(range(20_000, 1_000_000, 25_000))
    full_from = 1_000_000 - fmt.FULL_SEGMENTS * fmt.SEGMENT_ROWS
    for seg, first in enumerate(range(0, 1_000_000, fmt.SEGMENT_ROWS)):
        steps = range(first, min(first + fmt.SEGMENT_ROWS, 1_000_000))
        rows = [[s, round(3 + math.sin(s / 5000), 4), 1.0, 1e-4, 65536.0, 0] for s in steps]
        seg_events = [
            {
                "event": "trigger",
                "step": s,
                "trigger": "loss_spike",
                "message": "spike",
                "dumped": False,
                "why_not": "gap",
            }
            for s in events
            if s in steps
        ]
        level = 0 if first >= full_from else 1
        write_log(root, "big", 0, rows if level == 0 else fmt.thin(rows, seg_events), seg_events, level, seg)
    return root / "big"


@needs_browser
def test_a_million_step_log_makes_a_small_page_that_renders(tmp_path):
    run = million_step_log(tmp_path)
    on_disk = sum(p.stat().st_size for p in run.rglob("*.jsonl"))
    t = build_timeline(run)
    page = tmp_path / "run.html"
    page.write_text(render_timeline_html(t, page))
    size = page.stat().st_size
    dom, console, took = browser.render(page)
    print(f"1,000,000 steps: log {on_disk / 1e6:.1f} MB, page {size / 1e6:.2f} MB, rendered in {took:.1f} s")
    assert on_disk < 4e6 and size < 2e6
    assert console == [] and len(markers_drawn(dom)) == 40
    assert took < 30  # a hang guard, not a timing: the reading is printed (BENCHMARKS.md)
    assert "1000000 steps" in summary_text(t)


def test_the_run_log_goes_to_object_storage_as_whole_segment_objects():
    """fsspec's in-memory store: no append, no rename; each flush writes the segment as one object."""
    root = "memory://forensics-timeline-test/dumps"
    log = RunLog(root, "remote", 1, 2)
    for step in range(300):
        log.step(step, 1.0 + step, 0.5, 0.1, None, False, False, None)
    log.event(fmt.EventKind.TRIGGER, 299, trigger="loss_spike", message="m", dumped=False, why_not="gap")
    for step in range(300, 310):
        log.step(step, 1.0, 0.5, 0.1, None, False, False, None)
    log.close({"max_dumps": 3})
    t = build_timeline(root)
    (rank,) = t.ranks
    assert rank.rank == 1 and [s.step for s in rank.steps] == list(range(310))
    assert [e.kind for e in rank.events] == [fmt.EventKind.TRIGGER, fmt.EventKind.END]
    assert "loss_spike" in summary_text(t)
