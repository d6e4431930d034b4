"""Steps over the dump budget are logged once, then once per window with a count — never a line per step, whatever
the policy (docs/GUIDE.md "Dump budgets"; issue 50, item 6: under on_nonfinite='skip' every skipped step over the
budget logged its own line)."""

from __future__ import annotations

import logging

import torch

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig


def test_skipped_steps_over_the_budget_are_not_a_line_per_step(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = GuardConfig(
        dump_dir=str(tmp_path),
        run_id="skips",
        detection=DetectionConfig(on_nonfinite="skip"),
        dumping=DumpConfig(max_dumps=1),
    )
    guard = Guard(model, optimizer, config=config, loss_fn=None)
    decisions = []
    for step in range(12):
        x = torch.randn(8, 4)
        if step >= 2:
            x[0, 0] = float("nan")  # every step from 2 on is non-finite: skipped
        guard.record_batch({"x": x, "sample_ids": list(range(8 * step, 8 * step + 8))})
        loss = model(x).pow(2).mean()
        guard.record_loss(loss)
        loss.backward()
        decisions.append(guard.check())
        if decisions[-1]:
            optimizer.step()
        optimizer.zero_grad()
    guard.close()
    assert decisions[:2] == [True, True] and not any(decisions[2:])  # the policy still skips every one
    assert len(guard.dumps) == 1
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("forensics")]
    per_step = [m for m in lines if "(policy: skip)" in m]
    assert len(per_step) == 1, per_step  # the dumped step only
    not_dumped = [m for m in lines if "not dumped" in m]
    assert 1 <= len(not_dumped) <= 2, not_dumped  # once when it starts, once with the count (at close)
    assert any("8 more trigger(s) in steps 4-" in m for m in not_dumped), not_dumped  # steps 4-11
