"""A loop that calls the Guard wrongly is told so at the first step, once, with the fix (issue 22, item 5); the
Guard never claims a loss it did not see; made-up positional sample IDs never reach a blocklist."""

from __future__ import annotations

import json
import logging
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig
from forensics.cli import main
from forensics.core.errors import TrainingFaultError

USER_MODULE = textwrap.dedent("""
    import torch

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    def tuple_mse(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "misuse_user.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("misuse_user", None)
    import misuse_user

    yield misuse_user
    sys.modules.pop("misuse_user", None)


def train(
    module, tmp_path, *, record_batch=True, record_loss=True, batch_form="tuple", steps=5, bad_step=None, policy="skip"
):
    model = module.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(
        model,
        optimizer,
        loss_fn=module.tuple_mse,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="misuse",
            detection=DetectionConfig(on_nonfinite=policy),
            dumping=DumpConfig(recipe={"factory": "misuse_user:build"}),
        ),
    )
    data = torch.Generator().manual_seed(0)
    for step in range(steps):
        x, y = torch.randn(4, 3, generator=data), torch.randn(4, 1, generator=data)
        if step == bad_step:
            x[2] = float("nan")
        batch = (x, y) if batch_form == "tuple" else {"x": x, "y": y}
        if record_batch:
            guard.record_batch(batch)
        loss = module.tuple_mse(model, (x, y))
        if record_loss:
            guard.record_loss(loss)
        loss.backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
    guard.close()
    return guard


def warnings_about(caplog, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and words in r.getMessage()]


def test_check_without_record_batch_is_said_once_at_the_first_step(user_module, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="capture")
    train(user_module, tmp_path, record_batch=False)
    said = warnings_about(caplog, "without guard.record_batch(batch)")
    assert len(said) == 1 and "Fix: call guard.record_batch(batch) once per micro-batch" in said[0]


def test_tuple_batches_without_ids_are_said_once_with_the_fix(user_module, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="capture")
    train(user_module, tmp_path, batch_form="tuple")
    said = warnings_about(caplog, "cannot read sample IDs")
    assert len(said) == 1
    assert "the batch is a tuple" in said[0] and "guard.record_batch(batch, sample_ids=ids)" in said[0]


def test_a_dict_batch_without_the_id_key_is_said_once(user_module, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="capture")
    train(user_module, tmp_path, batch_form="dict")
    said = warnings_about(caplog, "cannot read sample IDs")
    assert len(said) == 1 and "the dict batch has no 'sample_ids' key" in said[0]


def test_no_record_loss_is_said_once(user_module, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="capture")
    train(user_module, tmp_path, record_loss=False)
    said = warnings_about(caplog, "no loss was recorded")
    assert len(said) == 1 and "guard.record_loss(loss)" in said[0]


def test_a_loop_used_right_gets_no_usage_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="capture")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        model,
        optimizer,
        loss_fn=lambda m, b: m(b["x"]).pow(2).mean(),
        config=GuardConfig(dump_dir=str(tmp_path), dumping=DumpConfig(recipe={"factory": "x:y"})),
    )
    for step in range(3):
        batch = {"x": torch.randn(2, 3), "sample_ids": [f"a{step}", f"b{step}"]}
        guard.record_batch(batch)
        loss = model(batch["x"]).pow(2).mean()
        guard.record_loss(loss)
        loss.backward()
        guard.check()
        optimizer.step()
        optimizer.zero_grad()
    assert not [r for r in caplog.records if "forensics.capture.recording.misuse" in r.name]


def test_without_record_batch_a_nan_loss_is_still_seen(user_module, tmp_path):
    with pytest.raises(TrainingFaultError) as raised:
        train(user_module, tmp_path, record_batch=False, bad_step=3, policy="raise")
    assert raised.value.trigger["kind"] == "nonfinite_loss" and "is nan" in raised.value.trigger["detail"]


def test_a_loss_never_recorded_is_never_claimed_finite(user_module, tmp_path):
    with pytest.raises(TrainingFaultError) as raised:
        train(user_module, tmp_path, record_batch=False, record_loss=False, bad_step=3, policy="raise")
    detail = raised.value.trigger["detail"]
    assert "finite loss" not in detail and "the loss is unknown: record_loss was not called" in detail


def test_positional_ids_never_reach_the_blocklist_and_the_report_says_why(user_module, tmp_path):
    guard = train(user_module, tmp_path, batch_form="tuple", bad_step=3)
    assert len(guard.dumps) == 1
    manifest = json.loads((guard.dumps[0] / "manifest.json").read_text())
    assert manifest["micro_batches"][0]["ids_are_positional"] is True
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(guard.dumps[0]),
            "--device",
            "cpu",
            "--trust",
            "--no-rng-check",
            "--path",
            str(tmp_path),
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    report = json.loads((out / "report.json").read_text())
    samples = report["culprit"]["samples"]
    assert [s["sample_id"] for s in samples] == ["step3/rank0/mb1/2"] and samples[0]["positional"] is True
    assert not (out / "blocklist.jsonl").exists()
    suggestions = " ".join(report["verdict"]["suggestions"])
    assert "No blocklist entry for 'step3/rank0/mb1/2'" in suggestions and "blocklist.jsonl lists" not in suggestions
    explicit = tmp_path / "mine.jsonl"  # asked for by name: written, without the made-up ID
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(guard.dumps[0]),
            "--device",
            "cpu",
            "--trust",
            "--no-rng-check",
            "--path",
            str(tmp_path),
            "-o",
            str(out),
            "--blocklist",
            str(explicit),
        ],
    )
    assert result.exit_code == 0 and explicit.read_text() == ""


def _loop(tmp_path, order: str, steps: int = 5, scaler=None, fused: bool = False):
    """A small regression loop whose calls come in `order` ('right', 'check_before_backward', 'check_twice')."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    guard = Guard(
        model,
        optimizer,
        scaler=scaler,
        loss_fn=lambda m, b: m(b["x"]).pow(2).mean(),
        config=GuardConfig(dump_dir=str(tmp_path), dumping=DumpConfig(recipe={"factory": "x:y"})),
    )
    data = torch.Generator().manual_seed(0)
    for step in range(steps):
        batch = {"x": torch.randn(4, 3, generator=data), "sample_ids": [f"{step}-{i}" for i in range(4)]}
        guard.record_batch(batch)
        loss = model(batch["x"]).pow(2).mean()
        guard.record_loss(loss)
        if order == "check_before_backward":
            guard.check()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if order in ("check_twice", "right"):
            guard.check()
        if order == "check_twice":
            guard.check()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    return guard


