"""Finite loss spikes on a real GPT-2: under the continue policy training goes on, dumps are written in the
background with the pre-step state, and max_dumps / min_spike_gap bound how many. Each runs with both checks the
default configuration picks: the synchronous one (AdamW's for-each step) and the sync-free one (AdamW(fused=True):
a spike the budget dumps is held on the device and judged one step late; capture/detection/sync_free.py)."""

from __future__ import annotations

import math

import pytest
import torch

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, SpikeConfig
from forensics.core.errors import TrainingFaultError
from forensics.format import open_dump, verify_dump

SEQ = torch.arange(8)
WRONG = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(5))
WARM = 30  # steps on one repeated sequence: the model becomes confident (loss ~0.01) ...
# ... then one sample per spike step carries labels it cannot predict: a finite, ~100x jump of its loss


def micro_batch(step: int, index: int, spike: bool) -> dict:
    ids = torch.stack([SEQ, SEQ])
    labels = ids.clone()
    if spike and index == 1:
        labels[0] = WRONG
    return {"input_ids": ids, "labels": labels, "sample_ids": [f"s{step}-{index}-{j}" for j in range(2)]}


FUSED = pytest.mark.parametrize("fused", [False, True], ids=["synchronous", "sync_free"])


def run(helpers, gpt2, tmp_path, spike_steps, total, fused=False, **config):
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    config.setdefault("loss_spike", SpikeConfig(window=16, warmup=8))
    guard = Guard(
        model,
        optimizer,
        scheduler,
        config=GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="spiky").replace(**config),
    )
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler)
    loop.run([[micro_batch(step, i, step in spike_steps) for i in range(2)] for step in range(total)])
    guard.close()
    return guard, loop


@FUSED
def test_spike_under_continue_policy_writes_a_dump_in_the_background_and_training_goes_on(
    helpers, gpt2, tmp_path, fused, caplog
):
    caplog.set_level("WARNING", logger="capture")
    guard, loop = run(helpers, gpt2, tmp_path, spike_steps={WARM}, total=WARM + 3, fused=fused)
    # sync-free: said once, at the first check, with the setting that applies every update (issue 42 item 2) ...
    notices = [r.getMessage() for r in caplog.records if "holds back up to" in r.getMessage()]
    assert len(notices) == int(fused)
    if fused:
        assert "up to 3 spike steps per run" in notices[0] and "DetectionConfig(sync_free=False)" in notices[0]
        assert caplog.records[0].getMessage() == notices[0]  # before any step was judged
    # ... and the held-back step, in one line when it is judged
    held = [
        r.getMessage() for r in caplog.records if f"step {WARM} " in r.getMessage() and "held back" in r.getMessage()
    ]
    assert len(held) == int(fused)
    assert all(log.decision for log in loop.logs)  # continue: check() let every optimizer step run
    held = helpers.trees_equal(loop.logs[WARM + 1].model_state, loop.logs[WARM].model_state)
    assert held == fused  # sync-free: the dumped spike's update waited on the device for its judgment, and was dropped
    assert not helpers.trees_equal(loop.logs[WARM + 2].model_state, loop.logs[WARM + 1].model_state)
    [path] = guard.dumps
    assert verify_dump(path).ok
    dump = open_dump(path)
    assert dump.step == WARM and dump.trigger.kind == "loss_spike" and dump.trigger.micro_batch == 1
    assert dump.trigger.value > dump.trigger.threshold > 0
    assert dump.sample_ids(1) == [f"s{WARM}-1-0", f"s{WARM}-1-1"]
    assert torch.equal(dump.micro_batch(1)["labels"][0], WRONG)
    # the background writer copied the state before optimizer.step() changed it
    log = loop.logs[WARM]
    state = dump.model_state()
    for name, tensor in log.model_state.items():
        assert helpers.bitwise_equal(state[name], tensor), name
    expected = helpers.optimizer_state_by_name(log.optimizer_state, guard.model, guard.optimizer)
    for name, entries in expected.items():
        for key, value in entries.items():
            assert helpers.bitwise_equal(dump.optimizer_state()["state"][name][key], value), (name, key)
    losses = dump.history()["loss"]
    assert len(losses) == WARM + 1 and losses[-1] == dump.trigger.value
    assert dump.trigger.value > 20 * sorted(losses[WARM - 8 : WARM])[4]
    assert guard.history.to_dict()["skipped"] == [fused and s == WARM for s in range(WARM + 3)]


