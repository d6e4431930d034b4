"""Writing report.json / report.md / report.html and the culprit blocklist, each file atomically."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from forensics.core.fsio import atomic_write_text
from forensics.report.model import SCHEMA_KEYS, ReportError, to_json_safe, validate_report
from forensics.report.render_html import render_html
from forensics.report.render_markdown import render_markdown
from forensics.report.run_curve import relative_href, run_page_path
from forensics.report.tree import CulpritSample, Report, parse_report
from forensics.report.wording import fmt_id

log = logging.getLogger(__name__)

REPORT_FILES = {"json": "report.json", "md": "report.md", "html": "report.html"}
BLOCKLIST_NAME = "blocklist.jsonl"


def report_json_text(report: Mapping | Report) -> str:
    """report.json's text: the report tree serialised (forensics.report.tree), JSON-safe, validated, indent 2,
    top-level keys in schema order."""
    safe = to_json_safe(report.as_dict() if isinstance(report, Report) else dict(report))
    validate_report(safe)
    safe = parse_report(safe).as_dict()
    ordered = {k: safe[k] for k in SCHEMA_KEYS if k in safe}
    ordered.update((k, v) for k, v in safe.items() if k not in ordered)  # keys added by newer writers
    return json.dumps(ordered, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def write_report_files(
    report: Mapping | Report, out_dir: str | os.PathLike, *, html: bool = True, plots: bool = True
) -> dict[str, Path]:
    """Validate the report and write report.json, report.md and report.html into `out_dir`.

    The report is first made JSON-safe (non-finite floats -> "nan"/"inf"/"-inf") and validated, so
    nothing is written for an invalid report. Each file is written atomically.

    Args:
        report: the report dict from the replay engine (schema forensics-report/1).
        out_dir: directory to write into (created if missing).
        html: also write report.html (default True).
        plots: put plots into report.html (needs matplotlib; default True).
    Returns:
        {"json": path, "md": path, "html": path} of the files written.
    Raises:
        ReportError: the report is not valid (nothing is written).
    Example:
        >>> files = write_report_files(report, "replay-out")  # doctest: +SKIP
        >>> print(render_verdict_text(report, files=files))  # doctest: +SKIP
    """
    text = report_json_text(report)
    safe = parse_report(json.loads(text))
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create the report directory {out}: {e}") from e
    files = {
        "json": atomic_write_text(out / REPORT_FILES["json"], text),
        "md": atomic_write_text(out / REPORT_FILES["md"], render_markdown(safe)),
    }
    if html:
        page = run_page_path(safe.dump.path, safe.dump.run_id)
        link = relative_href(page, out) if page is not None else None
        files["html"] = atomic_write_text(out / REPORT_FILES["html"], render_html(safe, plots=plots, run_page=link))
    log.info("wrote %s", ", ".join(str(p) for p in files.values()))
    return files


def blocklist_ids(report: Mapping | Report) -> list:
    """The culprit ids a blocklist may hold: never an ID the replay made up from a sample's position in its batch
    (culprit sample `positional`: the job recorded no IDs), which names no record of the dataset, nor an ID that
    other samples of the step carry too and the replay does not blame (`shared_with`): filtering it would drop them."""
    culprit = parse_report(report).culprit
    if any(s.trigger for s in culprit.samples):  # the first to cross on a broken state, not bad data
        return []
    positional = {json.dumps(s.sample_id, default=repr) for s in culprit.samples if s.positional}
    if positional:
        log.warning(
            "%d culprit sample(s) have made-up positional IDs and are left out of the blocklist (the job "
            "recorded no sample IDs for their micro-batch)",
            len(positional),
        )
    shared: dict[str, CulpritSample] = {}
    for s in culprit.samples:
        if s.shared_with and not s.positional:
            shared.setdefault(json.dumps(s.sample_id, default=repr), s)
    for sample in shared.values():
        log.warning(
            "culprit sample %s (micro-batch %s, sample %s) is left out of the blocklist: %d other sample(s) of the "
            "step carry the same ID and are not blamed (first at micro-batch %s, sample %s); filtering the ID "
            "would drop them too",
            fmt_id(sample.sample_id, 80),
            sample.micro_batch,
            sample.index,
            len(sample.shared_with or []),
            *_first_position(sample.shared_with),
        )
    left_out = positional | set(shared)
    return [sid for sid in culprit.ids() if json.dumps(sid, default=repr) not in left_out]


def _first_position(positions: Any) -> tuple[Any, Any]:
    first = positions[0] if isinstance(positions, list) and positions and isinstance(positions[0], dict) else {}
    return first.get("micro_batch"), first.get("index")


def write_blocklist(report: Mapping | Report, path: str | os.PathLike, *, append: bool = False) -> Path:
    """Write the culprit samples' ids to `path`, one JSON value per line (JSON Lines).

    Each line is `json.dumps(sample_id)`, so string ids with newlines or quotes stay one line and
    integer ids stay integers: read back with `[json.loads(l) for l in open(path)]`.
    Duplicates are dropped. With no culprit samples the file is written empty.

    Args:
        report: the report dict.
        path: the blocklist file (e.g. <out_dir>/blocklist.jsonl).
        append: keep the ids already in `path` and add the new ones after them.
    Returns:
        The path written.
    Example:
        >>> write_blocklist(report, "replay-out/blocklist.jsonl")  # doctest: +SKIP
    """
    path = Path(path)
    ids: list[Any] = []
    if append and path.exists():
        for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if line.strip():
                try:
                    ids.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ReportError(
                        f"{path}:{n} is not a JSON value ({e}); fix or remove the "
                        "line, or write a new blocklist without append"
                    ) from e
    for sid in blocklist_ids(to_json_safe(report.as_dict() if isinstance(report, Report) else dict(report))):
        if sid not in ids:
            ids.append(sid)
    if not ids:
        log.warning("the report names no culprit samples with real IDs; writing an empty blocklist at %s", path)
    # ensure_ascii: no raw U+2028 / NEL in a line, which some line splitters treat as line breaks.
    text = "".join(json.dumps(sid, ensure_ascii=True, allow_nan=False) + "\n" for sid in ids)
    return atomic_write_text(path, text)
