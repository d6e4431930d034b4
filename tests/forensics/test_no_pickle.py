"""Reading a dump never unpickles: open_dump, every loader, verify_dump and archive unpacking run with pickle disabled."""

from __future__ import annotations

import pickle

import pytest
import torch

from forensics.format import pack_dump, write_dump


class PickleUsed(AssertionError):
    pass


def _forbid(*args, **kwargs):
    raise PickleUsed("a dump reader tried to unpickle")


@pytest.fixture
def no_pickle(monkeypatch):
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, _forbid)
    monkeypatch.setattr(torch, "load", _forbid)
    monkeypatch.setattr(torch.serialization, "load", _forbid)


def test_reading_a_dump_and_its_archives_never_unpickles(helpers, tmp_path, no_pickle):
    content, originals = helpers.synthetic_content()
    dump_dir = write_dump(content, tmp_path)
    with pytest.raises(PickleUsed):  # the guard itself is armed
        pickle.loads(pickle.dumps(1))  # noqa: S301 - proves the guard is armed
    for path in (dump_dir, dump_dir.parent, pack_dump(dump_dir), pack_dump(dump_dir.parent)):
        everything = helpers.read_everything(path)
        assert everything["verify"].ok
        assert helpers.bitwise_equal(everything["model"]["w"], originals["model"]["w"])
        assert everything["batches"][0]["sample_ids"] == ["doc-1", "doc-2"]


def test_reading_a_real_guard_dump_never_unpickles(helpers, gpt2, tmp_path, monkeypatch):
    from forensics.capture import DetectionConfig, Guard, GuardConfig

    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    guard = Guard(
        model,
        optimizer,
        scheduler,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="np", detection=DetectionConfig(on_nonfinite="skip")),
    )
    data = helpers.EmbedsDataset(4, poison=[3])
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler, snapshot=False)
    loop.run(
        [
            [helpers.collate(data, [0]), helpers.collate(data, [1])],
            [helpers.collate(data, [2]), helpers.collate(data, [3])],
        ]
    )
    guard.close()
    [dump_dir] = guard.dumps
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, _forbid)
    monkeypatch.setattr(torch, "load", _forbid)
    everything = helpers.read_everything(dump_dir)
    assert everything["verify"].ok and everything["sample_ids"] == [[2], [3]]
