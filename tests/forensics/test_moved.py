"""Moved module paths keep working for a release: each old name imports the module at its new path and warns with a
DeprecationWarning that names the new path (forensics/core/moved.py); old top-level `capture.` / `replay.` names
(imports and a torchtitan TOML) resolve only while the user has no `capture` / `replay` of their own."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forensics.core.moved import MOVED, SIDES, current_name

REPO = Path(__file__).resolve().parents[2]


def test_every_old_name_is_gone_and_every_new_one_exists():
    for old, new in MOVED.items():
        full_old = old if old.startswith("forensics.") else f"forensics.{old}"
        path = REPO / Path(*old.split("."))
        assert not path.with_suffix(".py").exists() and not (path / "__init__.py").exists(), (
            f"{full_old} is a module again: the finder of old names would shadow it; take it out of MOVED"
        )
        assert importlib.util.find_spec(current_name(old)) is not None, f"{old} -> {new}: no such module"


@pytest.mark.parametrize("old", sorted(name for name in MOVED if name.startswith("forensics.")))
def test_an_old_forensics_path_warns_and_is_the_new_module(old):
    new = MOVED[old]
    sys.modules.pop(old, None)  # imported by an earlier test: the import would not run again
    with pytest.warns(DeprecationWarning, match=rf"^{old} moved to {new}; import it from there"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_the_documented_old_spellings():
    for name in ("forensics.errors", "forensics.kinds"):
        sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning, match="forensics.core.errors") as warned:
        from forensics.errors import TrainingFaultError
    assert warned[0].filename == __file__  # the warning points at the import, not at importlib
    from forensics import TrainingFaultError as current

    assert TrainingFaultError is current
    with pytest.warns(DeprecationWarning, match="forensics.core.kinds"):
        import forensics.kinds
    from forensics.core.kinds import Policy

    assert forensics.kinds.Policy is Policy


# Run where only an installed forensics is importable: the checkout's own capture/ and replay/ folders, on sys.path
# through PYTHONPATH, would otherwise be imported as top-level packages of their own.
_OLD_TOP_LEVEL = r"""
import json, os, sys, warnings
from pathlib import Path
import forensics
from forensics.core.moved import MOVED, SIDES
sys.path[:] = [p for p in sys.path if not (Path(p or ".").resolve() / "capture" / "guard.py").exists()]
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from capture.integrations import DistributedGuard
    from forensics.capture.integrations import DistributedGuard as current
    out["guard"] = DistributedGuard is current
    out["guard_warnings"] = [str(w.message) for w in caught]
    out["modules"] = {}
    for old in MOVED:
        if old.partition(".")[0] in SIDES:
            out["modules"][old] = __import__(old, fromlist=["_"]).__name__
    if sys.argv[1:]:
        from torchtitan.config import ConfigManager
        config = ConfigManager().parse_args(["--job.config_file", sys.argv[1]])
        out["titan"] = [config.forensics.enable, config.forensics.run_id]
print(json.dumps(out))
"""


def test_old_top_level_names_and_a_torchtitan_toml_naming_one_resolve(tmp_path):
    args = []
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        pass
    else:
        toml = tmp_path / "old_job.toml"
        old_job = '[job]\ncustom_config_module = "capture.integrations.torchtitan"\n'
        toml.write_text(old_job + '[forensics]\nenable = true\nrun_id = "old"\n')
        args = [str(toml)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    ran = subprocess.run(
        [sys.executable, "-c", _OLD_TOP_LEVEL, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = json.loads(ran.stdout.splitlines()[-1])
    assert out["guard"] is True
    assert "capture.integrations moved to forensics.capture.integrations; import it from there" in " ".join(
        out["guard_warnings"]
    )
    assert out["modules"] == {old: current_name(old) for old in MOVED if old.partition(".")[0] in SIDES}
    assert out["modules"]["capture.detectors"] == "forensics.capture.detection.detectors"
    assert out["modules"]["replay.verdict"] == "forensics.replay.judge.verdict"
    if args:
        assert out["titan"] == [True, "old"]


def test_a_users_own_capture_package_is_never_replaced(tmp_path):
    own = tmp_path / "capture"
    own.mkdir()
    (own / "__init__.py").write_text("MINE = True\n")
    (own / "integrations.py").write_text("WHOSE = 'mine'\n")
    code = (
        "import forensics, sys; sys.path.insert(0, sys.argv[1]); import capture, capture.integrations as i;"
        " print(capture.MINE, i.WHOSE)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == ["True", "mine"]
