"""A BatchNorm1d model cannot run one sample alone in training mode (it raises): bisection and the per-sample
table must go on without those subsets instead of ending the replay, and say so."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig
from forensics.cli import main
from forensics.replay.engine import ReplayOptions, run_replay


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def test_subsets_a_batchnorm_model_cannot_run_alone_do_not_end_the_replay(tmp_path):
    model = _build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(
        model,
        optimizer,
        loss_fn=_loss,
        config=GuardConfig(
            dump_dir=str(tmp_path),
            run_id="bn",
            detection=DetectionConfig(on_nonfinite="skip"),
            dumping=DumpConfig(recipe={"factory": f"{__name__}:_build", "loss": f"{__name__}:_loss"}),
        ),
    )
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        for mb in range(2):
            x, y = torch.randn(2, 6, generator=g), torch.randn(2, 2, generator=g)
            if (step, mb) == (2, 1):
                x[1, 3] = float("inf")
            batch = {"x": x, "y": y, "sample_ids": [f"r{step}-{mb}-{i}" for i in range(2)]}
            guard.record_batch(batch)
            loss = _loss(model, batch)
            guard.record_loss(loss)
            (loss / 2).backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
    guard.close()
    [dump] = guard.dumps

    report = run_replay(str(dump), ReplayOptions(device="cpu", trust=True, rng_check=False))
    assert report["reproduced"] is True and report["verdict"]["kind"] == "bad_sample"
    ids = [s["sample_id"] for s in report["culprit"]["samples"]]
    assert "r2-1-1" in ids and set(ids) <= {"r2-1-0", "r2-1-1"}  # its micro-batch: one sample cannot run alone
    described = {s["sample_id"]: s.get("description") for s in report["culprit"]["samples"]}
    assert described["r2-1-1"] == "its x holds 1 Inf (of 6 values)"
    assert any("cannot run without the rest of their micro-batch" in w for w in report["environment"]["warnings"])
    out = CliRunner().invoke(
        main, ["replay", str(dump), "--device", "cpu", "--trust", "--no-rng-check", "-o", str(tmp_path / "report")]
    )
    assert out.exit_code == 0, out.output
    assert "4 raised when run alone (ValueError)" in out.output
