"""The report of a precursor dump: which layer and which statistic started to grow first, and what usually fixes it.

A precursor dump (trigger `precursor`, capture/precursors/monitor.py) holds a healthy step: nothing to reproduce.
Its report is built from the statistics the job recorded (`precursors.json`): each (layer, statistic) series is
walked with the same robust trend rule as in the job (forensics/core/trend.py) but with a lower bar (REPORT_Z, the
square root of the job's growth), so the step each one *started* to leave its baseline is found; the series are
ranked by that step (earliest first), then by how far they have grown. The verdict (`instability_ahead`) names the
first, the report's `precursor` block lists the ranking and the series of the leading ones (plotted in
report.html), and the suggestions are the usual fixes of the statistics that grew. Nothing is imported from the
dump: no --trust needed, no model built.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from datetime import datetime, timezone
from typing import Any

import torch

from forensics.core.headroom import Limit, limit_of, percent_of
from forensics.core.kinds import FidelityMode, PrecursorStatistic, TriggerKind
from forensics.report.model import schema_for, to_json_safe
from forensics.report.tree import (
    CaptureEnv,
    Culprit,
    DumpInfo,
    Environment,
    Fidelity,
    History,
    Precursor,
    ReplayEnv,
    Report,
    Stats,
    Timings,
    TriggerBlock,
)
from forensics.core.trigger import Trigger
from forensics.report.wording import fmt_num
from forensics.core.trend import RobustTrend
from forensics.replay.judge.findings import HistoryFinding
from forensics.replay.judge.verdict_unreplayed import instability_ahead
from forensics.replay.load.environment import replay_environment

REPORT_Z = 3.0  # robust z that counts as 'left the baseline' when looking for where a growth started
MAX_RANKED = 12  # rows of the ranking in the report
PLOTTED = 6  # series kept in the report for the plot


def rank_growth(table: dict) -> list[dict]:
    """Every (layer, statistic) whose series left its baseline and stayed out, earliest start first (then the
    larger growth): `{"layer", "statistic", "words", "started", "baseline", "last", "growth"}`; growth is last /
    baseline (baseline / last for a falling statistic)."""
    config = table.get("config") or {}
    window = _int(config.get("window"), 32)
    # the baseline: the rows of the job's own warm-up still in the window, else the window's first half
    in_warmup = sum(1 for s in table["steps"] if s < _int(config.get("warmup"), 64))
    warmup = in_warmup if in_warmup >= 4 else max(4, len(table["steps"]) // 2)
    sustained = _int(config.get("sustained"), 4)
    growth = max(1.0 + 1e-6, math.sqrt(_float(config.get("min_growth"), 2.0)))
    rows = []
    for j, column in enumerate(table["columns"]):
        stat = _statistic(column.get("statistic"))
        if stat is None:
            continue
        trend = RobustTrend(window, warmup, sustained, REPORT_Z, growth, stat.rising)
        series = [(s, row[j]) for s, row in zip(table["steps"], table["values"])]
        found = next((e for s, v in series if (e := trend.observe(s, v)) is not None), None)
        last = next((v for _, v in reversed(series) if v is not None and math.isfinite(v)), None)
        if found is None or last is None:
            continue
        ratio = last / found.baseline if stat.rising else found.baseline / max(last, 1e-38)
        if found.baseline <= 0 or ratio < growth:
            continue  # it came back: not growing at the dumped step
        rows.append(
            {
                "layer": column["layer"],
                "statistic": stat.value,
                "words": stat.words,
                "started": found.started,
                "baseline": found.baseline,
                "last": last,
                "growth": ratio,
            }
        )
    rows.sort(key=lambda r: (r["started"], -math.log(max(r["growth"], 1e-300))))
    return rows


def precursor_report(dump: Any, dump_info: dict, history: HistoryFinding, started: float) -> Report:
    """The report (schema forensics-report/3, verdict `instability_ahead`) of a precursor dump."""
    table = dump.precursors() or {"columns": [], "steps": [], "values": [], "firings": [], "config": {}}
    ranking = rank_growth(table)
    # the firing this dump was made for: read at this step, or (a state sharded over the ranks, dumped by every rank
    # together) at the step before
    fired = next(
        (
            f
            for f in reversed(table["firings"])
            if f.get("dumped") and isinstance(f.get("step"), int) and dump.step - 1 <= f["step"] <= dump.step
        ),
        None,
    )
    trigger = dataclasses.replace(dump.trigger, kind=TriggerKind.PRECURSOR, micro_batch=None)
    verdict = instability_ahead(
        dump.step, ranking, fired, len(table["columns"]), local=trigger.local, limit=_fired_limit(fired, table)
    )
    lead = ranking[0] if ranking else fired or {}
    return Report.built(
        schema=schema_for(str(verdict.kind)),
        created_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        dump=DumpInfo.parse(to_json_safe(dump_info)),
        trigger=TriggerBlock.of(trigger),
        environment=Environment.built(
            capture=CaptureEnv.parse(to_json_safe(dump.manifest.get("environment") or {})),
            replay=ReplayEnv.parse(to_json_safe(replay_environment(torch.device("cpu")))),
            warnings=[],
        ),
        reproduced=False,
        fidelity=Fidelity.built(
            mode=FidelityMode.NOT_REPLAYED.value,
            reason="a precursor dump holds a healthy step: the report is built from the statistics the job recorded",
        ),
        verdict=verdict,
        culprit=Culprit(samples=[], module=lead.get("layer"), stats=Stats()),
        history=History.parse(to_json_safe(history.block)) if history.block is not None else None,
        history_pattern=history.pattern.value,
        precursor=Precursor.parse(
            to_json_safe(
                {
                    "fired": fired,
                    "ranking": ranking[:MAX_RANKED],
                    "ranked": len(ranking),
                    "columns": len(table["columns"]),
                    "steps": table["steps"],
                    "series": _series(table, ranking[:PLOTTED]),
                    "config": table["config"],
                }
            )
        ),
        timings=Timings(total_s=round(time.monotonic() - started, 3), passes=0),
    )


def _fired_limit(fired: dict | None, table: dict) -> Limit | None:
    """The limit of the fired statistic's dtype (forensics/core/headroom.py), from the column's dtype and the
    recorded head_dim; None when the firing names no statistic this forensics knows, or its dtype has none."""
    stat = _statistic((fired or {}).get("statistic"))
    if fired is None or stat is None:
        return None
    column: dict = next(
        (c for c in table["columns"] if c.get("layer") == fired.get("layer") and c.get("statistic") == stat.value), {}
    )
    head = (table.get("config") or {}).get("head_dim")
    return limit_of(
        stat,
        column.get("dtype") if isinstance(column.get("dtype"), str) else None,
        head if isinstance(head, int) and not isinstance(head, bool) else None,
    )


def _series(table: dict, rows: list[dict]) -> list[dict]:
    index = {(c["layer"], c["statistic"]): j for j, c in enumerate(table["columns"])}
    out = []
    for row in rows:
        j = index[(row["layer"], row["statistic"])]
        out.append(
            {
                "layer": row["layer"],
                "statistic": row["statistic"],
                "started": row["started"],
                "baseline": row["baseline"],
                "values": [values[j] for values in table["values"]],
            }
        )
    return out


def _statistic(value: Any) -> PrecursorStatistic | None:
    try:
        return PrecursorStatistic(value)
    except ValueError:
        return None


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100_000 else default


def _float(value: Any, default: float) -> float:
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 1
        else default
    )


# -- the crash dump of a job with precursors on: what its statistics did before, and the run's earlier dumps ----------
HISTORY_SPAN = 80  # steps before the crash the growth sentence looks back over
MAX_EARLIER = 8  # earlier dumps of the run named in the report
_STEP_DIR = re.compile(r"step-([0-9]{1,12})")  # fullmatch: `$` would accept a name ending in a newline


def crash_history(dump: Any) -> dict | None:
    """The report's `precursor_history` block of a crash dump whose job recorded precursor statistics (None: it has
    none): the statistic closest to its dtype's limit (else the one that grew first), in one sentence — "the
    attention-logit bound of `layers.0` grew 2.6x over the 80 steps before, to 79 % of fp16's max" — what fired, and
    the run's earlier dumps (sibling `step-*` directories of the same run id, read from the directory listing: no
    name from a dump is used as a path). Never raises on a damaged table."""
    try:
        table = dump.precursors()
    except Exception:  # noqa: BLE001 - an optional part: the report goes on without it
        return None
    if not table or not table["steps"]:
        return None
    lead = _closest_to_limit(table) or _first_grown(table)
    fired = [
        {k: f.get(k) for k in ("step", "layer", "statistic", "rule", "dumped")}
        for f in table["firings"]
        if isinstance(f.get("step"), int)
    ][-MAX_RANKED:]
    earlier = earlier_dumps(dump)
    sentence = lead["sentence"] if lead else None
    if earlier:
        named = ", ".join(f"step {d['step']} ({d['trigger']})" for d in earlier)
        sentence = ((sentence + ". ") if sentence else "") + f"Earlier dumps of this run: {named}"
    return {"sentence": sentence, "lead": lead, "fired": fired, "earlier_dumps": earlier}


def _series_of(table: dict, j: int, since: int) -> list[tuple[int, float]]:
    return [
        (s, row[j])
        for s, row in zip(table["steps"], table["values"])
        if s >= since and isinstance(row[j], (int, float)) and math.isfinite(row[j]) and row[j] > 0
    ]


def _closest_to_limit(table: dict) -> dict | None:
    """The statistic measured in a low-precision dtype that came closest to its limit (forensics/core/headroom.py)."""
    since = table["steps"][-1] - HISTORY_SPAN
    head = (table.get("config") or {}).get("head_dim")
    head = head if isinstance(head, int) and not isinstance(head, bool) else None
    best = None
    for j, column in enumerate(table["columns"]):
        stat, limit = _statistic(column.get("statistic")), column.get("limit")
        if stat is None or not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit > 0:
            continue
        series = _series_of(table, j, since)
        if len(series) < 2:
            continue
        (s0, v0), (s1, v1) = series[0], series[-1]
        share = v1 / limit
        if best is None or share > best["share"]:
            known = limit_of(stat, column.get("dtype") if isinstance(column.get("dtype"), str) else None, head)
            words = known.words if known is not None else "its dtype's limit"  # never the dump's own text
            best = {
                "layer": column["layer"],
                "statistic": stat.value,
                "first": v0,
                "last": v1,
                "growth": v1 / v0,
                "span": s1 - s0,
                "share": share,
                "limit": float(limit),
                "dtype": column.get("dtype"),
                "sentence": (
                    f"the {stat.words} of `{column['layer']}` grew {fmt_num(v1 / v0, 2)}x over the "
                    f"{s1 - s0} steps before, to {percent_of(v1, limit)} of {words}"
                ),
            }
    return best


def _first_grown(table: dict) -> dict | None:
    ranking = rank_growth(table)
    if not ranking:
        return None
    r = ranking[0]
    direction = "grew" if PrecursorStatistic(r["statistic"]).rising else "fell"
    return {
        "layer": r["layer"],
        "statistic": r["statistic"],
        "first": r["baseline"],
        "last": r["last"],
        "growth": r["growth"],
        "span": None,
        "share": None,
        "limit": None,
        "dtype": None,
        "sentence": (
            f"the {r['words']} of `{r['layer']}` {direction} first, from step {r['started']} "
            f"({fmt_num(r['baseline'])} -> {fmt_num(r['last'])}, {fmt_num(r['growth'], 3)}x)"
        ),
    }


def earlier_dumps(dump: Any) -> list[dict]:
    """The run's dumps before this one: sibling `step-*` directories (by the listing's names only) whose rank
    dump's manifest has the same run id; newest first, at most MAX_EARLIER. [] when the dump is not in a run
    directory (an archive, a copy elsewhere)."""
    from forensics.format.location import Location, as_location
    from forensics.format.reader import read_manifest

    here: Location = as_location(getattr(dump, "path", "") or "")  # on disk or in object storage
    run_id, step = dump.manifest.get("run_id"), dump.step
    if not here.name.startswith("rank-") or not here.parent.is_dir():
        return []
    run_dir = here.parent.parent
    found = []
    try:
        entries = sorted((int(m.group(1)), e) for e in run_dir.iterdir() if (m := _STEP_DIR.fullmatch(e.name)))
    except OSError:
        return []
    for number, entry in reversed(entries):
        if number >= step or entry.is_symlink() or not entry.is_dir():
            continue
        rank = entry / here.name
        try:
            manifest = read_manifest(
                rank
                if rank.is_dir() and not rank.is_symlink()
                else next(
                    p
                    for p in sorted(list[Location](entry.iterdir()), key=str)
                    if p.name.startswith("rank-") and p.is_dir() and not p.is_symlink()
                )
            )
        except Exception:  # noqa: BLE001 - a damaged or partial neighbour is simply not named
            continue
        if manifest.get("run_id") != run_id:
            continue
        try:  # read_manifest checked the kind: a newer one is refused there
            kind = Trigger.from_dict(manifest.get("trigger")).kind.value
        except ValueError:
            kind = "unknown"
        found.append({"step": number, "trigger": kind, "path": str(entry)})
        if len(found) >= MAX_EARLIER:
            break
    return found


def crash_history_block(dump: Any) -> dict | None:
    """A crash dump's `precursor_history` block (the growth before, the earlier dumps to compare with), or None;
    its `sentence`, when set, closes the verdict's explanation (replay/judge/verdict_context.crash_history_words)."""
    block = crash_history(dump)
    if block is not None:
        return block
    earlier = earlier_dumps(dump)
    if not earlier:
        return None
    return {
        "sentence": "Earlier dumps of this run: " + ", ".join(f"step {d['step']} ({d['trigger']})" for d in earlier),
        "lead": None,
        "fired": [],
        "earlier_dumps": earlier,
    }
