"""A user's own package named `replay` or `capture` (a replay buffer is common in RL) replays like any other: only the
exact import paths forensics itself wrote into old dumps (forensics.replay.load.recipe.LEGACY_PATHS) are read under
their new name; `replay.model:build` named by a dump (--trust) or by the user (--factory / --loss) is the user's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from forensics.cli import main
from forensics.replay.load.recipe import RecordedDirsFinder, current_path

REPO = Path(__file__).resolve().parents[2]

USER_CODE = """
import torch

BUILT = []


def build():
    BUILT.append("{name}")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def loss(model, batch):
    return model(batch["x"]).pow(2).mean()
"""


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A job directory holding the user's package `<name>/model.py`, importable as in the job (cwd), with this
    repository's root (where the folders replay/ and capture/ lie beside forensics/) off sys.path, as in an
    installed forensics. The replay finds it only where the user says: --trust (the job's recorded directory) or
    --path."""
    job = tmp_path / "job"
    for name in ("replay", "capture"):
        (job / name).mkdir(parents=True)
        (job / name / "__init__.py").write_text("")
        (job / name / "model.py").write_text(USER_CODE.format(name=name))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != REPO])
    # --trust adds the finder of recorded directories (one an earlier test's --trust replay left is set aside)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, RecordedDirsFinder)])
    for name in [n for n in sys.modules if n.split(".")[0] in ("replay", "capture")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.chdir(job)
    from forensics.capture.dumping import environment

    environment._static_environment.cache_clear()  # the dump records this job's directory, not an earlier test's
    yield job
    environment._static_environment.cache_clear()


def _crash_dump(job: Path, package: str) -> Path:
    """A Guard crash dump whose recipe names the user's `<package>.model:build` and `:loss`."""
    import importlib

    import torch

    from forensics.capture import DumpConfig, Guard, GuardConfig
    from forensics.core.errors import TrainingFaultError

    sys.path.insert(0, str(job))  # the job imports its own code (python train.py beside it)
    try:
        code = importlib.import_module(f"{package}.model")
    finally:
        sys.path.remove(str(job))
    model = code.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    recipe = {"factory": f"{package}.model:build", "loss": f"{package}.model:loss"}
    config = GuardConfig(dump_dir=str(job.parent / "dumps"), run_id=package, dumping=DumpConfig(recipe=recipe))
    guard = Guard(model, optimizer, loss_fn=code.loss, config=config)
    with pytest.raises(TrainingFaultError) as err:
        for step in range(3):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
            if step == 2:
                x[1, 0] = float("inf")
            batch = {"x": x, "sample_ids": [f"s{step}-{i}" for i in range(4)]}
            guard.record_batch(batch)
            loss = code.loss(model, batch)
            guard.record_loss(loss)
            loss.backward()
            if guard.check():
                optimizer.step()
            optimizer.zero_grad()
    guard.close()
    for name in [n for n in sys.modules if n.split(".")[0] == package]:
        del sys.modules[name]  # the replay imports the user's code afresh
    return Path(err.value.dump_path)


@pytest.mark.parametrize("package", ["replay", "capture"])
@pytest.mark.parametrize("consent", ["--trust", "--factory"])
def test_a_users_package_named_like_a_side_of_forensics_replays(user_package, tmp_path, package, consent):
    dump = _crash_dump(user_package, package)
    named = (
        ["--trust"]
        if consent == "--trust"
        else ["--factory", f"{package}.model:build", "--loss", f"{package}.model:loss", "--path", str(user_package)]
    )
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["replay", str(dump), "--device", "cpu", "--no-remedies", "-o", str(out), *named])
    assert result.exit_code in (0, 3, 4), (result.output, result.exception)
    assert sys.modules[f"{package}.model"].__file__ == str(user_package / package / "model.py")
    assert sys.modules[f"{package}.model"].BUILT == [package]  # the user's factory built the replayed model
    report = json.loads((out / "report.json").read_text())
    assert report["reproduced"] is True


def test_only_the_names_forensics_wrote_are_read_under_their_new_name():
    assert current_path("capture.integrations.lightning:training_step_loss") == (
        "forensics.capture.integrations.lightning:training_step_loss"
    )
    for users in ("replay.model:build", "capture.model:loss", "replay.buffer:ReplayBuffer", "capture.integrations.x:f"):
        assert current_path(users) == users
