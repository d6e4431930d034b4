"""The sync-free check (the default with a fused optimizer; DetectionConfig(sync_free=True) asks for it): a fused AdamW
skips the poisoned step on the device, the Guard reads nothing from the device inside check(), and the dump, written
one step late, still holds the exact pre-step state. Where it would change what the Guard does, the default keeps the
synchronous check. (Spikes held on the device: tests/capture/test_guard_spike.py; a last step judged at the
interpreter's exit: tests/capture/test_exit_flush.py.)"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.utils.data import DataLoader

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, IndexedDataset, RecordConfig
from forensics.core.errors import TrainingFaultError
from forensics.format import open_dump, verify_dump
from forensics_test_helpers import ScalarReads, Watched


ACCUM, MICRO, POISON = 2, 2, 9  # sample 9: step 2 (lr still warming up), micro-batch 0
BAD_STEP, BAD_MB, STEPS = 2, 0, 6


def _setup(helpers, gpt2, tmp_path, policy, fused=True):
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    guard = Guard(
        model,
        optimizer,
        scheduler,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="run",
            detection=DetectionConfig(on_nonfinite=policy, sync_free=True),
        ),
    )
    loader = DataLoader(
        IndexedDataset(helpers.EmbedsDataset(STEPS * ACCUM * MICRO, poison=[POISON])), batch_size=MICRO, shuffle=False
    )
    batches = list(loader)
    return model, optimizer, scheduler, guard, [batches[i : i + ACCUM] for i in range(0, len(batches), ACCUM)]


def test_poisoned_step_is_skipped_on_device_and_dumped_with_its_pre_step_state(helpers, gpt2, tmp_path):
    model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, tmp_path, "skip")
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler)
    loop.run(steps)
    guard.close()

    assert [log.decision for log in loop.logs] == [True] * STEPS  # the skip happened on the device
    before, after = loop.logs[BAD_STEP], loop.logs[BAD_STEP + 1]
    for name, tensor in before.model_state.items():  # the update of the bad step was not applied
        assert helpers.bitwise_equal(after.model_state[name], tensor), name
    assert helpers.trees_equal(after.optimizer_state["state"], before.optimizer_state["state"])
    assert not helpers.trees_equal(loop.logs[BAD_STEP - 1].model_state, before.model_state)  # healthy steps update

    [path] = guard.dumps
    assert path == tmp_path / "dumps" / "run" / f"step-{BAD_STEP:09d}" / "rank-00000"
    assert verify_dump(path).ok
    dump = open_dump(path)
    assert dump.step == BAD_STEP and dump.trigger.kind == "nonfinite_loss"
    assert dump.trigger.micro_batch == BAD_MB and "one step late" in dump.trigger.detail
    helpers.assert_dump_holds_pre_step_state(dump, before, model, optimizer)
    [group] = dump.optimizer_state()["param_groups"]
    assert group["lr"] == before.optimizer_state["param_groups"][0]["lr"]  # the bad step's lr, not the next one's
    assert dump.scheduler_state()["state"]["last_epoch"] == before.scheduler_state["last_epoch"] == BAD_STEP
    for index, batch in enumerate(before.micro_batches):
        assert helpers.trees_equal(dump.micro_batch(index), batch)
    history = guard.history.to_dict()
    assert history["step"] == list(range(STEPS)) and history["skipped"] == [s == BAD_STEP for s in range(STEPS)]


def test_raise_policy_raises_at_the_next_check_naming_the_bad_step(helpers, gpt2, tmp_path):
    model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, tmp_path, "raise")
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler, snapshot=False)
    loop.run(steps[: BAD_STEP + 1])  # the bad step itself passes: its update is skipped on the device
    with pytest.raises(TrainingFaultError, match=f"step {BAD_STEP}: .*one step late") as caught:
        loop.step(steps[BAD_STEP + 1])
    guard.close()
    assert caught.value.dump_path == guard.dumps[0] and open_dump(caught.value.dump_path).step == BAD_STEP


def test_last_step_is_judged_by_close(helpers, gpt2, tmp_path):
    model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, tmp_path, "raise")
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler, snapshot=False)
    loop.run(steps[: BAD_STEP + 1])
    with pytest.raises(TrainingFaultError, match=f"step {BAD_STEP}:"):
        guard.close()
    assert len(guard.dumps) == 1 and not hasattr(optimizer, "found_inf")


@pytest.mark.parametrize("asked", [None, True], ids=["default", "asked"])
def test_healthy_steps_read_nothing_from_the_device_inside_check(helpers, gpt2, tmp_path, asked):
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="s", detection=DetectionConfig(sync_free=asked)),
    )
    data = helpers.EmbedsDataset(16)
    reads = []
    for step in range(4):
        counted = ScalarReads()
        for j in range(2):
            batch = helpers.collate(data, [step * 4 + 2 * j, step * 4 + 2 * j + 1])
            guard.record_batch(batch)
            loss = model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss
            guard.record_loss(loss.as_subclass(Watched))
            (loss / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        Watched.reads = []
        with counted:
            decision = guard.check(grad_norm=norm.as_subclass(Watched))
        reads.append((decision, list(Watched.reads), counted.count))
        optimizer.step()
        optimizer.zero_grad()
    guard.close()
    assert reads == [(True, [], 0)] * 4
    assert guard.dumps == [] and len(guard.history) == 4
    assert all(isinstance(v, float) and math.isfinite(v) for v in guard.history.to_dict()["grad_norm"])


def test_unsupported_optimizer_falls_back_to_the_synchronous_check(helpers, gpt2, tmp_path, caplog):
    model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, tmp_path, "skip", fused=False)
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler, snapshot=False)
    with caplog.at_level(logging.WARNING, logger="forensics.capture.detection.sync_free"):
        loop.run(steps)
    guard.close()
    warnings = [r for r in caplog.records if r.name == "forensics.capture.detection.sync_free"]
    assert len(warnings) == 1 and "does not honour found_inf" in warnings[0].getMessage()
    assert [log.decision for log in loop.logs] == [s != BAD_STEP for s in range(STEPS)]  # the host decided
    assert [open_dump(p).step for p in guard.dumps] == [BAD_STEP]


def reads_inside_checks(model, optimizer, guard, steps: int, scaler=None) -> list[int]:
    """Trains `steps` steps of a squared-output loss (through `scaler` when given: scale, unscale_, step, update) and
    returns how many host reads of the step's numbers each check() made."""
    reads = []
    for _ in range(steps):
        batch = {"x": torch.randn(4, 8)}
        guard.record_batch(batch)
        loss = model(batch["x"]).pow(2).mean()
        guard.record_loss(loss.as_subclass(Watched))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        Watched.reads = []
        assert guard.check()
        reads.append(len(Watched.reads))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    return reads


