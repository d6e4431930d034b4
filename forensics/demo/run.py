"""The demo driver behind `forensics demo`: train until the Guard captures a planted fault, replay, report.

`run_demo` tells the story in plain words as it goes (training progress, what the Guard caught,
each replay stage, the verdict) through `echo`, and writes report.json / .md / .html.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from forensics.demo.scenarios import DEFAULT_SCENARIO, SCENARIOS, Scenario
from forensics.core.errors import ForensicsError

log = logging.getLogger(__name__)

Echo = Callable[[str], None]

__all__ = ["run_demo", "SCENARIOS", "DEFAULT_SCENARIO", "UnknownScenarioError"]


class UnknownScenarioError(ForensicsError):
    """The scenario name is not in the catalogue (bad input)."""


def get_scenario(name: str) -> Scenario:
    """The scenario called `name`; UnknownScenarioError lists the valid names otherwise."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise UnknownScenarioError(
            f"there is no demo scenario {name!r}; choose one of: {', '.join(SCENARIOS)}"
        ) from None


def run_demo(
    scenario: str = DEFAULT_SCENARIO,
    out_dir: str | Path = "forensics-demo",
    device: str | None = None,
    echo: Echo = print,
) -> tuple[dict, Path]:
    """Runs one planted-fault scenario end to end: train -> automatic capture -> replay -> report.

    Args:
        scenario: a name of `SCENARIOS` (default "bad_sample").
        out_dir: the dump goes to <out_dir>/dumps/<run id>/, the report to <out_dir>/reports/<run id>/.
        device: where to train and replay ("cpu", "cuda:0"); None means "cpu", where the replay is
            bitwise identical to the capture.
        echo: prints one line of progress (the CLI passes click.echo).
    Returns:
        (report, report_dir): the report dict (schema forensics-report/1) and the folder holding
        report.json, report.md, report.html (and blocklist.jsonl when samples are to blame).
    Raises:
        UnknownScenarioError: `scenario` is not in the catalogue.
        ForensicsError: the scenario did not capture a dump, or the replay could not run.
    Example:
        >>> report, report_dir = run_demo("bad_sample", Path("demo-out"))  # doctest: +SKIP
        >>> report["verdict"]["kind"]  # doctest: +SKIP
        'bad_sample'
    """
    chosen = get_scenario(scenario)
    out_dir = Path(out_dir)
    device = device or "cpu"
    started = time.monotonic()

    echo(f"forensics demo — scenario '{chosen.name}': {chosen.description}")
    echo(f"What is planted: {chosen.story}")
    echo("")
    echo(f"1. Training on {device}, with the forensics Guard in the loop (5 added lines) ...")
    captured = chosen.capture(out_dir, device=device, echo=echo)
    echo("")
    echo("2. The Guard caught it and wrote a dump of the step (weights, optimizer, RNG, the micro-batches):")
    echo(f"   {captured.dump_path}")
    echo("")
    echo(f"3. Replaying the dump offline on {device} (what `forensics replay {captured.dump_path}` does) ...")

    from forensics.replay.engine import ReplayOptions, run_replay

    report = run_replay(captured.dump_path, ReplayOptions(device=device), progress=lambda m: echo(f"   - {m}"))
    report_dir = out_dir / "reports" / captured.dump_path.parent.parent.name
    files = _write_report(report, report_dir, echo)
    echo("")
    echo(f"4. Verdict (the planted fault was: {chosen.description}):")
    echo("")
    echo(_verdict_text(report, files).rstrip("\n"))
    echo("")
    echo(f"Demo finished in {time.monotonic() - started:.1f} s.")
    return report, report_dir


def _write_report(report: dict, report_dir: Path, echo: Echo) -> dict:
    try:
        from forensics.report import write_report_files
    except ImportError:  # the report package is optional for the demo: fall back to report.json
        import json

        report_dir.mkdir(parents=True, exist_ok=True)
        path = report_dir / "report.json"
        path.write_text(json.dumps(report, indent=2), encoding="utf-8")
        echo(f"   (forensics.report is not available: wrote {path} only)")
        return {"json": path}
    from forensics.report import write_blocklist

    files = dict(write_report_files(report, report_dir))
    if (report.get("culprit") or {}).get("samples"):
        files["blocklist"] = write_blocklist(report, report_dir / "blocklist.jsonl")
    return files


def _verdict_text(report: dict, files: dict) -> str:
    try:
        from forensics.report import render_verdict_text
    except ImportError:
        verdict, culprit = report.get("verdict") or {}, report.get("culprit") or {}
        lines = [
            f"Verdict: {verdict.get('kind')} — {verdict.get('headline')}",
            f"Samples: {[s.get('sample_id') for s in culprit.get('samples') or []]}",
            f"Where: module {culprit.get('module')}, op {culprit.get('op')}, phase {culprit.get('phase')}, "
            f"parameter {culprit.get('parameter')}",
        ]
        lines += [f"Report: {path}" for path in files.values()]
        return "\n".join(lines)
    return render_verdict_text(report, files=files)
