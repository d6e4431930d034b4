"""A symptom is not blamed as the cause (issue "diagnosis depth", item 4): a small GPT trained with AdamW at
lr=3 goes from a loss of 4.2 to hundreds at step 1 and stays there; the grad-norm spike dumped much later
gets "the run had diverged long before", no culprit sample and no blocklist."""

from __future__ import annotations

import json

import torch
import transformers
from click.testing import CliRunner
from forensics_test_helpers import guarded_step

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, SpikeConfig
from forensics.cli import main


def test_a_spike_in_a_run_that_diverged_long_ago_blames_no_sample(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3.0)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="lr3",
            dumping=DumpConfig(max_dumps=1),
            detection=DetectionConfig(
                loss_spike=SpikeConfig(enabled=False),
                grad_norm_spike=SpikeConfig(warmup=16, mad_factor=3.0, min_ratio=1.5),
            ),
        ),
    )
    data = torch.Generator().manual_seed(1)
    for step in range(120):
        ids = torch.randint(0, 64, (8, 16), generator=data)
        guarded_step(
            guard,
            optimizer,
            {"input_ids": ids, "labels": ids, "sample_ids": [f"s{step}-{i}" for i in range(8)]},
            lambda batch: model(input_ids=batch["input_ids"], labels=batch["labels"]).loss,
        )
        if guard.dumps:
            break
    guard.close()
    assert guard.dumps, "the unstable run must produce a grad-norm spike"
    history = json.loads((guard.dumps[0] / "history.json").read_text())
    assert history["summary"]["first_losses"][0] < 5 and history["summary"]["steps"] > 16
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main, ["replay", str(guard.dumps[0]), "--device", "cpu", "--no-rng-check", "-o", str(out)]
    )
    assert result.exit_code == 4, (result.stdout, result.stderr, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "spike_no_single_cause"
    assert "diverged long before" in report["verdict"]["headline"] and report["culprit"]["samples"] == []
    assert "uniform guess" in report["history"]["diverged"] and not (out / "blocklist.jsonl").exists()
    assert any("learning rate" in s for s in report["verdict"]["suggestions"])
