"""One import root: forensics' two sides are forensics.capture and forensics.replay (the folders capture/ and replay/
of the repository, linked into the package), so a user's own capture.py or replay.py beside train.py does not stand in
for them; a dump that names a module under the old top-level names still loads."""

from __future__ import annotations

import os
import subprocess
import sys

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
        timeout=300,
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
