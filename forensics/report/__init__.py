"""The report of a replay (schema "forensics-report/1", docs/REPORT_FORMAT.md): model, renderers, writers."""

from forensics.report.model import (
    SCHEMA,
    VERDICT_KINDS,
    ReportError,
    as_float,
    load_report,
    to_json_safe,
    validate_report,
)
from forensics.report.render_html import render_html
from forensics.report.render_markdown import render_markdown
from forensics.report.render_text import render_verdict_text
from forensics.report.tree import Report, parse_report
from forensics.report.write import write_blocklist, write_report_files

__all__ = [
    "SCHEMA",
    "VERDICT_KINDS",
    "Report",
    "ReportError",
    "as_float",
    "load_report",
    "parse_report",
    "render_html",
    "render_markdown",
    "render_verdict_text",
    "to_json_safe",
    "validate_report",
    "write_blocklist",
    "write_report_files",
]
