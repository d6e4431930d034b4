"""One import root: forensics' two sides are forensics.capture and forensics.replay (the folders capture/ and replay/
of the repository, mapped into the package by setup.py and linked into it for development), so a user's own
capture.py or replay.py beside train.py does not stand in for them; a wheel built from a checkout that lost the links
still holds them; a dump that names a module under the old top-level names still loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forensics.recipes import is_builtin
from forensics.replay.load.recipe import current_path, import_object


def test_a_users_capture_py_and_replay_py_do_not_break_forensics(tmp_path):
    for name in ("capture", "replay"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run(
        [
            sys.executable,
            "-c",
            "from forensics import Guard, GuardConfig; import forensics.replay.engine; print(Guard.__module__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "forensics.capture.guard"


def test_a_module_of_ours_named_the_old_way_still_resolves():
    assert current_path("capture.integrations.lightning:training_step_loss") == (
        "forensics.capture.integrations.lightning:training_step_loss"
    )
    assert current_path("mypkg.models:build") == "mypkg.models:build"
    loss = import_object("capture.integrations.lightning:training_step_loss", "loss function")
    assert loss.__module__ == "forensics.capture.integrations.lightning"
    assert not is_builtin("capture.integrations.lightning:training_step_loss")  # consent rules unchanged


REPO = Path(__file__).resolve().parents[2]


def _export_without_links(dest: Path) -> None:
    """The repository's files as a checkout with `core.symlinks=false` or an unzipped "Download ZIP" has them: each
    link a small text file holding its target."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source, target = REPO / name, dest / name
        if not source.is_symlink() and not source.is_file():
            continue  # deleted in the working tree, not yet in git
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.write_text(os.readlink(source))
        else:
            target.write_bytes(source.read_bytes())


def test_a_wheel_built_from_a_checkout_without_links_imports_both_sides(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    source, wheels, site = tmp_path / "export", tmp_path / "wheels", tmp_path / "site"
    _export_without_links(source)
    assert (source / "forensics" / "capture").is_file()  # the link is lost, as on Windows
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("forensics-*.whl")
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=120
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(site)}
    ran = subprocess.run(
        [
            sys.executable,
            "-c",
            # the checkout's own editable install (a meta path finder) would fill in what the wheel lacks
            "import sys; sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith"
            "('__editable__')]; from forensics import Guard; from forensics.replay.judge.verdict import decide_verdict;"
            " import forensics.replay.engine as engine; print(sys.modules[Guard.__module__].__file__, engine.__file__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == [
        str(site / "forensics" / "capture" / "guard.py"),
        str(site / "forensics" / "replay" / "engine.py"),
    ]
