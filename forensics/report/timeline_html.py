"""The run page of `forensics timeline`: ONE self-contained HTML file, readable offline with no server.

Hand-written SVG drawn by a little vanilla JavaScript (forensics/report/timeline_page.js, inlined; no library, no
bundle: the page is its data plus 12 KB). The data go in as a JSON block (`<script type="application/json">`,
with `<`, `>` and `&` escaped so no string can close it); the script puts every string from the run into the page
with textContent / setAttribute, never as markup; the table of events is rendered here with html.escape; and a
Content-Security-Policy lets only the page's own script (by its hash) run. Each rank's steps are decimated for
display (min / max per bucket, DISPLAY_BUCKETS buckets over the run, every step kept around each event) so that a
1,000,000-step log makes a page of about a megabyte; the script re-buckets to one column per pixel at each zoom.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import urllib.parse
from html import escape
from importlib import resources
from pathlib import Path

from forensics.core.kinds import TriggerKind
from forensics.format.run_log import Step
from forensics.report.timeline_model import Fault, Timeline
from forensics.report.wording import clean

DISPLAY_BUCKETS = 4000
"""Buckets per rank over the whole run (a screen is 1,000-3,000 pixels wide)."""
EVENT_WINDOW = 160
"""Steps each side of an event drawn step by step whatever the run's length."""
MAX_EVENT_WINDOWS = 400
"""Events that get a step-by-step window (the rest are still markers)."""
MAX_MARKERS = 20_000
COLORS = ("#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
LANES = ("loss", "grad_norm", "lr", "loss_scale")


def _script() -> str:
    return resources.files("forensics.report").joinpath("timeline_page.js").read_text(encoding="utf-8")


def _value(v: float | None) -> float | None:
    if v is None or not math.isfinite(v):
        return None
    return float(f"{v:.6g}")


def _windows(events: list[int], first: int, last: int) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for step in sorted(set(events))[:MAX_EVENT_WINDOWS]:
        lo, hi = max(first, step - EVENT_WINDOW), min(last, step + EVENT_WINDOW)
        if spans and lo <= spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], max(hi, spans[-1][1]))
        else:
            spans.append((lo, hi))
    return spans


