"""Buffers a forward updates (BatchNorm's running statistics and counter): the dump holds them as they were before
the step's first forward, and the 'skip' policy undoes the skipped step's update of them, bit for bit."""

from __future__ import annotations

import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig
from forensics.capture.state.buffers import PreForwardBuffers
from forensics.format import open_dump
from forensics_test_helpers import bitwise_equal  # tests/helpers.py


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 3),
    )


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for step in range(4):
        x = torch.randn(6, 3, 8, 8, generator=g)
        if step == 2:
            x[4, 1, 3, 3] = float("inf")  # one pixel: BatchNorm's batch statistics turn every sample NaN
        batches.append(
            {
                "image": x,
                "label": torch.randint(0, 3, (6,), generator=g),
                "sample_ids": [f"img-{step}-{i}" for i in range(6)],
            }
        )
    return batches


def _train(model, optimizer, batches, guard=None, seen=None):
    for step, batch in enumerate(batches):
        if guard is not None:
            guard.record_batch(batch)
        if seen is not None:
            seen[step] = {k: v.clone() for k, v in model.state_dict().items()}
        loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
        if guard is not None:
            guard.record_loss(loss)
        loss.backward()
        if guard is None or guard.check():
            optimizer.step()
        optimizer.zero_grad()


def test_a_skipped_step_leaves_batchnorm_statistics_as_if_it_never_ran_and_the_dump_holds_them(tmp_path):
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="bn", detection=DetectionConfig(on_nonfinite="skip")),
    )
    before = {}
    _train(model, optimizer, _batches(), guard, before)
    guard.close()

    reference = _net()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    healthy = [b for i, b in enumerate(_batches()) if i != 2]  # what 'skip' promises: step 2 never happened
    _train(reference, reference_optimizer, healthy)
    for name, value in reference.state_dict().items():
        assert bitwise_equal(model.state_dict()[name], value), name

    [dump] = guard.dumps
    weights = open_dump(dump).model_state()
    assert int(weights["1.num_batches_tracked"]) == 2  # not 3: the failing forward's update is not in the dump
    for name, value in before[2].items():
        assert bitwise_equal(weights[name], value), name
    assert torch.isfinite(weights["1.running_mean"]).all() and torch.isfinite(weights["1.running_var"]).all()


def test_only_persistent_buffers_are_copied_and_a_huge_set_turns_itself_off(monkeypatch):
    model = _net()
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    buffers = PreForwardBuffers(model)
    buffers.take()
    assert sorted(buffers.before()) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    monkeypatch.setattr("forensics.capture.state.buffers.MAX_BYTES", 8)
    big = PreForwardBuffers(_net())
    big.take()
    assert big.off and big.before() == {} and big.restore() == 0
