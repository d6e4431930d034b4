"""The full report as ONE self-contained HTML file (report.html): inline CSS, plots as data: URIs.

The page loads nothing from anywhere (no scripts at all, no external CSS, fonts or images) and
says so to the browser with a Content-Security-Policy. Every string from the report is escaped
with html.escape: a sample id comes from the training data and may hold markup.
"""

from __future__ import annotations

import base64
import logging
from html import escape
from typing import Mapping

from forensics.core.kinds import VerdictKind
from forensics.report.model import SCHEMA
from forensics.report.plots import PLOTS, matplotlib_available, render_plots
from forensics.report.document import (
    Block,
    Bullets,
    Code,
    CodeBlock,
    Inline,
    Para,
    Plot,
    Section,
    Strong,
    Table,
    build_sections,
)
from forensics.report.run_curve import curve_svg
from forensics.report.tree import Report, parse_report
from forensics.report.wording import clean, fmt_num, verdict_label

log = logging.getLogger(__name__)

_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1c2833;
  max-width:1100px;margin:0 auto;padding:1.5em 2em 4em;background:#fdfefe}
h1{font-size:1.6em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #d5d8dc}
.verdict{padding:.8em 1.2em;border-radius:6px;margin:1em 0;border-left:6px solid #7f8c8d;background:#f4f6f6}
.verdict.found{border-color:#c0392b;background:#fdedec} .verdict.none{border-color:#e67e22;background:#fef5e7}
.verdict.notrepro{border-color:#2e86c1;background:#ebf5fb}
.kind{font-weight:700;text-transform:uppercase;letter-spacing:.05em;font-size:.85em}
.headline{font-size:1.15em;margin-top:.3em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #d5d8dc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f2f3f4} tr.hit td{background:#fdedec;font-weight:600}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.9em}
code{background:#f2f3f4;padding:0 .25em;border-radius:3px;word-break:break-all}
pre{background:#f8f9f9;border:1px solid #d5d8dc;padding:.8em;overflow-x:auto;white-space:pre-wrap}
img.plot{max-width:100%;border:1px solid #eaeded;margin:.6em 0}
.note{color:#7f8c8d;font-size:.9em} nav a{margin-right:.8em}
"""


def verdict_css_class(kind: object) -> str:
    """The CSS class of the verdict box: VerdictKind.outcome ('found', 'none', 'notrepro'); '' if unknown."""
    try:
        return VerdictKind(kind).outcome
    except ValueError:
        return ""


def _inline(parts: list[Inline] | Inline) -> str:
    if not isinstance(parts, list):
        parts = [parts]
    out = []
    for p in parts:
        if isinstance(p, Code):
            out.append(f"<code>{escape(clean(p.text))}</code>")
        elif isinstance(p, Strong):
            out.append(f"<strong>{escape(clean(p.text))}</strong>")
        else:
            out.append(escape(clean(p)))
    return "".join(out)


def _block(block: Block, plots: Mapping[str, bytes], plots_note: str | None) -> str:
    if isinstance(block, Para):
        return f"<p>{_inline(block.parts)}</p>"
    if isinstance(block, Bullets):
        return "<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in block.items) + "</ul>"
    if isinstance(block, Table):
        head = ""
        if any(block.header):
            head = "<thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in block.header) + "</tr></thead>"
        body = []
        for i, row in enumerate(block.rows):
            hit = i < len(block.highlight) and block.highlight[i]
            cells = "".join(
                (f"<th>{_inline(c)}</th>" if not any(block.header) and j == 0 else f"<td>{_inline(c)}</td>")
                for j, c in enumerate(row)
            )
            tr = '<tr class="hit">' if hit else "<tr>"
            body.append(f"{tr}{cells}</tr>")
        return f"<table>{head}<tbody>{''.join(body)}</tbody></table>"
    if isinstance(block, CodeBlock):
        return f"<pre>{escape(block.text)}</pre>"
    if isinstance(block, Plot):
        png = plots.get(block.name)
        if png is None:
            return f'<p class="note">{escape(plots_note)}</p>' if plots_note else ""
        alt = PLOTS[block.name][0] if block.name in PLOTS else block.name
        data = base64.b64encode(png).decode("ascii")
        return f'<img class="plot" alt="{escape(alt)}" src="data:image/png;base64,{data}">'
    return ""


def _section(sec: Section, plots: Mapping[str, bytes], plots_note: str | None) -> str:
    anchor = escape(sec.anchor or sec.title.lower().replace(" ", "-"))
    parts = [f'<section id="{anchor}"><h2>{escape(sec.title)}</h2>']
    if sec.anchor == "verdict":
        parts.append(_verdict_box(sec))
    else:
        parts.extend(_block(b, plots, plots_note) for b in sec.blocks)
    parts.append("</section>")
    return "\n".join(parts)


def _verdict_box(sec: Section) -> str:
    """The verdict section: its first paragraph (label + headline) styled as a box."""
    first, rest = sec.blocks[0], sec.blocks[1:]
    out = []
    if isinstance(first, Para) and first.parts and isinstance(first.parts[0], Strong):
        out.append(
            f'<div class="kind">{escape(clean(first.parts[0].text))}</div>'
            f'<div class="headline">{_inline(first.parts[1:])}</div>'
        )
    else:
        out.append(_block(first, {}, None))
    out.extend(_block(b, {}, None) for b in rest)
    return "\n".join(out)


def render_html(report: Mapping | Report, *, plots: bool = True, run_page: str | None = None) -> str:
    """The full report as one self-contained HTML page (report.html).

    Same sections as report.md, plus plots (matplotlib, Agg): loss / grad-norm history with the
    trigger step marked, per-layer grad norm / output abs-max bars, per-sample loss bars with the
    culprit highlighted. Plots are inline `data:image/png;base64` images. If matplotlib is not
    installed (or plots=False) the page is rendered without them and says so.

    Args:
        report: a report dict (schema forensics-report/1).
        plots: draw plots (default True).
        run_page: the link (relative to this page) to the run page of `forensics timeline`, shown with the run's
            curve around this step (forensics/report/run_curve.py); None: the curve alone.
    Returns:
        The HTML text. It references nothing outside itself.
    Example:
        >>> Path("report.html").write_text(render_html(report), encoding="utf-8")  # doctest: +SKIP
    """
    r = parse_report(report)
    images: dict[str, bytes] = render_plots(r) if plots else {}
    if not plots:
        note = "Plots were not requested."
    elif not images and _has_plot_data(r):
        note = (
            "Plots are missing: matplotlib is not installed (pip install matplotlib)."
            if not matplotlib_available()
            else "Plots could not be drawn; see the log."
        )
    else:
        note = None

    kind = r.verdict.kind or ""
    title = f"Forensics report: step {fmt_num(r.dump.step)}, rank {fmt_num(r.dump.rank)}"
    sections = build_sections(r)
    nav = " ".join(f'<a href="#{escape(s.anchor)}">{escape(s.title.split(" (")[0])}</a>' for s in sections if s.anchor)
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="note">{escape(verdict_label(kind))} · created {escape(clean(r.created_at or "n/a"))}</p>',
        f"<nav>{nav}</nav>",
    ]
    if note and not images:
        body.append(f'<p class="note">{escape(note)}</p>')
    for sec in sections:
        html_sec = _section(sec, images, note if images else None)
        if sec.anchor == "verdict":
            html_sec = html_sec.replace(
                '<section id="verdict">', f'<section id="verdict" class="verdict {verdict_css_class(kind)}">', 1
            )
        body.append(html_sec)
        if sec.anchor == "verdict":
            body.append(_run_section(r, run_page))
    body.append(
        f'<p class="note">Schema {escape(clean(r.schema or SCHEMA))}. '
        "This page is self-contained: it loads nothing from the network.</p>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def _run_section(r: Report, run_page: str | None) -> str:
    """The run around this step: the history ring's curve and the link back to the run page."""
    history = r.history
    svg = curve_svg(history.step, history.loss, history.grad_norm, r.dump.step) if history else ""
    if run_page:
        link = f'<a href="{escape(run_page)}">the whole run: every rank, every spike, dump and verdict</a>'
    else:
        link = "<code>forensics timeline DUMP_DIR</code> shows the whole run (every rank, spike, dump and verdict)"
    return f'<section id="run"><h2>The run around this step</h2><p>{link}</p>{svg}</section>'


def _has_plot_data(r: Report) -> bool:
    return bool((r.history and r.history.step) or r.per_layer or r.per_sample or (r.precursor and r.precursor.series))
