"""The Guard reads the device at most once per healthy step.

On CPU there are no CUDA syncs to count, so the test counts the two ways a host read of tensor data shows
up: (1) host-read methods (tolist, item, float(), bool(), numpy, ...) called on the losses and grad norm
handed to the Guard, seen through a tensor subclass's __torch_function__ (results of ops on them keep the
subclass, so the stacked copy the Guard fetches is counted too); (2) aten::_local_scalar_dense, the op
behind every .item()/float()/bool() of any tensor, seen through a TorchDispatchMode. What neither sees: a
.tolist() of a plain CPU tensor the Guard builds itself from model state (it does not dispatch); the GPU
benchmark (scripts/bench/capture_overhead.py) measures real syncs.
"""

from __future__ import annotations

import torch

from forensics.capture import Guard, GuardConfig, PrecursorConfig
from forensics_test_helpers import ScalarReads, Watched


def test_the_watch_itself_sees_host_reads():
    Watched.reads = []
    t = torch.tensor([1.0, 2.0]).as_subclass(Watched)
    (t * 2).sum().item()
    float(t[0])
    torch.stack([t.mean(), t.max()]).tolist()
    assert Watched.reads == ["item", "__float__", "tolist"]
    with ScalarReads() as mode:
        torch.tensor(3.0).item()
        bool(torch.tensor(True))
    assert mode.count == 2


def _train_steps(helpers, gpt2, tmp_path, steps, pass_grad_norm, precursors=None):
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(tmp_path), run_id="s", precursors=precursors))
    data = helpers.EmbedsDataset(steps * 4)
    per_step = []
    for step in range(steps):
        Watched.reads = []
        guard_reads = ScalarReads()
        for j in range(2):
            batch = helpers.collate(data, [step * 4 + 2 * j, step * 4 + 2 * j + 1])
            with guard_reads:
                guard.record_batch(batch)
            loss = model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss
            with guard_reads:
                guard.record_loss(loss.as_subclass(Watched))
            (loss / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with guard_reads:
            decision = guard.check(grad_norm=norm.as_subclass(Watched) if pass_grad_norm else None)
        optimizer.step()
        optimizer.zero_grad()
        per_step.append((decision, list(Watched.reads), guard_reads.count))
    return per_step, guard


def test_healthy_steps_read_the_device_once(helpers, gpt2, tmp_path):
    per_step, guard = _train_steps(helpers, gpt2, tmp_path, steps=3, pass_grad_norm=True)
    assert per_step == [(True, ["tolist"], 0)] * 3
    assert guard.dumps == [] and len(guard.history) == 3


def test_guard_computed_grad_norm_adds_no_host_read(helpers, gpt2, tmp_path):
    per_step, guard = _train_steps(helpers, gpt2, tmp_path, steps=2, pass_grad_norm=False)
    assert per_step == [(True, ["tolist"], 0)] * 2
    assert all(isinstance(v, float) and v > 0 for v in guard.history.to_dict()["grad_norm"])


def test_the_precursor_statistics_travel_with_the_one_read(helpers, gpt2, tmp_path):
    """Sampled steps (0 and 2) and the others alike: one read of the step's numbers, nothing else read; the
    sampled steps' statistics arrive with it."""
    per_step, guard = _train_steps(
        helpers, gpt2, tmp_path, steps=4, pass_grad_norm=True, precursors=PrecursorConfig(every=2)
    )
    assert per_step == [(True, ["tolist"], 0)] * 4
    rows = dict(guard.window._precursor_rows)
    assert sorted(rows) == [0, 2] and all(v is not None for v in rows[2])
