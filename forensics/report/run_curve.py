"""The run around a dump in its report.html: an inline SVG of the dump's own history ring (loss and grad norm, the
dumped step marked) and the link back to the run page (`forensics timeline`, written by default to
`<dump_dir>/runlogs/<run_id>/run.html`). Plain SVG markup, no script: the report's policy allows none."""

from __future__ import annotations

import math
import os
import urllib.parse
from html import escape
from pathlib import Path
from typing import Any

from forensics.format import run_log as fmt
from forensics.format.location import is_url
from forensics.format.manifest import safe_name

RUN_PAGE = "run.html"


def run_page_path(dump_path: str | None, run_id: str | None) -> Path | None:
    """Where `forensics timeline` writes the run page of a local dump's run by default (None: not local)."""
    if not dump_path or is_url(dump_path) or not safe_name(run_id):
        return None
    path = Path(dump_path)
    step_dir = path.parent if path.name.startswith("rank-") else path
    if not step_dir.name.startswith("step-"):
        return None
    return step_dir.parent.parent / fmt.DIR_NAME / str(run_id) / RUN_PAGE


def relative_href(target: Path, page_dir: Path) -> str | None:
    try:
        return urllib.parse.quote(Path(os.path.relpath(target.resolve(), page_dir.resolve())).as_posix())
    except ValueError:
        return None


def _finite(values: list | None) -> list[float | None]:
    out: list[float | None] = []
    for v in values or []:
        f = v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        out.append(float(f) if f is not None and math.isfinite(f) and f > 0 else None)
    return out


def curve_svg(steps: list | None, losses: list | None, grad_norms: list | None, mark: Any, width: int = 640) -> str:
    """Loss and grad norm (log scale) over the ring's steps, the dumped step marked; "" when there is nothing."""
    steps = [s for s in steps or [] if isinstance(s, int) and not isinstance(s, bool)]
    if len(steps) < 2:
        return ""
    height, pad = 150, 28
    x0, x1 = steps[0], steps[-1]
    span = max(1, x1 - x0)
    parts = [f'<svg class="run-curve" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    lanes = (("loss", _finite(losses), "#1f77b4"), ("grad norm", _finite(grad_norms), "#2ca02c"))
    for n, (name, values, color) in enumerate(lanes):
        points = [(s, v) for s, v in zip(steps, values) if v is not None]
        if not points:
            continue
        lo, hi = math.log10(min(v for _, v in points)), math.log10(max(v for _, v in points))
        hi = hi if hi > lo else lo + 1
        top, h = 6 + n * (height - pad) / 2, (height - pad) / 2 - 10
        path = " ".join(
            f"{'M' if i == 0 else 'L'}{pad + (s - x0) / span * (width - 2 * pad):.1f},"
            f"{top + h - (math.log10(v) - lo) / (hi - lo) * h:.1f}"
            for i, (s, v) in enumerate(points)
        )
        parts.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="1.3"/>')
        parts.append(f'<text x="{pad}" y="{top + 10:.0f}" font-size="11" fill="{color}">{escape(name)} (log)</text>')
    if isinstance(mark, int) and x0 <= mark <= x1:
        mx = pad + (mark - x0) / span * (width - 2 * pad)
        parts.append(f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="4" y2="{height - pad + 4}" stroke="#d62728"/>')
    parts.append(f'<text x="{pad}" y="{height - 6}" font-size="11" fill="#566573">step {x0}</text>')
    parts.append(
        f'<text x="{width - pad}" y="{height - 6}" font-size="11" fill="#566573" text-anchor="end">{x1}</text>'
    )
    parts.append("</svg>")
    return "".join(parts)
