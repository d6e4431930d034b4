"""No value a training loop can pass to record_batch / record_loss / check stops a healthy job, and odd
sample IDs never cost the dump (they are stored as their repr)."""

from __future__ import annotations

import logging

import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig
from forensics.format import open_dump


class NoFloat:
    def __float__(self):
        raise RuntimeError("cannot convert")


class IdsThatRaise:
    def __iter__(self):
        raise AttributeError("broken id container")


def _loop(tmp_path, losses, sample_ids=None, policy="raise"):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="odd", detection=DetectionConfig(on_nonfinite=policy)),
    )
    decisions = []
    for _step, extra in enumerate(losses):
        x = torch.randn(4, 3)
        guard.record_batch({"x": x}, sample_ids=sample_ids)
        loss = model(x).pow(2).mean()
        guard.record_loss(extra if extra is not None else loss)
        loss.backward()
        decisions.append(guard.check(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
    guard.close()
    return guard, decisions


def test_odd_loss_values_never_raise_and_never_trigger(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    guard, decisions = _loop(tmp_path, [None, 10**400, -(10**400), NoFloat(), torch.empty(0), "x", object(), None])
    assert decisions == [True] * 8 and guard.dumps == [] and guard.dump_errors == []
    assert "does not convert" in caplog.text and "empty tensor" in caplog.text


def test_odd_sample_ids_are_stored_as_their_repr_and_the_dump_is_written(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    guard, _ = _loop(tmp_path, [None, float("nan")], sample_ids=IdsThatRaise(), policy="continue")
    assert len(guard.dumps) == 1, guard.dump_errors
    ids = open_dump(guard.dumps[0]).sample_ids(0)
    assert len(ids) == 1 and "IdsThatRaise" in ids[0]
    guard, _ = _loop(
        tmp_path / "b", [None, float("nan")], sample_ids=[object(), 2**70, "ok", float("inf")], policy="continue"
    )
    ids = open_dump(guard.dumps[0]).sample_ids(0)
    assert ids[2] == "ok" and "object" in ids[0] and ids[1] == str(2**70) and ids[3] == "inf"


def test_an_out_of_memory_error_records_the_memory_picture_of_each_micro_batch():
    from forensics.capture.raised.exceptions import exception_section

    batches = [
        {"input_ids": torch.zeros(4, 128, dtype=torch.long)},
        {"input_ids": torch.zeros(4, 4096, dtype=torch.long)},
    ]
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    try:
        raise oom("CUDA out of memory. Tried to allocate 2.00 GiB")
    except oom as exc:
        section = exception_section(exc, "forward", batches)
    assert section["type"] == "OutOfMemoryError" and section["during"] == "forward"
    sizes = [m["bytes"] for m in section["memory"]["micro_batches"]]
    assert sizes == [4 * 128 * 8, 4 * 4096 * 8] and section["memory"]["micro_batches"][1]["shapes"] == {
        "input_ids": [4, 4096]
    }
    assert (
        section["frames"][-1]["function"]
        == "test_an_out_of_memory_error_records_the_memory_picture_of_each_micro_batch"
    )


def test_the_excepthook_holds_guards_weakly_and_goes_when_the_last_is_closed():
    import gc
    import sys

    from forensics.capture.raised import exceptions

    before = sys.excepthook
    models = [torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)]
    first = Guard(models[0], torch.optim.SGD(models[0].parameters(), lr=0.1), config=GuardConfig(run_id="w1"))
    second = Guard(models[1], torch.optim.SGD(models[1].parameters(), lr=0.1), config=GuardConfig(run_id="w2"))
    assert sys.excepthook is exceptions._excepthook and len(exceptions._WATCHED) >= 2
    del first, models[0]  # a job that drops its model and Guard without close(): the hook does not keep them
    gc.collect()
    assert second in exceptions._WATCHED and len([g for g in exceptions._WATCHED if g.run_id == "w1"]) == 0
    second.close()
    if not exceptions._WATCHED:
        assert sys.excepthook is before or sys.excepthook is sys.__excepthook__
