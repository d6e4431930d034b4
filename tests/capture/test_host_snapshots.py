"""The Guard's own host snapshots (RecordConfig.snapshot_every): bitwise the pre-step state of their step, rotating
slots, a slot lent to a dump writer is not overwritten, and a snapshot that would not fit is refused."""

from __future__ import annotations

import logging

import torch

from forensics.capture import Guard, GuardConfig, RecordConfig
from forensics.capture.state import host_snapshots


def _adam_job(steps: int, config: GuardConfig, seen: dict | None = None) -> Guard:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, optimizer, config=config)
    for step in range(steps):
        x = torch.randn(4, 6)
        guard.record_batch({"x": x}, sample_ids=[f"s{step}-{i}" for i in range(4)])
        loss = model(x).pow(2).mean()
        guard.record_loss(loss)
        loss.backward()
        assert guard.check()
        if seen is not None:  # what the job's state is right before this step's update
            seen[step] = {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": {
                    name: {k: v.clone() for k, v in optimizer.state[p].items()}
                    for name, p in model.named_parameters()
                    if p in optimizer.state
                },
            }
        optimizer.step()
        optimizer.zero_grad()
    return guard


def test_snapshots_are_bitwise_the_pre_step_state_and_rotate(tmp_path):
    seen: dict = {}
    guard = _adam_job(
        7,
        GuardConfig(dump_dir=str(tmp_path), recording=RecordConfig(snapshot_every=2, snapshot_count=2, window_steps=8)),
        seen,
    )
    held, release = guard.snapshots.lend_oldest(first_step=0)
    assert held["step"] == 4  # taken at 0, 2, 4, 6; two kept: 4 and 6
    expected = seen[4]
    assert all(torch.equal(held["model"][k], v) for k, v in expected["model"].items())
    for name, entries in expected["optimizer"].items():
        for key, value in entries.items():  # exp_avg, exp_avg_sq and the step count, as they were
            assert torch.equal(held["optimizer"]["state"][name][key], value), (name, key)
    assert held["optimizer"]["param_groups"][0]["lr"] == 1e-2
    state_bytes = sum(v.numel() * v.element_size() for v in expected["model"].values()) * 3 + 4 * 4  # + 4 steps
    assert guard.snapshots.bytes_held == 2 * state_bytes
    release()
    guard.close()


def test_a_slot_lent_to_a_dump_writer_is_not_overwritten(tmp_path):
    guard = _adam_job(
        5,
        GuardConfig(dump_dir=str(tmp_path), recording=RecordConfig(snapshot_every=2, snapshot_count=2, window_steps=8)),
    )
    held, release = guard.snapshots.lend_oldest(first_step=0)  # step 2 (slots hold 2 and 4)
    kept = {k: v.clone() for k, v in held["model"].items()}
    model, optimizer = guard.model, guard.optimizer
    for _step in range(5, 9):  # snapshots due at 6 and 8: both go to the free slot
        x = torch.randn(4, 6)
        guard.record_batch({"x": x})
        model(x).pow(2).mean().backward()
        guard.check()
        optimizer.step()
        optimizer.zero_grad()
    assert held["step"] == 2 and all(torch.equal(held["model"][k], v) for k, v in kept.items())
    assert guard.snapshots.lend_oldest(first_step=3)[0]["step"] == 8
    release()
    assert guard.snapshots.lend_oldest(first_step=0)[0]["step"] == 2
    guard.close()


def test_a_snapshot_larger_than_half_the_available_memory_is_refused_and_training_goes_on(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(host_snapshots, "available_host_memory", lambda: 1000)  # bytes: this machine "has" 1 KB
    with caplog.at_level(logging.WARNING, logger="forensics.capture.state.host_snapshots"):
        guard = _adam_job(
            4, GuardConfig(dump_dir=str(tmp_path), recording=RecordConfig(snapshot_every=1, snapshot_count=2))
        )
    assert guard.snapshots.bytes_held == 0 and "snapshot_count" in guard.snapshots.off_because
    assert sum("host snapshots" in r.message for r in caplog.records) == 1  # said once
    assert guard.snapshots.lend_oldest(0)[0] is None and guard.step == 4
    guard.close()
