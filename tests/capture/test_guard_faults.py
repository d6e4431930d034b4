"""The Guard under faults of its own: an unwritable dump directory, batch leaves the format cannot store,
loops that call it oddly. Training must go on (or stop with a clear TrainingFaultError under 'raise')."""

from __future__ import annotations

import pytest
import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig
from forensics.core.errors import TrainingFaultError
from forensics.format import Unreplayable, open_dump, verify_dump

POISON = 5  # sample 5: step 1, micro-batch 0 (micro-batches of 2 samples, 2 per step)
BAD_STEP = 1


def _steps(helpers, n_steps=3, extra=None):
    data = helpers.EmbedsDataset(n_steps * 4, poison=[POISON])
    steps = []
    for step in range(n_steps):
        batches = [helpers.collate(data, [step * 4 + j * 2, step * 4 + j * 2 + 1]) for j in range(2)]
        for batch in batches:
            batch.update(extra or {})
        steps.append(batches)
    return steps


def _guard(gpt2, dump_dir, policy, **config_changes):
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = GuardConfig(dump_dir=str(dump_dir), run_id="r", detection=DetectionConfig(on_nonfinite=policy))
    guard = Guard(model, optimizer, config=config.replace(**config_changes))
    return model, optimizer, guard


@pytest.fixture
def unwritable(tmp_path):
    """A dump_dir below a regular file: mkdir fails even for root."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    return blocker / "dumps"


@pytest.mark.parametrize("policy", ["skip", "continue"])
def test_unwritable_dump_dir_never_stops_training(helpers, gpt2, unwritable, policy, caplog):
    model, optimizer, guard = _guard(gpt2, unwritable, policy)
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    loop.run(_steps(helpers))
    guard.close()
    assert [log.decision for log in loop.logs] == [True, policy != "skip", True]
    assert guard.dumps == []
    # skip: one fault; continue: the NaN update makes every later step fault too
    assert len(guard.dump_errors) == (1 if policy == "skip" else 2)
    assert all("no dump written" in e and "Not a directory" in e for e in guard.dump_errors)
    messages = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("no dump written" in m and "Not a directory" in m for m in messages), messages
    assert not list(unwritable.parent.parent.glob("**/.tmp-*"))


def test_unwritable_dump_dir_under_raise_says_why_there_is_no_dump(helpers, gpt2, unwritable, caplog):
    model, optimizer, guard = _guard(gpt2, unwritable, "raise")
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    with pytest.raises(TrainingFaultError, match="NO dump was written") as info:
        loop.run(_steps(helpers))
    assert info.value.dump_path is None
    assert "Not a directory" in info.value.dump_error and str(unwritable) in info.value.dump_error
    assert info.value.trigger["kind"] == "nonfinite_loss"
    assert any("no dump written" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


def test_failed_dumps_do_not_use_up_the_cap(helpers, gpt2, unwritable, tmp_path):
    model, optimizer, guard = _guard(gpt2, unwritable, "skip", max_dumps=1)
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    loop.run(_steps(helpers, n_steps=2))
    assert guard.dumps == [] and len(guard.dump_errors) == 1
    guard.config.dump_dir = str(tmp_path / "fixed")  # the operator frees the disk / fixes the path
    data = helpers.EmbedsDataset(4, poison=[0])
    loop.step([helpers.collate(data, [0, 1]), helpers.collate(data, [2, 3])])
    guard.close()
    assert len(guard.dumps) == 1 and open_dump(guard.dumps[0]).step == 2


def test_unserialisable_batch_leaves_are_named_in_the_manifest_and_the_dump_is_still_written(
    helpers, gpt2, tmp_path, caplog
):
    extra = {"image": helpers.OpaqueImage(), "handle": object(), "note": "kept"}
    model, optimizer, guard = _guard(gpt2, tmp_path, "skip")
    loop = helpers.TrainLoop(
        model,
        optimizer,
        guard,
        snapshot=False,
        loss_fn=helpers.default_loss_fn(("sample_ids", "image", "handle", "note")),
    )
    loop.run(_steps(helpers, extra=extra))
    guard.close()
    [path] = guard.dumps
    assert verify_dump(path).ok
    dump = open_dump(path)
    expected = [
        {"path": "batch['image']", "type": "forensics_test_helpers.OpaqueImage"},
        {"path": "batch['handle']", "type": "builtins.object"},
    ]
    assert [meta["unreplayable"] for meta in dump.micro_batches_meta] == [expected, expected]
    batch = dump.micro_batch(0)
    assert batch["image"] == Unreplayable("forensics_test_helpers.OpaqueImage", "batch['image']")
    assert isinstance(batch["handle"], Unreplayable) and batch["note"] == "kept"
    assert helpers.bitwise_equal(batch["inputs_embeds"], loop.logs[BAD_STEP].micro_batches[0]["inputs_embeds"])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("OpaqueImage" in m and "unreplayable" in m for m in warnings), warnings


def test_check_without_recorded_micro_batches_and_plain_float_losses(gpt2, tmp_path):
    model, optimizer, guard = _guard(gpt2, tmp_path, "raise")
    assert guard.check() is True  # nothing recorded: nothing to judge
    guard.record_loss(1.0)  # before any record_batch: ignored
    guard.record_batch({"x": torch.zeros(2, 3)}, sample_ids=["a", "b"])
    guard.record_loss(2.5)
    assert guard.check(grad_norm=0.5) is True
    guard.record_batch({"x": torch.zeros(2, 3)}, sample_ids=["a", "b"])
    guard.record_loss(float("inf"))
    with pytest.raises(TrainingFaultError, match="loss of micro-batch 1 is inf") as info:
        guard.check(grad_norm=0.5)
    dump = open_dump(info.value.dump_path)
    assert dump.step == 2 and dump.sample_ids(0) == ["a", "b"] and dump.micro_batch(0)["x"].shape == (2, 3)
    assert guard.history.to_dict()["step"] == [0, 1, 2]
    # a job that catches the error and trains on gets fresh step numbers (no clash with the dump of step 2)
    guard.record_batch({"x": torch.zeros(2, 3)})
    guard.record_loss(float("nan"))
    with pytest.raises(TrainingFaultError) as again:
        guard.check(grad_norm=0.5)
    assert again.value.dump_path is not None and open_dump(again.value.dump_path).step == 3
    assert guard.history.to_dict()["step"] == [0, 1, 2, 3] and guard.dump_errors == []


def test_explicit_step_numbers_name_the_dump(gpt2, tmp_path):
    model, optimizer, guard = _guard(gpt2, tmp_path, "skip")
    guard.record_batch({"x": torch.ones(1)})
    guard.record_loss(torch.tensor(float("nan")))
    assert guard.check(grad_norm=torch.tensor(1.0), step=41217) is False
    [path] = guard.dumps
    assert path.parent.name == "step-000041217"
    assert open_dump(path).sample_ids(0) == ["step41217/rank0/mb1/0"]  # positional IDs when none given
    assert open_dump(path).micro_batches_meta[0]["ids_are_positional"] is True
    assert guard.step == 41218
