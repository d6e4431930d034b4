"""Replay the dumps the tests make with two versions of the code and say whether their report.json files agree.

For a change that must not change what a report says (a refactor of the verdict, of the replay's stages):

    git worktree add --detach /tmp/base main
    PYTHONPATH=/tmp/base  python scripts/compare_reports.py make   WORK        # the dumps, made by the old code
    PYTHONPATH=/tmp/base  python scripts/compare_reports.py replay WORK old
    PYTHONPATH=$PWD       python scripts/compare_reports.py replay WORK new
    python scripts/compare_reports.py diff WORK old new                          # exit 1 when a report differs

The dumps: every `forensics demo` scenario; tests/natural's lr_too_high run with precursors (a crash dump whose
verdict gets the history before it, the precursor dump, the spike dump); tests/replay/test_window.py's runs replayed
from a checkpoint before the broken step, from the broken step itself (the window's start), from the Guard's host
snapshot, and without --trust (the snapshot it could not use); tests/capture/test_between_steps.py's exception
between steps. `diff` leaves out only the fields that time the run (`created_at`, `timings`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("bad_sample", "log_zero", "fp16_overflow", "adam_eps_zero", "pair", "sdc", "dropout_mask", "spike")
TIMING = {"created_at", "timings"}
WINDOW_DUMP = "dumps/win/step-000000007/rank-00000"


def make(work: Path) -> None:
    """The dumps, made by the code on PYTHONPATH."""
    import torch
    from click.testing import CliRunner

    from forensics.cli import main

    for scenario in SCENARIOS:
        CliRunner().invoke(
            main, ["demo", "--scenario", scenario, "-o", str(work / f"demo_{scenario}"), "--device", "cpu"]
        )
    job = [sys.executable, str(ROOT / "tests/natural/natural_job.py"), str(work / "natural"), "--scenario"]
    subprocess.run([*job, "lr_too_high", "--precursors"], check=False)
    sys.path[:0] = [str(ROOT / "tests/replay"), str(ROOT / "tests/capture"), str(ROOT)]
    import window_job  # type: ignore[import-not-found]  # tests/replay, put on sys.path above

    from tests.capture.test_between_steps import train_until_the_index_error
    from tests.replay.test_window import train

    for name, checkpoint_step, extra, momentum in (
        ("win_ckpt2", 2, {}, 0.0),
        ("win_ckpt5", 5, {}, 0.0),
        ("win_snap", 4, {"window_steps": 8, "snapshot_every": 2}, 0.5),
    ):
        (work / name).mkdir(parents=True, exist_ok=True)
        sgd = lambda model, m=momentum: torch.optim.SGD(model.parameters(), lr=0.05, momentum=m)  # noqa: E731
        train(window_job, work / name, sgd, checkpoint_step=checkpoint_step, **extra)
    (work / "between").mkdir(parents=True, exist_ok=True)
    train_until_the_index_error(work / "between", {})


def cases(work: Path) -> dict[str, list[str]]:
    """Each replay: its name and `forensics replay` arguments."""
    out = {}
    for dump in sorted(work.glob("demo_*/dumps/*/step-*/rank-*")):
        out[f"{dump.parts[-5]}_{dump.parts[-3]}"] = [str(dump), "--device", "cpu", "--trust"]
    for dump in sorted(work.glob("natural/*/step-*/rank-*")):
        out[f"natural_{dump.parent.name}"] = [
            str(dump),
            "--device",
            "cpu",
            "--trust",
            "--path",
            str(ROOT / "tests/natural"),
        ]
    window = ["--device", "cpu", "--trust", "--path", str(ROOT / "tests/replay"), "--no-rng-check"]
    for name in ("win_ckpt2", "win_ckpt5"):
        out[name] = [str(work / name / WINDOW_DUMP), "--from", str(work / name / "step.pt"), *window]
    out["win_snap"] = [str(work / "win_snap" / WINDOW_DUMP), *window]
    out["win_snap_untrusted"] = [
        str(work / "win_snap" / WINDOW_DUMP),
        *("--device", "cpu", "--factory", "window_job:make_model", "--loss", "window_job:mse_loss"),
        *("--path", str(ROOT / "tests/replay"), "--no-rng-check", "--no-remedies"),
    ]
    for dump in sorted(work.glob("between/dumps/*/step-*/rank-*")):
        out["between"] = [str(dump), "--device", "cpu"]
    return out


def replay(work: Path, label: str) -> None:
    """Replays every case with the code on PYTHONPATH into WORK/LABEL/<case>/report.json."""
    from click.testing import CliRunner

    from forensics.cli import main

    for name, args in cases(work).items():
        result = CliRunner().invoke(main, ["replay", *args, "-o", str(work / label / name)])
        print(f"{name}: exit {result.exit_code}", flush=True)


def _untimed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def diff(work: Path, old: str, new: str) -> int:
    """0 when every report of `old` has its twin in `new`, equal but for timing; 1 otherwise (what differs printed)."""
    differ = 0
    reports = sorted((work / old).glob("*/report.json"))
    for report in reports:
        twin = work / new / report.parent.name / "report.json"
        a = _untimed(json.loads(report.read_text()))
        b = _untimed(json.loads(twin.read_text())) if twin.exists() else {}
        if a != b:
            differ += 1
            print(f"DIFFERENT {report.parent.name}" + ("" if twin.exists() else f": no report in {new}"))
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    print(f"  {key}:\n    {old}: {str(a.get(key))[:400]}\n    {new}: {str(b.get(key))[:400]}")
    print(f"{len(reports) - differ} of {len(reports)} reports equal but for timing")
    return 1 if differ or not reports else 0


if __name__ == "__main__":
    command, work = sys.argv[1], Path(sys.argv[2])
    if command == "make":
        make(work)
    elif command == "replay":
        replay(work, sys.argv[3])
    elif command == "diff":
        sys.exit(diff(work, sys.argv[3], sys.argv[4]))
    else:
        sys.exit(f"unknown command {command!r}: make, replay or diff")