def decimate(steps: list[Step], first: int, last: int, event_steps: list[int]) -> dict:
    """A rank's steps as display buckets: {"x0", "x1", lane: max per bucket, lane + "_lo": min (when it differs)}.
    Steps inside an event's window stay one per bucket; elsewhere DISPLAY_BUCKETS buckets cover the run."""
    width = max(1, math.ceil((last - first + 1) / DISPLAY_BUCKETS))
    windows = _windows(event_steps, first, last)
    out: dict[str, list] = {"x0": [], "x1": [], **{k: [] for k in LANES}, **{k + "_lo": [] for k in LANES}}
    current: list[Step] = []
    key = None
    w = 0

    def close() -> None:
        if not current:
            return
        out["x0"].append(current[0].step)
        out["x1"].append(max(s.last or s.step for s in current))
        for n, lane in enumerate(LANES):
            highs = [v for s in current if (v := _value(getattr(s, lane))) is not None]
            lows = [
                v
                for s in current
                if (v := _value(s.span[n] if s.span and s.span[n] is not None else getattr(s, lane))) is not None
            ]
            out[lane].append(max(highs) if highs else None)
            out[lane + "_lo"].append(min(lows) if lows else None)
        current.clear()

    for s in steps:
        while w < len(windows) and windows[w][1] < s.step:
            w += 1
        inside = w < len(windows) and windows[w][0] <= s.step <= windows[w][1]
        bucket = ("w", s.step) if inside else ("b", (s.step - first) // width)
        if bucket != key:
            close()
            key = bucket
        current.append(s)
    close()
    for lane in LANES:
        if out[lane + "_lo"] == out[lane]:
            del out[lane + "_lo"]
        if all(v is None for v in out[lane]):
            del out[lane]
            out.pop(lane + "_lo", None)
    return out


def _href(target: str | None, page: Path | None) -> str | None:
    """A link from the page to a local report: relative, percent-encoded (no scheme can sneak in)."""
    if not target or page is None:
        return None
    try:
        relative = os.path.relpath(Path(target).resolve(), page.resolve().parent)
    except ValueError:  # another drive
        return None
    return urllib.parse.quote(Path(relative).as_posix())


def _kind(fault: Fault) -> str:
    """The marker's kind: spike_dumped / spike_not_dumped, precursor, exception, nonfinite."""
    try:
        trigger = TriggerKind(fault.trigger)
    except ValueError:  # a kind this forensics does not know (a newer writer): drawn as a fault
        return "nonfinite"
    if trigger.spike:
        return "spike_dumped" if fault.dumped else "spike_not_dumped"
    if trigger in (TriggerKind.PRECURSOR, TriggerKind.EXCEPTION):
        return trigger.value
    return "nonfinite"


def markers(t: Timeline, page: Path | None) -> list[dict]:
    """Every marker the page draws: one per fault, one per dump."""
    out: list[dict] = []
    for n, f in enumerate(t.faults):
        out.append(
            {
                "id": f"f{n}",
                "kind": _kind(f),
                "step": f.step,
                "trigger": f.trigger,
                "message": f.message,
                "ranks": list(f.ranks),
                "first_ranks": list(f.first_ranks),
                "dumped": f.dumped,
                "why_not": f.why_not,
            }
        )
    for n, d in enumerate(t.dumps):
        fault = next((f for f in t.faults if f.step == d.step and f.trigger == d.trigger), None)
        out.append(
            {
                "id": f"d{n}",
                "kind": "dump",
                "step": d.step,
                "trigger": d.trigger,
                "message": f"dump of step {d.step} ({d.trigger}), ranks {', '.join(map(str, d.ranks))}",
                "ranks": list(d.ranks),
                "first_ranks": list(fault.first_ranks) if fault else list(d.ranks),
                "dumped": True,
                "verdict": d.verdict,
                "headline": d.headline,
                "report": _href(d.report_html or d.report, page),
                "path": d.path,
            }
        )
    return out[:MAX_MARKERS]


def page_data(t: Timeline, page: Path | None = None) -> dict:
    """What the page's script draws."""
    first = t.first_step if t.first_step is not None else 0
    last = max(t.last_step if t.last_step is not None else 0, first + 1)
    marks = markers(t, page)
    event_steps = [m["step"] for m in marks]
    return {
        "run_id": t.run_id,
        "first": first,
        "last": last,
        "ranks": [
            {
                "rank": log.rank,
                "color": COLORS[n % len(COLORS)],
                "lanes": (d := decimate(log.steps, first, last, event_steps)),
                "x0": d.pop("x0"),
                "x1": d.pop("x1"),
            }
            for n, log in enumerate(t.ranks)
        ],
        "markers": marks,
    }


def _json_block(data: dict) -> str:
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1c2833;margin:0;background:#fbfcfc}
header{padding:14px 24px 6px}h1{font-size:20px;margin:0 0 4px}.sub{color:#566573}
.controls{display:flex;flex-wrap:wrap;gap:14px;align-items:center;padding:6px 24px;border-bottom:1px solid #e5e8e8}
.controls label{cursor:pointer;user-select:none}.swatch{display:inline-block;width:12px;height:12px;border-radius:2px;
margin:0 4px -1px 4px}.controls input[type=number]{width:90px}#range{color:#566573}
.legend span{margin-right:12px;white-space:nowrap}.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;
border-radius:2px}
#chart{padding:4px 8px 0 8px}svg text{font-size:11px;fill:#566573}.lane-label{font-weight:600;fill:#1c2833}.rail-label{font-size:10px}
.lane-bg{fill:#fff;stroke:#e5e8e8}.grid{stroke:#f0f3f4}.axis{stroke:#d5d8dc}.brush{fill:#3498db;fill-opacity:.15}
.empty{text-anchor:middle}.marker{cursor:pointer}.drag{cursor:crosshair}
#detail{margin:4px 24px;padding:8px 12px;border-left:4px solid #1f77b4;background:#f4f6f7;min-height:22px;
white-space:pre-wrap}#detail button{margin-left:10px}#detail a{margin-right:10px}
#tip{position:absolute;background:#1c2833;color:#fff;padding:4px 8px;border-radius:4px;font-size:12px;
white-space:pre;pointer-events:none}
table{border-collapse:collapse;margin:8px 24px 40px;font-size:13px}th,td{text-align:left;padding:4px 10px;
border-bottom:1px solid #e5e8e8;vertical-align:top}th{background:#f4f6f7}tr[data-step]{cursor:pointer}
tr[data-step]:hover{background:#eaf2f8}td.msg{max-width:520px;overflow-wrap:anywhere}.no{color:#a04000}
.problems{color:#a04000;margin:0 24px}
"""

_LEGEND = (
    ("#d62728", "non-finite"),
    ("#ff7f0e", "spike, dumped"),
    ("#ffbb78", "spike, not dumped"),
    ("#9467bd", "precursor (hollow: not dumped)"),
    ("#8c564b", "exception"),
    ("#1f77b4", "dump (filled: replayed)"),
)


def _row(f: Fault, page: Path | None, n: int) -> str:
    dump = f.dump
    if dump is not None and dump.verdict:
        link = _href(dump.report_html or dump.report, page)
        verdict = f"<strong>{escape(dump.verdict)}</strong>: {escape(dump.headline or '')}"
        if link:
            verdict += f' <a href="{escape(link)}">report</a>'
    elif dump is not None:
        verdict = "not replayed yet: <code>forensics replay " + escape(dump.path) + "</code>"
    elif f.dumped:
        verdict = "no dump on disk now (replaced by a larger spike, or its write failed)"
    else:
        verdict = "-"
    dumped = "yes" if f.dumped else f'<span class="no">no</span>: {escape(f.why_not or "?")}'
    first = ", ".join(str(r) for r in f.first_ranks)
    return (
        f'<tr data-step="{f.step}" data-kind="{escape(_kind(f))}" data-marker="f{n}">'
        f"<td>{f.step}</td><td>{escape(f.trigger)}</td><td>{escape(first)} (of {len(f.ranks)})</td>"
        f'<td class="msg">{escape(f.message)}</td><td>{dumped}</td><td class="msg">{verdict}</td></tr>'
    )


def render_timeline_html(t: Timeline, page: Path | None = None) -> str:
    """The page for `t`; `page`: where it will be written (links to reports are made relative to it)."""
    script = _script()
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    csp = f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; img-src data:"
    steps = sum(s.count for log in t.ranks for s in log.steps)
    n_dumps = len(t.dumps)
    replayed = sum(1 for d in t.dumps if d.verdict)
    sub = (
        f"{len(t.ranks)} rank(s) logged of {t.world_size or '?'} · steps {t.first_step}–{t.last_step} "
        f"({steps} logged) · {len(t.faults)} trigger(s) · {n_dumps} dump(s), {replayed} replayed"
    )
    rows = "\n".join(_row(f, page, n) for n, f in enumerate(t.faults))
    legend = "".join(f'<span><i style="background:{c}"></i>{escape(w)}</span>' for c, w in _LEGEND)
    problems = "".join(f"<li>{escape(clean(p))}</li>" for p in t.problems[:50])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{escape(csp)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>run {escape(t.run_id)} — forensics timeline</title>
<style>{_CSS}</style></head>
<body>
<header><h1>Run <code>{escape(t.run_id)}</code></h1><div class="sub">{escape(sub)}</div></header>
<div class="controls"><span id="ranks"></span>
<label><input type="checkbox" id="log" checked> log scale</label>
<span>steps <input type="number" id="from"> to <input type="number" id="to"> <button id="apply">zoom</button>
<button id="reset">whole run</button></span><span id="range"></span>
<span class="legend">{legend}</span></div>
<div id="chart"></div>
<div id="detail">Drag across a lane to zoom; click a marker or a row for its details.</div>
<div id="tip" hidden></div>
<table><thead><tr><th>step</th><th>trigger</th><th>first seen by rank</th><th>what</th><th>dumped</th>
<th>replay verdict</th></tr></thead><tbody>
{rows}
</tbody></table>
{f'<ul class="problems">{problems}</ul>' if problems else ""}
<script type="application/json" id="timeline-data">{_json_block(page_data(t, page))}</script>
<script>{script}</script>
</body></html>
"""