def sized_micro_batch(step: int, index: int, wrong: int) -> dict:
    """`wrong` of the step's 4 samples (2 micro-batches of 2) carry labels the model cannot predict: the spike's size."""
    batch = micro_batch(step, index, False)
    for j in range(2):
        if 2 * index + j < wrong:
            batch["labels"][j] = WRONG
    return batch


@FUSED
def test_spike_dumps_keep_the_first_and_the_largest_and_the_crash_keeps_its_own_place(
    helpers, gpt2, tmp_path, caplog, fused
):
    """max_spike_dumps=2: the first spike stays; a larger later one replaces the smaller second one on disk (its
    step directory gone); smaller ones are counted, logged once, and written into the crash dump's manifest; the NaN
    at the end still gets its dump (max_dumps=1 is the crash's own)."""
    caplog.set_level("WARNING", logger="capture")
    sizes = {WARM: 1, WARM + 3: 1, WARM + 6: 4, WARM + 9: 1, WARM + 10: 1}
    nan_step = WARM + 12
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="spiky",
            detection=DetectionConfig(loss_spike=SpikeConfig(window=16, warmup=8)),
            dumping=DumpConfig(max_dumps=1, max_spike_dumps=2, min_spike_gap=0),
        ),
    )
    base = helpers.default_loss_fn(("sample_ids", "factor"))
    loop = helpers.TrainLoop(model, optimizer, guard, loss_fn=lambda m, b: base(m, b) * b.get("factor", 1.0))
    steps = [[sized_micro_batch(step, i, sizes.get(step, 0)) for i in range(2)] for step in range(nan_step + 1)]
    steps[nan_step][1]["factor"] = float("nan")
    with pytest.raises(TrainingFaultError):
        loop.run(steps + [steps[0]])  # sync-free: the NaN raises at the next step's check
    guard.close()
    assert len(loop.logs) == nan_step + 1 + fused
    on_disk = sorted(p.name for p in (tmp_path / "dumps" / "spiky").iterdir())
    assert on_disk == [f"step-{s:09d}" for s in (WARM, WARM + 6, nan_step)]  # WARM + 3 was replaced, no empty dir
    crash = open_dump(tmp_path / "dumps" / "spiky" / f"step-{nan_step:09d}" / "rank-00000")
    assert crash.trigger.kind == "nonfinite_loss"
    budget = crash.manifest["dump_budget"]
    assert budget["spike_dumps_kept"] == [WARM, WARM + 6]
    assert budget["not_dumped"]["loss_spike"]["smaller_than_kept"] >= 2  # WARM + 9, WARM + 10 (and echoes)
    assert sorted(p.parent.name for p in guard.dumps) == on_disk
    lines = [r.getMessage() for r in caplog.records if "not dumped" in r.getMessage()]
    assert len(lines) == 2 and "max_spike_dumps" in lines[0]  # the first with the rule, then one count at close()
    assert "1 more trigger(s)" in lines[1]


@FUSED
def test_spikes_closer_than_min_spike_gap_are_counted_and_logged_once(helpers, gpt2, tmp_path, caplog, fused):
    spikes = set(range(WARM, WARM + 5))
    caplog.set_level("WARNING", logger="capture")
    guard, loop = run(
        helpers, gpt2, tmp_path, spike_steps=spikes, total=WARM + 6, fused=fused, max_spike_dumps=10, min_spike_gap=3
    )
    assert sorted(open_dump(p).step for p in guard.dumps) == [WARM, WARM + 3]
    # sync-free: only the two dumped spikes were held on the device; the counted ones were applied
    assert [s for s, skipped in enumerate(guard.history.to_dict()["skipped"]) if skipped] == (
        [WARM, WARM + 3] if fused else []
    )
    refused = [r.getMessage() for r in caplog.records if "not dumped" in r.getMessage()]
    assert len(refused) == 2  # the first refusal with its reason, then one line with the count at close()
    assert "min_spike_gap" in refused[0] and "more trigger(s)" in refused[1] and "min_spike_gap" in refused[1]


