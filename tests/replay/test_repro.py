"""`forensics repro`: for the demo scenarios whose failure is an op of the forward pass, the generated scripts
reproduce it standalone — each run in a Python process of its own fails with the AssertionError naming the op (with
inputs shrunk to the failing slice) or the culprit sample — and the report links them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from forensics_test_helpers import fork_server

from forensics.cli import main
from forensics.demo.scenarios import SCENARIOS
from forensics.report import write_report_files
from forensics.replay.engine import ReplayOptions, run_replay

# scenario -> (the op its first non-finite value comes from, the non-finite kind that op makes)
OPS = {
    "bad_sample": ("aten::native_layer_norm", "nan"),
    "log_zero": ("aten::log", "-inf"),
    "fp16_overflow": ("aten::mul", "inf"),
}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def torch_only():
    """A fork server that imported torch alone, started without PYTHONPATH: op_repro.py runs in a process forked from
    it, with torch only (tests/fork_server.py: each script a process of its own, as `python SCRIPT` runs it)."""
    server = fork_server().ForkServer(["torch"], {"PATH": "/usr/bin:/bin", "HOME": str(REPO)})
    yield server
    server.close()


def run_script(path: Path, cwd: Path, server=None) -> subprocess.CompletedProcess:
    """The script as `python SCRIPT` runs it, in a process of its own, from a directory of its own: op_repro.py forked
    from `server` (torch_only: no PYTHONPATH), model_repro.py with this checkout on PYTHONPATH, forked from the test
    session's server (what it imported, torch and transformers, is shared; no state is)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    if path.name == "model_repro.py":
        env["PYTHONPATH"] = str(REPO)
        server = fork_server().shared(REPO)
    done = server.run(path, [], cwd=str(cwd), env=env, out_dir=cwd / "output", timeout=120)
    return subprocess.CompletedProcess([path], done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def repros(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    out = {}
    for name in OPS:
        captured = SCENARIOS[name].capture(root / name, device="cpu")
        report_dir = root / name / "report"
        write_report_files(
            run_replay(captured.dump_path, ReplayOptions(device="cpu", bisect=False, remedies=False, rng_check=False)),
            report_dir,
        )
        result = CliRunner().invoke(
            main, ["repro", str(captured.dump_path), "-o", str(root / name / "repro"), "--report", str(report_dir)]
        )
        assert result.exit_code == 0, (result.output, result.exception)
        out[name] = (captured, root / name / "repro", report_dir)
    return out


@pytest.mark.parametrize("name", list(OPS))
def test_the_op_script_fails_standalone_on_the_shrunk_inputs(name, repros, tmp_path, torch_only):
    _, directory, _ = repros[name]
    op, kind = OPS[name]
    summary = json.loads((directory / "repro.json").read_text())
    assert summary["op"] == op
    before, after = summary["shrunk"]["from"], summary["shrunk"]["to"]
    assert sum(map(_numel, after)) < sum(map(_numel, before))  # cut to the failing slice
    done = run_script(directory / "op_repro.py", tmp_path, torch_only)
    assert done.returncode == 1, done.stderr
    assert f"AssertionError: {op} made non-finite output" in done.stderr and kind in done.stderr


@pytest.mark.parametrize("name", list(OPS))
def test_the_model_script_runs_the_culprit_sample_and_fails(name, repros, tmp_path):
    captured, directory, _ = repros[name]
    spec = json.loads((directory / "model.json").read_text())
    assert spec["sample_ids"] == list(captured.expected.samples)
    done = run_script(directory / "model_repro.py", tmp_path)
    assert done.returncode == 1, done.stderr
    assert f"AssertionError: the loss of sample(s) {spec['sample_ids']!r} is" in done.stderr


def test_the_report_links_the_repro_directory(repros):
    _, directory, report_dir = repros["log_zero"]
    report = json.loads((report_dir / "report.json").read_text())
    assert report["repro"]["directory"] == str(directory) and report["repro"]["op"] == "aten::log"
    assert str(directory / "op_repro.py") in (report_dir / "report.md").read_text()


def test_a_name_from_the_dump_never_reaches_the_scripts_code(repros):
    for _, directory, _ in repros.values():
        for script in ("op_repro.py", "model_repro.py"):
            text = (directory / script).read_text()
            assert "shard-" not in text and "aten::" not in text  # sample ids and op names live in the JSON


def _numel(shape: list) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def test_the_model_script_asks_no_more_trust_than_repro_was_given(repros):
    """`forensics repro` ran without --trust: model_repro.py replays the dump without it too."""
    for _, directory, _ in repros.values():
        assert json.loads((directory / "model.json").read_text())["trust"] is False


def test_op_inputs_over_the_size_cap_are_not_written(repros, tmp_path, monkeypatch):
    import forensics.replay.repro
    from forensics.replay.repro import write_repro

    captured, _, _ = repros["log_zero"]
    monkeypatch.setattr(forensics.replay.repro, "MAX_OP_INPUT_BYTES", 1)
    result = write_repro(captured.dump_path, tmp_path / "repro", device="cpu")
    assert not (tmp_path / "repro" / "op_inputs.safetensors").exists() and "op_script" not in result.files
    assert any("over the 1 bytes" in note for note in result.notes) and "model_script" in result.files


def test_repro_never_writes_into_the_dump(repros):
    captured, _, _ = repros["log_zero"]
    result = CliRunner().invoke(main, ["repro", str(captured.dump_path), "-o", str(captured.dump_path / "repro")])
    assert result.exit_code == 2 and "would be written into the dump" in result.stderr
    assert not (captured.dump_path / "repro").exists()


def test_a_copied_model_script_finds_its_dump_and_a_missing_dump_is_one_line_exit_3(repros, tmp_path):
    """Issue 42 item 5: model_repro.py copied to another directory still finds the dump (recorded absolute too); a
    dump found nowhere is one line and exit code 3 (1 means the bug is reproduced), and --dump PATH names it."""
    import shutil

    captured, directory, _ = repros["bad_sample"]
    copied = tmp_path / "elsewhere" / "deeper" / "repro"
    shutil.copytree(directory, copied)
    done = run_script(copied / "model_repro.py", tmp_path)
    assert done.returncode == 1 and "AssertionError: the loss of sample(s)" in done.stderr, done.stderr

    spec = json.loads((copied / "model.json").read_text())
    spec["dump_absolute"] = str(tmp_path / "moved-away")  # the dump is no longer where repro found it
    (copied / "model.json").write_text(json.dumps(spec))
    lost = run_script(copied / "model_repro.py", tmp_path)
    assert lost.returncode == 3, lost.stderr
    assert lost.stderr.strip().count("\n") == 0 and "pass --dump PATH" in lost.stderr and "Traceback" not in lost.stderr
    server = fork_server().shared(REPO)
    named = server.run(
        copied / "model_repro.py",
        ["--dump", str(captured.dump_path)],
        cwd=str(tmp_path),
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
        out_dir=tmp_path / "output2",
        timeout=120,
    )
    assert named.returncode == 1 and "AssertionError" in named.stderr, named.stderr


def test_repro_of_a_loss_spike_says_spike_not_a_gradient_failure(tmp_path):
    """Issue 42 item 10: a loss-spike dump has no standalone reproduction, and repro says it is a spike."""
    captured = SCENARIOS["spike"].capture(tmp_path / "spike", device="cpu")
    result = CliRunner().invoke(main, ["repro", str(captured.dump_path), "-o", str(tmp_path / "repro")])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "loss spike" in result.stderr and "gradient or optimizer" not in result.stderr