class Normed(torch.nn.Module):
    """A small regressor with a BatchNorm: its running statistics are persistent buffers its forward updates."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.linear(x))


@pytest.mark.parametrize(
    "setting, expected_reads",
    [
        ({}, 0),
        ({"fused": False}, 1),
        ({"batch_norm": True}, 1),
        ({"detection": DetectionConfig(on_nonfinite="continue")}, 1),
        ({"recording": RecordConfig(snapshot_every=2, window_steps=4)}, 1),
        ({"dumping": DumpConfig(recheck=True)}, 1),
    ],
    ids=["fused", "for_each", "batch_norm", "continue", "snapshots", "recheck"],
)
def test_the_default_runs_sync_free_only_where_nothing_else_changes(tmp_path, caplog, setting, expected_reads):
    """Default DetectionConfig.sync_free (None): sync-free for a fused optimizer; the synchronous check, one read in
    check() and no warning, where the sync-free check would skip a 'continue' update, miss a BatchNorm's pre-step
    statistics, or where host snapshots / the recheck run at check()."""
    setting = dict(setting)
    fused, batch_norm = setting.pop("fused", True), setting.pop("batch_norm", False)
    torch.manual_seed(0)
    model = Normed() if batch_norm else torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="d", **setting),
        loss_fn=lambda m, b: m(b["x"]).pow(2).mean(),
    )
    with caplog.at_level(logging.WARNING):
        reads = reads_inside_checks(model, optimizer, guard, 3)
        guard.close()
    assert reads == [expected_reads] * 3
    assert not [r for r in caplog.records if "sync_free is ignored" in r.getMessage()]
    notices = [r for r in caplog.records if "holds back up to" in r.getMessage()]  # said once where spikes wait
    assert len(notices) == (expected_reads == 0)
    assert guard.dumps == [] and len(guard.history) == 3


def test_a_failed_step_still_waiting_for_its_judgment_is_dumped_when_the_next_step_raises(helpers, gpt2, tmp_path):
    """Default configuration, fused AdamW: the NaN step is judged at the next check(); when the next step raises
    first, both are dumped: the NaN step (with its pre-step state) before the step that raised."""
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="run"))
    loader = DataLoader(
        IndexedDataset(helpers.EmbedsDataset(STEPS * ACCUM * MICRO, poison=[POISON])), batch_size=MICRO, shuffle=False
    )
    batches = list(loader)
    loop = helpers.TrainLoop(model, optimizer, guard)
    loop.run([batches[i : i + ACCUM] for i in range(0, (BAD_STEP + 1) * ACCUM, ACCUM)])

    def raises(model, batch):
        raise RuntimeError("the data loader returned a corrupt batch")

    loop.loss_fn = raises
    with pytest.raises(RuntimeError, match="corrupt batch"), guard.capture_errors():
        loop.step(batches[(BAD_STEP + 1) * ACCUM : (BAD_STEP + 2) * ACCUM])
    guard.close()
    dumps = [open_dump(p) for p in guard.dumps]
    assert [(d.step, d.trigger.kind.value) for d in dumps] == [
        (BAD_STEP, "nonfinite_loss"),
        (BAD_STEP + 1, "exception"),
    ]
    helpers.assert_dump_holds_pre_step_state(dumps[0], loop.logs[BAD_STEP], model, optimizer)


def test_a_grad_scaler_the_guard_was_not_given_turns_the_check_synchronous_and_the_job_runs_on(tmp_path, caplog):
    """A loop steps its fused AdamW through a GradScaler it did not pass to the Guard: GradScaler.step hands the
    optimizer its own found_inf (and deletes it after). The Guard sees its flag replaced at the first step, says so
    once, and reads each later step before optimizer.step(); the job never fails on the attributes either sets."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(tmp_path), run_id="gs"))
    with caplog.at_level(logging.WARNING):
        reads = reads_inside_checks(model, optimizer, guard, 4, scaler)
        guard.close()
    assert reads == [0, 1, 1, 1]  # the first step is judged at the second check, which then reads its own step
    said = [r.getMessage() for r in caplog.records if "GradScaler the Guard was not given" in r.getMessage()]
    assert len(said) == 1 and guard.dumps == [] and len(guard.history) == 4


