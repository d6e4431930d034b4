"""A run that diverges by itself in fp32 (issue 42, item 1): a plain fused-AdamW loop at a learning rate far too high,
the DEFAULT GuardConfig. The Guard fires on a gradient norm that overflows (inf) while every gradient value is finite;
the replay must reproduce it as what it is — a diverged state, with the learning-rate advice its history supports —
not 'not reproduced' with hardware advice."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from click.testing import CliRunner

from forensics.capture import DumpConfig, Guard, GuardConfig
from forensics.cli import main
from forensics.core.errors import TrainingFaultError

MODEL = """
import torch


def build():
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def loss_fn(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
"""


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    root = tmp_path_factory.mktemp("diverged")
    (root / "diverging_model.py").write_text(MODEL)
    sys.path.insert(0, str(root))
    try:
        import diverging_model as job
    finally:
        sys.path.remove(str(root))
    torch.manual_seed(0)
    model = job.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=300.0, fused=True)  # nothing planted: only the lr
    guard = Guard(
        model,
        optimizer,
        loss_fn=job.loss_fn,
        config=GuardConfig(
            dump_dir=str(root / "dumps"), run_id="lr", dumping=DumpConfig(recipe={"factory": "diverging_model:build"})
        ),
    )
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(TrainingFaultError) as err:
        for step in range(200):
            x = torch.randn(8, 16, generator=gen)
            batch = {"x": x, "y": x.flip(1), "sample_ids": list(range(8 * step, 8 * step + 8))}
            guard.record_batch(batch)
            loss = job.loss_fn(model, batch)
            guard.record_loss(loss)
            loss.backward()
            if guard.check():
                optimizer.step()
            optimizer.zero_grad()
    guard.close()
    sys.modules.pop("diverging_model", None)
    return root, err.value.dump_path


def test_a_norm_that_overflows_replays_as_a_diverged_state_with_the_learning_rate_advice(diverged):
    root, dump = diverged
    out = root / "report"
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(dump),
            "--device",
            "cpu",
            "--path",
            str(root),
            "--no-rng-check",
            "--factory",
            "diverging_model:build",
            "--loss",
            "diverging_model:loss_fn",
            "-o",
            str(out),
        ],
    )
    sys.modules.pop("diverging_model", None)
    assert (out / "report.json").exists(), (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    verdict = report["verdict"]
    assert report["trigger"]["kind"] == "nonfinite_grad"
    assert report["reproduced"] is True and result.exit_code != 3, verdict["headline"]
    text = " ".join([verdict["headline"], verdict["explanation"], *verdict["suggestions"]])
    assert "DCGM" not in text and "hardware" not in text
    assert "learning rate" in text
    assert verdict["kind"] in ("model_state", "optimizer_update"), verdict["headline"]
    assert not (out / "blocklist.jsonl").exists()
    assert not any(s.startswith("Tested fix") for s in verdict["suggestions"])  # no change to the step makes its norm
    # finite: the gradients are what they are on these weights
