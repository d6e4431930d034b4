"""A loss and a model factory defined in the training script itself (`python train.py`, no main guard): the dump
holds the script's source and `forensics replay --trust` defines them from it without training again (issue 22,
item 6); without --trust, or where the function needs what the training code computes, the error says exactly
what to pass — never to import the script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from forensics.cli import main
from forensics.core.errors import RecipeError
from forensics.replay.load.main_script import define_from_script

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    """A training script as people write them: everything at top level, no `if __name__ == "__main__":`."""
    import torch
    from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig

    WIDTH = 3

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(WIDTH, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    def lm_loss(model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])

    print("TRAINING starts", flush=True)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, optimizer, loss_fn=lm_loss,
                  config=GuardConfig(dump_dir="dumps", run_id="script", detection=DetectionConfig(on_nonfinite="skip"),
                                     dumping=DumpConfig(recipe={"factory": "__main__:build"})))
    data = torch.Generator().manual_seed(0)
    for step in range(6):
        x, y = torch.randn(4, WIDTH, generator=data), torch.randn(4, 1, generator=data)
        if step == 3:
            x[1] = float("inf")
        batch = {"x": x, "y": y, "sample_ids": [f"rec-{step}-{i}" for i in range(4)]}
        guard.record_batch(batch)
        loss = lm_loss(model, batch)
        guard.record_loss(loss)
        loss.backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
        print(f"TRAINING step {step}", flush=True)
    guard.close()
''')


@pytest.fixture(scope="module")
def script_dump(tmp_path_factory) -> Path:
    job = tmp_path_factory.mktemp("job")
    (job / "train.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ran = subprocess.run([sys.executable, "train.py"], cwd=job, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "TRAINING step 5" in ran.stdout, ran.stderr
    dumps = sorted((job / "dumps").glob("script/step-*/rank-*"))
    assert len(dumps) == 1
    return dumps[0]


def dumps_under(root: Path) -> list[Path]:
    return sorted(root.rglob("manifest.json"))


def test_the_dump_holds_the_script_and_names_it(script_dump):
    manifest = json.loads((script_dump / "manifest.json").read_text())
    recipe = manifest["recipe"]
    assert recipe["loss"] == "__main__:lm_loss" and recipe["factory"] == "__main__:build"
    assert recipe["script"] == {"file": "main_script.py", "name": "train.py", "globals": {"WIDTH": 3}, "unrecorded": {}}
    assert (script_dump / "main_script.py").read_text() == SCRIPT


def test_replay_with_trust_defines_the_functions_without_training_again(script_dump, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a training run re-executed here would write ./dumps and print TRAINING
    before = dumps_under(tmp_path) + dumps_under(script_dump.parents[2])
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main, ["replay", str(script_dump), "--device", "cpu", "--trust", "--no-rng-check", "-o", str(out)]
    )
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert "TRAINING" not in result.stdout + result.stderr
    assert dumps_under(tmp_path) + dumps_under(script_dump.parents[2]) == before
    report = json.loads((out / "report.json").read_text())
    assert report["reproduced"] is True and report["verdict"]["kind"] == "bad_sample"
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["rec-3-1"]


def test_without_trust_it_exits_2_and_says_exactly_what_to_pass(script_dump, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["replay", str(script_dump), "--device", "cpu", "-o", str(tmp_path / "r")])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert "defined in the training script train.py, whose source the dump holds; it was NOT run" in result.stderr
    assert "Pass --trust to define it from that source" in result.stderr
    assert "--factory train_lib:build --path DIR_OF_THAT_MODULE" in result.stderr
    assert "train:build" not in result.stderr and "TRAINING" not in result.stdout + result.stderr


def test_a_function_that_needs_what_the_training_code_computes_is_refused_with_what_to_pass():
    source = textwrap.dedent("""
        import torch
        criterion = torch.nn.MSELoss()          # a call at top level: not run at replay
        def lm_loss(model, batch):
            return criterion(model(batch["x"]), batch["y"])
        for epoch in range(100):
            print("TRAINING")
    """).encode()
    with pytest.raises(RecipeError) as refused:
        define_from_script(source, "lm_loss", "train.py", "loss function", "--loss")
    message = str(refused.value)
    assert "`lm_loss` uses `criterion`, which train.py sets in top-level code that replay does not run" in message
    assert "--loss train_lib:lm_loss --path DIR_OF_THAT_MODULE" in message


def test_definitions_run_and_the_main_guard_and_top_level_calls_do_not(capsys):
    source = textwrap.dedent("""
        import math
        SCALE = 2 * math.pi
        try:
            import numpy as np
        except ImportError:
            np = None
        def helper(v):
            return v * SCALE
        def lm_loss(model, batch):
            return helper(batch)
        print("TRAINING at top level")
        if __name__ == "__main__":
            print("TRAINING in the guard")
    """).encode()
    loss, _ = define_from_script(source, "lm_loss", "train.py", "loss function", "--loss")
    assert loss(None, 1.0) == pytest.approx(6.283185307)
    assert "TRAINING" not in capsys.readouterr().out


def test_top_level_assignments_into_modules_are_not_run(monkeypatch):
    """Only names of the script's own module are bound: an assignment into another module's state (torch's flags,
    os.environ) is left out, so defining a loss never changes how the replay computes."""
    import torch

    monkeypatch.delenv("FORENSICS_SCRIPT_MARK", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    source = textwrap.dedent("""
        import os
        import torch
        os.environ["FORENSICS_SCRIPT_MARK"] = "set by the script"
        torch.backends.cudnn.benchmark = True
        SCALE, (LOW, HIGH) = 2, (0, 1)
        def lm_loss(model, batch):
            return batch * SCALE + HIGH
    """).encode()
    loss, _ = define_from_script(source, "lm_loss", "train.py", "loss function", "--loss")
    assert loss(None, 1) == 3
    assert "FORENSICS_SCRIPT_MARK" not in os.environ and torch.backends.cudnn.benchmark is False


def test_the_trust_message_says_that_definitions_can_run_code(script_dump, tmp_path, monkeypatch):
    """What --trust consents to is said as it is: decorators, default values, class bodies and imports run."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["replay", str(script_dump), "--device", "cpu", "-o", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "decorators, default values and class bodies can run any code" in result.stderr


