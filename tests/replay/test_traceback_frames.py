"""The forward traceback shows the user's frames only (issue 50, item 6): the report's "Forward traceback" section
was ~20 lines of click and forensics internals around the two lines that matter. Forensics' own frames, click's,
torch's and the standard library's are folded into one line; the model's and the script's stay."""

from __future__ import annotations

import re
from pathlib import Path

import click
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import forensics
from forensics.replay.localize.forward_backward import localize_backward
from forensics.replay.run.execute import StepRunner


class WhereSqrt(torch.nn.Module):
    """gelu where x > -1e4, else sqrt(x): the classic where-NaN (NaN gradients from a discarded branch)."""

    def forward(self, x):
        return torch.where(x > -1e4, F.gelu(x), torch.sqrt(x))


def test_the_forward_traceback_keeps_the_users_frames_and_folds_the_rest(kit):
    model = kit.build_gpt2()
    model.transformer.h[1].mlp.act = WhereSqrt()
    runner = StepRunner(kit.make_session(model, kit.build_batches(poison=False), record=False))
    found = {}

    @click.command()
    def replay_command():  # the replay runs inside the CLI, as `forensics replay` does
        found["finding"] = localize_backward(runner)

    result = CliRunner().invoke(replay_command, [])
    assert result.exit_code == 0, (result.output, result.exception)
    trace = found["finding"].traceback
    assert "torch.sqrt(x)" in trace and "folded" in trace, trace
    files = re.findall(r'File "([^"]+)"', trace)
    internal = [Path(forensics.__file__).parent, Path(click.__file__).parent, Path(torch.__file__).parent]
    own = [f for f in files if any(Path(f).resolve().is_relative_to(p.resolve()) for p in internal)]
    assert own == [], own  # nothing of forensics, click or torch
    assert any(f.endswith("test_traceback_frames.py") for f in files)  # the user's own code stays
    assert "_pytest" not in trace and "runpy" not in trace, trace  # the caller of forensics is folded too