@pytest.mark.parametrize("fused", [False, True], ids=["synchronous", "sync_free"])
def test_check_before_backward_is_said_once_with_the_fix(tmp_path, caplog, fused):
    """Issue 42 item 7: check() before backward() sees no gradients; said once at once (host state, no device read)."""
    caplog.set_level(logging.WARNING, logger="capture")
    _loop(tmp_path, "check_before_backward", fused=fused)
    said = warnings_about(caplog, "found no gradients")
    assert len(said) == 1 and "step 0" in said[0] and "after loss.backward()" in said[0]


@pytest.mark.parametrize("fused", [False, True], ids=["synchronous", "sync_free"])
def test_check_twice_per_step_is_said_once_and_the_step_counter_does_not_run_double(tmp_path, caplog, fused):
    caplog.set_level(logging.WARNING, logger="capture")
    guard = _loop(tmp_path, "check_twice", fused=fused)
    guard.close()
    said = warnings_about(caplog, "check() was called again for step 0")
    assert len(said) == 1 and "once per optimizer step" in said[0]
    assert guard.history.to_dict()["step"] == list(range(5)) and guard.step == 5


def test_a_right_loop_is_not_taken_for_a_repeat_or_a_missing_backward(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="capture")
    for fused in (False, True):
        guard = _loop(tmp_path / str(fused), "right", fused=fused)
        guard.close()
        assert guard.history.to_dict()["step"] == list(range(5))
    assert not warnings_about(caplog, "found no gradients") and not warnings_about(caplog, "called again")