def test_the_device_row_reused_from_step_to_step_reports_each_step_as_the_synchronous_check_does(tmp_path):
    """The sync-free check writes each step's numbers into one row it keeps on the device (and a new one when the
    micro-batch count changes): steps of 1, 3, 3, 2, 2 micro-batches, with and without a loop norm, give the history the
    synchronous check gives the same steps, bit for bit (losses, step loss = their sum / count, grad norm, skipped)."""
    rows = {}
    for mode in ("sync_free", "synchronous"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        guard = Guard(
            model,
            optimizer,
            config=GuardConfig(dump_dir=str(tmp_path / mode), detection=DetectionConfig(sync_free=mode == "sync_free")),
            loss_fn=lambda m, b: m(b["x"]).pow(2).mean(),
        )
        data = torch.randn(40, 4, 8)
        for step, micro in enumerate((1, 3, 3, 2, 2, 1, 3)):
            for index in range(micro):
                batch = {"x": data[step * 4 + index], "sample_ids": [step * 4 + index]}
                guard.record_batch(batch)
                loss = model(batch["x"]).pow(2).mean()
                guard.record_loss(loss)
                (loss / micro).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) if step % 2 else None
            if guard.check(grad_norm=norm):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        guard.close()
        assert guard.checks.sync_free is None or guard.checks.sync_free.active() == (mode == "sync_free")
        rows[mode] = [row[:3] + row[6:7] for row in guard.history._rows]  # step, loss, grad norm, skipped
    assert len(rows["sync_free"]) == 7
    assert rows["sync_free"] == rows["synchronous"]