def test_a_healthy_run_writes_nothing(helpers, gpt2, tmp_path):
    guard, loop = run(helpers, gpt2, tmp_path, spike_steps=set(), total=WARM + 4)
    assert guard.dumps == [] and guard.dump_errors == []
    assert not (tmp_path / "dumps").exists()


def test_background_write_into_an_unwritable_dir_is_logged_and_training_goes_on(helpers, gpt2, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    guard, loop = run(helpers, gpt2, blocker, spike_steps={WARM}, total=WARM + 2)
    assert all(log.decision for log in loop.logs)
    assert guard.dumps == []
    [error] = guard.dump_errors
    assert "no dump written" in error and "Not a directory" in error
    assert any("no dump written" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


def test_an_early_spike_is_logged_once_and_marked_in_the_history(tmp_path, caplog):
    """A custom regressor whose loss jumps from ~4 to 6.25e6 at step 30 (inside the 32-step warm-up): no dump,
    but one warning that says how to catch it, and the step is marked in the history."""
    import logging

    from forensics.capture import Guard, GuardConfig

    caplog.set_level(logging.WARNING)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(tmp_path), run_id="early"), loss_fn=None)
    for step in range(32):
        x = torch.randn(16, 4)
        y = torch.full((16, 1), 2.0) + (2500.0 if step == 30 else 0.0)
        guard.record_batch({"x": x})
        loss = torch.nn.functional.mse_loss(model(x), y)
        guard.record_loss(loss)
        loss.backward()
        assert guard.check()
        optimizer.step()
        optimizer.zero_grad()
    guard.close()
    history = guard.history.to_dict()
    assert guard.dumps == []
    assert history["suppressed"][30] == "loss_spike" and history["suppressed"][:30] == [None] * 30
    warnings = [r.message for r in caplog.records if "warming up" in r.message]
    assert len(warnings) == 1 and "step 30" in warnings[0] and "SpikeConfig(warmup=" in warnings[0]


def test_a_jump_at_step_1_is_noted_before_there_is_a_median():
    from forensics.capture.detection.detectors import SpikeDetector
    from forensics.capture.config import SpikeConfig

    detector = SpikeDetector(SpikeConfig())
    assert detector.observe(4.9) is None and detector.suppressed is None
    assert detector.observe(186.0) is None and detector.suppressed == pytest.approx(49.0)
    assert detector.observe(150.0) is None and detector.suppressed is None  # not 10x the largest so far


def test_fp16_a_loss_spike_on_a_step_whose_gradients_overflow_is_dumped(tmp_path):
    """Issue 42 item 3: the GradScaler finds inf gradients at the spike step (it skips that update); the loss, 40x
    its median, is still checked and the step dumped with its pre-step state; its inf norm stays out of the grad-norm
    detector."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10**6)
    guard = Guard(
        model,
        optimizer,
        scaler=scaler,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="fp16",
            detection=DetectionConfig(loss_spike=SpikeConfig(window=16, warmup=8)),
        ),
    )
    data = torch.Generator().manual_seed(1)
    spike = 12
    for step in range(spike + 2):
        x = torch.randn(8, 4, generator=data)
        guard.record_batch({"x": x, "sample_ids": list(range(8 * step, 8 * step + 8))})
        loss = torch.nn.functional.mse_loss(model(x), torch.zeros(8, 1)) + (40.0 if step == spike else 0.0)
        guard.record_loss(loss)
        scaler.scale(loss).backward()
        if step == spike:
            model.weight.grad[0, 0] = float("inf")  # fp16's overflow, as the scaler finds it
        scaler.unscale_(optimizer)
        if guard.check():
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    guard.close()
    [path] = guard.dumps
    dump = open_dump(path)
    assert dump.step == spike and dump.trigger.kind == "loss_spike" and dump.trigger.value > 20
    history = guard.history.to_dict()
    assert history["skipped"][spike] and not any(history["skipped"][:spike])  # the scaler skipped it
    assert all(math.isfinite(v) for v in guard.checks.detectors.grad_norm._window)