# -- issue 43: a script's encoding, its nesting, and constants that would run code -----------------------------------
LOSS = b"def lm_loss(model, batch):\n    return batch * SCALE\nSCALE = 3\n"


@pytest.mark.parametrize(
    "head", [b"\xef\xbb\xbf", b"# -*- coding: latin-1 -*-\n# caf\xe9\n"], ids=["utf-8 BOM", "latin-1 coding line"]
)
def test_a_valid_script_with_a_bom_or_a_coding_line_is_defined(head):
    loss, _ = define_from_script(head + LOSS, "lm_loss", "train.py", "loss function", "--loss")
    assert loss(None, 2) == 6


def test_a_script_nested_3000_deep_is_refused_in_one_sentence():
    source = LOSS + b"DEEP = " + b"-" * 3000 + b"1\n"
    with pytest.raises(RecipeError, match="is nested too deep to parse"):
        define_from_script(source, "lm_loss", "train.py", "loss function", "--loss")


def test_constant_assignments_are_evaluated_never_run(monkeypatch):
    """An operator or a format of an object whose class the script defines would run the script's code: such an
    assignment is skipped, while plain arithmetic, module constants and f-strings of plain values are evaluated."""
    monkeypatch.delenv("FORENSICS_OPERATOR_RAN", raising=False)
    source = textwrap.dedent("""
        import math
        import os
        class Meta(type):
            def __add__(cls, other):
                os.environ["FORENSICS_OPERATOR_RAN"] = "__add__"
                return 1
            def __format__(cls, spec):
                os.environ["FORENSICS_OPERATOR_RAN"] = "__format__"
                return ""
        class A(metaclass=Meta):
            pass
        ADDED = A + 1
        SHOWN = f"{A}"
        HUGE = 2 ** 10 ** 10
        WIDE = "x" * 10 ** 12
        SCALE = 2 * math.pi
        NAME = "run"
        LABEL = f"{NAME}-{3!r}"
        LOW, (MID, *HIGH) = -1, (0, 1, 2)
        def lm_loss(model, batch):
            return batch * SCALE, LABEL, HIGH
    """).encode()
    loss, _ = define_from_script(source, "lm_loss", "train.py", "loss function", "--loss")
    assert loss(None, 1.0) == (pytest.approx(6.283185307), "run-3", [1, 2])
    assert "FORENSICS_OPERATOR_RAN" not in os.environ


NO_RECIPE = re.sub(r',\s*dumping=DumpConfig\(recipe=\{"factory": "__main__:build"\}\)', "", SCRIPT).replace(
    'run_id="script"', 'run_id="norecipe"'
)


def test_a_job_without_a_factory_is_told_at_once_and_the_replay_line_and_main_factory_work(tmp_path, monkeypatch):
    """Issue 42 item 4: a plain module and a loss of the script, no recipe: the Guard says at creation, in one line,
    what a replay will need (a factory, --trust); the dump line prints the command that works; and
    `--factory __main__:build --trust` defines `build` from the script the dump holds (no main guard in it)."""
    assert NO_RECIPE != SCRIPT and "DumpConfig(recipe" not in NO_RECIPE
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(NO_RECIPE)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ran = subprocess.run([sys.executable, "train.py"], cwd=job, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "TRAINING step 5" in ran.stdout, ran.stderr
    needs = [line for line in ran.stderr.splitlines() if "a replay of this job's dumps will need" in line]
    assert len(needs) == 1 and "a model factory" in needs[0] and "--trust" in needs[0]
    assert "--factory __main__:FUNCTION --trust" in needs[0]  # the script is a file: a function of it can be named
    assert ran.stderr.index(needs[0]) < ran.stderr.index("TRAINING step 0") if "TRAINING step 0" in ran.stderr else True
    [dump] = sorted((job / "dumps").glob("norecipe/step-*/rank-*"))
    said = [line for line in ran.stderr.splitlines() if "replay it with:" in line]
    assert said and said[0].endswith(f"forensics replay {dump.relative_to(job)} --trust --factory MODULE:FUNCTION")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(dump),
            "--device",
            "cpu",
            "--factory",
            "__main__:build",
            "--trust",
            "--no-rng-check",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert "TRAINING" not in result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["rec-3-1"]
    refused = CliRunner().invoke(
        main, ["replay", str(dump), "--device", "cpu", "--factory", "__main__:build", "-o", str(tmp_path / "r2")]
    )
    assert refused.exit_code == 2 and "Pass --trust" in refused.stderr