def test_a_grad_norm_of_still_scaled_gradients_is_unscaled_and_said_once(tmp_path, caplog):
    """Issue 42 item 7: a loop that passes check() the norm of gradients the GradScaler still holds scaled (the issue's
    history showed 56,702 at a scale of 65,536): the history holds the unscaled norm, and the loop is told the fix."""
    caplog.set_level(logging.WARNING, logger="capture")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    guard = Guard(
        model,
        optimizer,
        scaler=scaler,
        loss_fn=lambda m, b: m(b["x"]).pow(2).mean(),
        config=GuardConfig(dump_dir=str(tmp_path), dumping=DumpConfig(recipe={"factory": "x:y"})),
    )
    data = torch.Generator().manual_seed(0)
    unscaled = []
    for step in range(4):
        batch = {"x": torch.randn(4, 3, generator=data), "sample_ids": [f"{step}-{i}" for i in range(4)]}
        guard.record_batch(batch)
        loss = model(batch["x"]).pow(2).mean()
        guard.record_loss(loss)
        scaler.scale(loss).backward()
        unscaled.append(
            float(
                torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])) / scaler.get_scale()
            )
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # before scaler.unscale_: scaled
        if guard.check(grad_norm=grad_norm):
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    guard.close()
    recorded = guard.history.to_dict()["grad_norm"]
    assert recorded == pytest.approx(unscaled, rel=1e-5)
    said = warnings_about(caplog, "still holds scaled")
    assert len(said) == 1 and "scaler.unscale_(optimizer) before clip_grad_norm_" in said[0]


def test_a_grad_norm_taken_before_unscale_and_passed_after_it_is_found_out_when_the_step_is_dumped(tmp_path, caplog):
    """Issue 42 item 7, the other order: the norm was taken before scaler.unscale_ and passed to check() after it
    (the gradients are unscaled by then: nothing to see on a healthy step without a device read). When a step is
    dumped (here a loss spike), the Guard compares it with the gradients' own norm, says so once, and the dump
    records the unscaled norm."""
    from forensics.capture import DetectionConfig, SpikeConfig
    from forensics.format import open_dump

    caplog.set_level(logging.WARNING, logger="capture")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=10**6)
    guard = Guard(
        model,
        optimizer,
        scaler=scaler,
        loss_fn=lambda m, b: m(b["x"]).pow(2).mean(),
        config=GuardConfig(
            dump_dir=str(tmp_path),
            run_id="late",
            detection=DetectionConfig(loss_spike=SpikeConfig(window=8, warmup=4)),
            dumping=DumpConfig(recipe={"factory": "x:y"}),
        ),
    )
    data = torch.Generator().manual_seed(0)
    spike = 6
    for step in range(spike + 1):
        batch = {"x": torch.randn(4, 3, generator=data), "sample_ids": [f"{step}-{i}" for i in range(4)]}
        guard.record_batch(batch)
        loss = model(batch["x"]).pow(2).mean() + (50.0 if step == spike else 0.0)
        guard.record_loss(loss)
        scaler.scale(loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # taken while still scaled ...
        scaler.unscale_(optimizer)  # ... and passed after unscale_
        if step == spike:
            unscaled = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        if guard.check(grad_norm=grad_norm):
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    guard.close()
    [path] = guard.dumps
    loss_block = open_dump(path).manifest["loss"]
    assert loss_block["grad_norm"] == pytest.approx(unscaled, rel=1e-5)
    assert loss_block["grad_norm_unscaled_by"] == 2.0**16
    said = warnings_about(caplog, "taken before scaler.unscale_(optimizer)")
    assert len(said) == 1 and f"step {spike}" in said[0]
