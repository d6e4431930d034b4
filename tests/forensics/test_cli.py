"""The command line, driven in-process with click's CliRunner: every row of README's exit-code table,
and the bad-input paths (missing, not a dump, tampered, untrusted recipe, unwritable outputs) exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import forensics.commands.summary
from forensics.cli import main
from forensics.demo.scenarios import SCENARIOS
from forensics.core.kinds import ExitCode, VerdictKind


def invoke(args: list[str], exit_code: int):
    """Runs `forensics ARGS`; on an unexpected exit code shows stdout, stderr and the exception."""
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    assert result.exit_code == exit_code, (
        f"forensics {' '.join(map(str, args))} exited {result.exit_code}, expected {exit_code}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}\n--- exception\n{result.exception!r}"
    )
    return result


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """Three real captures whose replays end in the three replay exit codes."""
    root = tmp_path_factory.mktemp("cli")
    return {
        name: SCENARIOS[name].capture(root / name, device="cpu").dump_path
        for name in ("bad_sample", "sdc", "dropout_mask")
    }


@pytest.mark.parametrize(
    "scenario, verdict",
    [
        ("bad_sample", VerdictKind.BAD_SAMPLE),
        ("sdc", VerdictKind.NOT_REPRODUCED),
        ("dropout_mask", VerdictKind.MODEL_STATE),
    ],
)
def test_replay_exits_with_its_verdict_kinds_code(dumps, tmp_path, scenario, verdict):
    out = tmp_path / "report"
    result = invoke(
        [
            "replay",
            dumps[scenario],
            "--device",
            "cpu",
            "--no-rng-check",
            "-o",
            out,
            "--blocklist",
            tmp_path / "blocklist.jsonl",
        ],
        exit_code=verdict.exit_code,
    )
    assert f"Verdict: {verdict.label}" in result.stdout
    assert json.loads((out / "report.json").read_text())["verdict"]["kind"] == verdict.value
    assert (out / "report.md").is_file() and (out / "report.html").is_file()


def test_the_blocklist_the_verdict_mentions_is_written_next_to_the_report(dumps, tmp_path):
    out = tmp_path / "report"
    result = invoke(["replay", dumps["bad_sample"], "--device", "cpu", "--no-rng-check", "-o", out], exit_code=0)
    report = json.loads((out / "report.json").read_text())
    culprits = [s["sample_id"] for s in report["culprit"]["samples"]]
    assert culprits and [json.loads(line) for line in (out / "blocklist.jsonl").read_text().splitlines()] == culprits
    assert report["verdict"]["kind"] == "bad_sample" and report["evidence"]["bad_data"] is True
    assert any(s.startswith("Filter") and "blocklist.jsonl" in s for s in report["verdict"]["suggestions"])
    assert str(out / "blocklist.jsonl") in result.stdout


def test_every_verdict_kind_has_one_of_the_documented_replay_codes():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for kind in VerdictKind:
        assert kind.exit_code in (ExitCode.OK, ExitCode.NOT_REPRODUCED, ExitCode.NO_CULPRIT)
        row = next(line for line in readme.splitlines() if line.startswith(f"| {int(kind.exit_code)} |"))
        assert kind.value in row or kind.exit_code is ExitCode.NOT_REPRODUCED, row


def test_inspect_verify_and_pack_a_good_dump(dumps, tmp_path):
    dump = dumps["bad_sample"]
    assert "step" in invoke(["inspect", dump], exit_code=0).stdout
    assert json.loads(invoke(["inspect", dump, "--json"], exit_code=0).stdout)
    assert "intact" in invoke(["verify", dump], exit_code=0).stdout
    archive = tmp_path / "dump.tar.zst"
    invoke(["pack", dump, "-o", archive], exit_code=0)
    assert "intact" in invoke(["verify", archive], exit_code=0).stdout


def test_bad_input_exits_2_with_a_message(dumps, tmp_path):
    missing = invoke(["inspect", tmp_path / "nope"], exit_code=ExitCode.BAD_INPUT)
    assert "Error:" in missing.stderr
    (tmp_path / "empty").mkdir()
    invoke(["verify", tmp_path / "empty"], exit_code=ExitCode.BAD_INPUT)
    invoke(["replay", tmp_path / "empty", "--device", "cpu"], exit_code=ExitCode.BAD_INPUT)


def test_tampered_dump_fails_verification_with_exit_2(dumps, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dumps["bad_sample"], copy)
    model = copy / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    result = invoke(["verify", copy], exit_code=ExitCode.BAD_INPUT)
    assert "model.safetensors" in result.stderr


def test_untrusted_or_unimportable_recipe_and_missing_gpu_exit_2(dumps):
    dump = dumps["bad_sample"]
    result = invoke(
        ["replay", dump, "--device", "cpu", "--factory", "no_such_module_xyz:build"], exit_code=ExitCode.BAD_INPUT
    )
    assert "no_such_module_xyz" in result.stderr
    import torch

    if not torch.cuda.is_available():
        assert "cuda" in invoke(["replay", dump, "--device", "cuda:0"], exit_code=ExitCode.BAD_INPUT).stderr


def test_unwritable_report_or_blocklist_path_exits_2_not_1(dumps, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    dump = dumps["bad_sample"]
    common = ["replay", dump, "--device", "cpu", "--no-rng-check", "--no-bisect"]
    result = invoke([*common, "-o", a_file / "report"], exit_code=ExitCode.BAD_INPUT)
    assert "Error:" in result.stderr and "Traceback" not in result.stderr
    result = invoke(
        [*common, "-o", tmp_path / "out", "--blocklist", a_file / "blocklist.jsonl"], exit_code=ExitCode.BAD_INPUT
    )
    assert "Error:" in result.stderr
    invoke(["pack", dump, "-o", a_file / "x.tar.zst"], exit_code=ExitCode.BAD_INPUT)


@pytest.mark.parametrize("command", ["replay", "repro"])
def test_an_unwritable_output_is_refused_before_the_dump_is_read(tmp_path, monkeypatch, command):
    """`-o /proc/forbidden` fails at once with exit 2 — not after a whole replay (issue 31). The dump here does not
    even exist: the output is what is checked first."""
    import forensics.replay.engine

    def never(*args, **kwargs):
        raise AssertionError("the replay ran before its output was checked")

    monkeypatch.setattr(forensics.replay.engine, "run_replay", never)
    result = invoke([command, tmp_path / "no_such_dump", "-o", "/proc/forbidden/report"], exit_code=ExitCode.BAD_INPUT)
    assert "-o /proc/forbidden/report cannot be written" in result.stderr and "no_such_dump" not in result.stderr
    assert not Path("/proc/forbidden").exists()


def test_factory_kwargs_must_be_a_json_object(tmp_path):
    result = invoke(["replay", tmp_path, "--factory-kwargs", "[1, 2]"], exit_code=ExitCode.BAD_INPUT)
    assert "must be a JSON object" in result.stderr
    assert (
        "is not JSON"
        in invoke(
            ["repro", tmp_path, "-o", tmp_path / "r", "--loss-kwargs", "{width"], exit_code=ExitCode.BAD_INPUT
        ).stderr
    )


def test_a_bug_in_forensics_exits_1(dumps, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(forensics.commands.summary, "dump_summary", broken)  # our own code, not torch or the disk
    result = invoke(["inspect", dumps["bad_sample"]], exit_code=ExitCode.INTERNAL)
    assert isinstance(result.exception, RuntimeError)


def test_list_shows_every_dump_whether_replayed_and_the_unfinished_ones(dumps, tmp_path):
    import shutil

    root = tmp_path / "dumps"
    for name, path in dumps.items():
        shutil.copytree(
            path.parent,
            root / f"demo-{name}" / path.parent.name,  # not the other tests' replays
            ignore=shutil.ignore_patterns("replays.jsonl", "report-rank*"),
        )
    stale = root / "demo-sdc" / "step-000000099" / ".tmp-rank-00000-0123abcd"
    stale.mkdir(parents=True)
    import os
    import time

    old = time.time() - 3 * 86400
    os.utime(stale, (old, old))
    sdc = next(p for p in (root / "demo-sdc").glob("step-*") if p.name != "step-000000099")
    anywhere = tmp_path / "my-reports" / "sdc"  # -o anywhere: list still finds it (the step dir's replays.jsonl)
    invoke(["replay", sdc, "--device", "cpu", "-o", anywhere], exit_code=ExitCode.NOT_REPRODUCED)
    dropout = next((root / "demo-dropout_mask").glob("step-*"))
    default = CliRunner().invoke(main, ["replay", str(dropout), "--device", "cpu", "--no-rng-check"])
    assert str(dropout / "report-rank0" / "report.md") in default.stdout  # by default beside the rank dirs
    rows = json.loads(invoke(["list", root, "--verify", "--json"], exit_code=0).stdout)
    by_run = {r["run_id"]: r for r in rows["dumps"]}
    assert sorted(by_run) == ["demo-bad_sample", "demo-dropout_mask", "demo-sdc"]
    assert all(r["verified"] is True and r["ranks"] == [0] and r["world_size"] == 1 for r in rows["dumps"])
    assert by_run["demo-sdc"]["report"] == str((anywhere / "report.json").resolve())
    assert by_run["demo-dropout_mask"]["report"] and by_run["demo-bad_sample"]["report"] is None
    table = invoke(["list", root], exit_code=0).stdout
    sdc_line = next(line for line in table.splitlines() if line.startswith("demo-sdc "))
    assert " yes " in sdc_line and sdc_line.endswith(str(sdc)) and "replayed path" in table.splitlines()[0]
    assert rows["stale"] == [str(stale)]
    text = invoke(["list", root, "--clean-stale"], exit_code=0)
    assert "removed unfinished dump" in text.stderr and not stale.exists()
    assert "demo-bad_sample" in text.stdout and "nonfinite_loss" in text.stdout


def test_inspect_shows_a_truncated_file_and_exits_2(dumps, tmp_path):
    """inspect reads no weights, but a listed file shorter than the manifest says is named (and exit 2), not
    summarised as if the dump were whole."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dumps["bad_sample"], copy)
    model = copy / "model.safetensors"
    size = model.stat().st_size
    with open(model, "r+b") as handle:
        handle.truncate(size // 2)
    result = invoke(["inspect", copy], exit_code=ExitCode.BAD_INPUT)
    assert "DAMAGED: model.safetensors has" in result.stderr and f"{size:,}" in result.stderr  # as every error
    assert "step" in result.stdout  # the summary is still shown


def _interrupted_while(stage, swallowed: bool):
    """`stage` with a real SIGINT sent to this process in its middle (raised into the command, or swallowed the way
    Python swallows a KeyboardInterrupt raised inside a finalizer or weakref callback)."""
    import signal

    def interrupted(*args, **kwargs):
        if swallowed:
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass
        else:
            signal.raise_signal(signal.SIGINT)
        return stage(*args, **kwargs)

    return interrupted


@pytest.mark.parametrize("swallowed", [False, True], ids=["raised", "swallowed"])
def test_ctrl_c_exits_130_with_one_line_and_no_half_written_report(dumps, tmp_path, monkeypatch, swallowed):
    """Issue 42 item 6: Ctrl-C during `forensics replay` (here while the report is being written) ends it with exit
    130 and the one line 'interrupted' — not click's 'Aborted!' (exit 1, the code of a bug), not a traceback — also
    when library code swallowed the KeyboardInterrupt; each report file is whole or absent."""
    import signal

    import forensics.report.write as write

    monkeypatch.setattr(write, "render_markdown", _interrupted_while(write.render_markdown, swallowed))
    out = tmp_path / "report"
    before = signal.getsignal(signal.SIGINT)
    result = invoke(
        ["replay", dumps["bad_sample"], "--device", "cpu", "--no-rng-check", "-o", out], exit_code=ExitCode.INTERRUPTED
    )
    assert result.stderr.strip().splitlines()[-1] == "interrupted" and "Aborted" not in result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    assert signal.getsignal(signal.SIGINT) is before  # the command's handler is gone
    assert not list(out.glob(".*tmp*")) and not list(out.glob("*.tmp"))  # no partial file left behind
    assert json.loads((out / "report.json").read_text())["verdict"]["kind"] == "bad_sample"  # written whole
    assert (out / "report.md").is_file() == swallowed  # raised: the interrupt stopped it before the rename
