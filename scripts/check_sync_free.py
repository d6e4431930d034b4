"""Checks GuardConfig(sync_free=True) on a device: a poisoned step is skipped on the device by fused AdamW and
dumped one step late with the exact pre-step weights and optimizer state. Prints one line; exit 1 on failure.
    python -m scripts.check_sync_free --device cuda:0
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch

from capture import Guard, GuardConfig
from forensics.format import open_dump


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0")
    device = parser.parse_args().device
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp(), run_id="sf",
                                                       on_nonfinite="continue", sync_free=True))
    bad_step, before, after = 3, None, None
    for step in range(6):
        for mb in range(2):
            embeds = torch.randn(2, 16, 32, device=device)
            if step == bad_step and mb == 1:
                embeds[0, 3] = float("inf")
            batch = {"inputs_embeds": embeds, "labels": torch.randint(0, 64, (2, 16), device=device),
                     "sample_ids": [f"s{step}-{mb}-{i}" for i in range(2)]}
            guard.record_batch(batch)
            loss = model(inputs_embeds=embeds, labels=batch["labels"]).loss
            guard.record_loss(loss)
            (loss / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == bad_step:
            before = copy.deepcopy(model.state_dict())
        if guard.check(grad_norm=norm):
            optimizer.step()
        if step == bad_step:
            after = copy.deepcopy(model.state_dict())
        optimizer.zero_grad(set_to_none=True)
    guard.close()
    problems = []
    if len(guard.dumps) != 1:
        problems.append(f"{len(guard.dumps)} dumps")
    else:
        dump = open_dump(guard.dumps[0])
        if dump.step != bad_step:
            problems.append(f"dump of step {dump.step}")
        saved = dump.model_state()
        if any(not torch.equal(saved[k], v.cpu()) for k, v in before.items()):
            problems.append("dumped weights differ from the pre-step weights")
    if any(not torch.equal(before[k], after[k]) for k in before):
        problems.append("the poisoned step was applied")
    print(f"sync_free on {device}: " + ("OK: one dump of step 3, pre-step weights bitwise, step skipped on device"
                                         if not problems else "; ".join(problems)))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
