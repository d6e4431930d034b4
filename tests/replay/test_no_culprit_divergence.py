"""Never blame clean data (issue 22, item 1), rebuilt as a user would run it: the README's loop with the Guard on
clean data and a learning rate far too high. The replay names no sample, writes no blocklist, says the learning
rate is the cause with numbers from before the divergence, and is never "stable" nor "no action needed"."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from torch.utils.data import DataLoader
from forensics_test_helpers import guarded_step

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, RecordConfig, SpikeConfig
from forensics.cli import main
from forensics.core.errors import TrainingFaultError

HERE = Path(__file__).resolve().parent


@pytest.fixture
def job():
    sys.path.insert(0, str(HERE))
    import window_job

    yield window_job
    sys.path.remove(str(HERE))


def train_sgd_lr50(job, tmp_path: Path, warmup: bool) -> Path:
    """Clean data, SGD at lr=50 (constant, or reached by a geometric warm-up), RecordConfig(snapshot_every=2)."""
    model = job.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=50.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, 3.0 ** (t - 8)) if warmup else 1.0)
    guard = Guard(
        model,
        optimizer,
        scheduler,
        loss_fn=job.mse_loss,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="lr50",
            recording=RecordConfig(snapshot_every=2, window_steps=16),
            dumping=DumpConfig(
                recipe={"factory": "window_job:make_model"},
                data_recipe={"dataset": "window_job:make_dataset", "dataset_kwargs": {"n": 400}},
            ),
        ),
    )
    batches = iter(DataLoader(job.make_dataset(400), batch_size=8))
    with pytest.raises(TrainingFaultError) as fault:
        for _ in range(40):
            guarded_step(guard, optimizer, next(batches), lambda batch: job.mse_loss(model, batch), scheduler)
    guard.close()
    return fault.value.dump_path


@pytest.mark.parametrize("warmup", [False, True], ids=["constant_lr", "warmup"])
def test_sgd_at_lr_50_on_clean_data_blames_the_learning_rate_not_the_samples(job, tmp_path, warmup):
    dump = train_sgd_lr50(job, tmp_path, warmup)
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main, ["replay", str(dump), "--device", "cpu", "--trust", "--path", str(HERE), "-o", str(out), "--no-rng-check"]
    )
    assert result.exit_code == 4, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    verdict = report["verdict"]
    assert verdict["kind"] == "spike_no_single_cause"
    assert report["culprit"]["samples"] == [] and not (out / "blocklist.jsonl").exists()
    assert "Culprit:" not in result.output and "no blocklist is written" in result.output
    assert "learning rate is too high" in verdict["headline"] and "no sample is to blame" in verdict["headline"]
    broke = report["window"]["broke_at"]
    assert report["window"]["from_step"] == broke  # the break is at the window's first step ...
    healthy = [
        g
        for s, g, loss in zip(report["history"]["step"], report["history"]["grad_norm"], report["history"]["loss"])
        if isinstance(loss, float) and loss < 3
    ]
    clip = {r["kind"]: r for r in report["remedies"]["tested"]}["clip_grad"]
    assert clip["setting"]["clip"] <= max(healthy)  # clipping tried at a healthy step's norm, not a diverged one
    shows = " ".join(report["history"]["shows"])
    assert "The learning rate was" in shows and "gradient norm was" in shows
    if warmup:  # ... which is not the run's first: the report says how to look earlier
        assert broke > 0 and "still rising (warm-up)" in shows
        assert any("To look before step" in s and "snapshot_every" in s for s in verdict["suggestions"])
    else:
        assert broke == 0 and "run's first recorded step" in verdict["explanation"]
        assert "constant" in shows
        # its standalone repro blames no sample either: the whole micro-batch, and why (issue 31)
        from forensics.replay.repro import write_repro

        repro = write_repro(dump, tmp_path / "repro", device="cpu", trust=True, sys_path=[str(HERE)])
        spec = json.loads((tmp_path / "repro" / "model.json").read_text())
        assert repro.sample is None and spec["blames_sample"] is False and spec["samples"] is None
        assert "the run diverged" in spec["why_no_sample"]


def test_a_gpt2_at_lr_0_3_far_above_the_uniform_guess_is_neither_stable_nor_needs_no_action(tmp_path):
    """A small GPT-2 (random init) under AdamW at lr=0.3 sits far above ln(vocabulary) when a grad-norm spike is
    dumped: the run diverged, its history is not "stable" and the advice is never "no action needed"."""
    torch.manual_seed(0)
    vocab = 64
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=vocab,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.3)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="gpt",
            dumping=DumpConfig(max_dumps=1),
            detection=DetectionConfig(
                loss_spike=SpikeConfig(enabled=False),
                grad_norm_spike=SpikeConfig(warmup=16, mad_factor=3.0, min_ratio=1.5),
            ),
        ),
    )
    data = torch.Generator().manual_seed(1)
    for step in range(80):
        ids = torch.randint(0, vocab, (8, 16), generator=data)
        guard.record_batch({"input_ids": ids, "labels": ids, "sample_ids": [f"s{step}-{i}" for i in range(8)]})
        loss = model(input_ids=ids, labels=ids).loss
        guard.record_loss(loss)
        loss.backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
        if guard.dumps:
            break
    guard.close()
    assert guard.dumps, "the run must dump a grad-norm spike"
    recent = json.loads((guard.dumps[0] / "history.json").read_text())["loss"][-8:-1]
    assert sorted(recent)[len(recent) // 2] > 1.5 * math.log(vocab)  # far above a uniform guess

    out = tmp_path / "report"
    result = CliRunner().invoke(
        main, ["replay", str(guard.dumps[0]), "--device", "cpu", "--no-rng-check", "-o", str(out)]
    )
    assert result.exit_code == 4, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert report["history_pattern"] == "diverged" and "stable" not in result.output
    assert not any("No action needed" in s for s in report["verdict"]["suggestions"])
    assert report["culprit"]["samples"] == [] and not (out / "blocklist.jsonl").exists()
    assert any("learning rate" in s for s in report["verdict"]["suggestions"])
    assert "started at 4.2" in " ".join(report["history"]["shows"])


@pytest.mark.parametrize("bisect", [True, False], ids=["bisect", "no_bisect"])
def test_a_nan_in_one_samples_input_is_that_sample_with_or_without_bisection(job, tmp_path, bisect):
    """Issue 22, item 3: the first non-finite value at `<input>.x`, 1 of 4 samples holding it: bad_sample naming
    that sample, whether or not --no-bisect is passed; the input is said to hold NaN (not 'abs-max inf')."""
    model = job.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = Guard(
        model,
        optimizer,
        loss_fn=job.mse_loss,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="nan",
            dumping=DumpConfig(recipe={"factory": "window_job:make_model"}),
        ),
    )
    dataset = job.make_dataset(64)
    dataset.dataset.x[22, 3] = float("nan")  # step 5, row 2
    with pytest.raises(TrainingFaultError) as fault:
        for batch in DataLoader(dataset, batch_size=4):
            guarded_step(guard, optimizer, batch, lambda b: job.mse_loss(model, b))
    guard.close()
    out = tmp_path / "report"
    args = [
        "replay",
        str(fault.value.dump_path),
        "--device",
        "cpu",
        "--trust",
        "--path",
        str(HERE),
        "-o",
        str(out),
        "--no-rng-check",
        *([] if bisect else ["--no-bisect"]),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "bad_sample" and report["culprit"]["module"] == "<input>.x"
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [22]
    assert [json.loads(line) for line in (out / "blocklist.jsonl").read_text().splitlines()] == [22]
    assert "holds NaN" in result.output and "abs-max inf" not in result.output
