"""The full report as Markdown (report.md), rendered from the sections of forensics.report.document."""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

from forensics.report.document import Block, Bullets, Code, CodeBlock, Inline, Para, Strong, Table, build_sections
from forensics.report.model import SCHEMA
from forensics.report.tree import Report, parse_report
from forensics.report.wording import clean, fmt_num

log = logging.getLogger(__name__)


# ---- Markdown serialisation ----

_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~$])")
# Block syntax that only matters at the start of a paragraph or list item: "# ", "- ", "+ ", "1. ", "1) ".
_MD_LINE_START = re.compile(r"^(\s*)(?:([#+\-])(?=\s|$)|(\d{1,9})([.)])(?=\s|$))")


def _escape_line_start(m: re.Match) -> str:
    if m.group(2):
        return m.group(1) + "\\" + m.group(2)
    return m.group(1) + m.group(3) + "\\" + m.group(4)


def md_text(text: Any, line_start: bool = True) -> str:
    """Escape text so Markdown shows it literally (no emphasis, links, raw HTML, headings, lists).

    Args:
        text: any text; whitespace runs (newlines included) become one space.
        line_start: the text may start a paragraph or list item (False inside table cells).
    """
    s = clean(re.sub(r"\s+", " ", str(text)))
    s = _MD_SPECIAL.sub(r"\\\1", s)
    return _MD_LINE_START.sub(_escape_line_start, s) if line_start else s


def md_code(text: Any, in_table: bool = False) -> str:
    """An inline code span that holds any text (fence longer than any backtick run inside).

    In a table cell a `|` must be escaped even inside a code span (GitHub-flavoured Markdown)."""
    s = clean(str(text))
    if in_table:
        s = s.replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or not s.strip() else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def _md_inline(parts: list[Inline] | Inline, in_table: bool = False) -> str:
    if not isinstance(parts, list):
        parts = [parts]
    out = []
    for p in parts:
        if isinstance(p, Code):
            out.append(md_code(p.text, in_table))
        elif isinstance(p, Strong):
            out.append(f"**{md_text(p.text, line_start=False)}**")
        else:
            out.append(md_text(p, line_start=not in_table and not out))
    return "".join(out)


def _md_block(block: Block) -> str:
    if isinstance(block, Para):
        return _md_inline(block.parts)
    if isinstance(block, Bullets):
        return "\n".join(f"- {_md_inline(item)}" for item in block.items)
    if isinstance(block, Table):
        header = block.header if any(block.header) else ["field", "value"]
        lines = [
            "| " + " | ".join(md_text(h, line_start=False) for h in header) + " |",
            "|" + "|".join("---" for _ in header) + "|",
        ]
        for row in block.rows:
            lines.append("| " + " | ".join(_md_inline(c, in_table=True) for c in row) + " |")
        return "\n".join(lines)
    if isinstance(block, CodeBlock):
        longest = max((len(run) for run in re.findall(r"`{3,}", block.text)), default=0)
        fence = "`" * max(3, longest + 1)
        return f"{fence}text\n{block.text.rstrip()}\n{fence}"
    return ""  # Plot: HTML only


def render_markdown(report: Mapping | Report) -> str:
    """The full report as Markdown (report.md).

    Sections: verdict and suggestions, where it happened, reproduction, culprit (samples, module,
    op, phase, traceback), precision triage, bisection, per-sample table (top 20 by loss),
    per-layer table (top 20 by grad norm), loss history, environment (with warnings), timings.
    Every string from the report is escaped: a sample id cannot inject Markdown or HTML.

    Args:
        report: a report (forensics.report.tree.Report, or its dict: schema forensics-report/1).
    Returns:
        The Markdown text, ending with a newline.
    Example:
        >>> Path("report.md").write_text(render_markdown(report))  # doctest: +SKIP
    """
    r = parse_report(report)
    title = f"# Forensics report: step {fmt_num(r.dump.step)}, rank {fmt_num(r.dump.rank)}"
    out = [title]
    for sec in build_sections(r):
        out.append(f"## {md_text(sec.title)}")
        out.extend(s for s in (_md_block(b) for b in sec.blocks) if s)
    out.append(f"_Schema {md_text(r.schema or SCHEMA)}; created {md_text(r.created_at or 'n/a')} by forensics._")
    return "\n\n".join(out) + "\n"
