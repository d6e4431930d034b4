"""Checks the sync-free check (the default GuardConfig with a fused AdamW in one process) on a device:

1. healthy steps: check() makes no device->host sync (CUDA's sync debug mode counts none inside it);
2. a NaN step: its update is skipped on the device by the fused AdamW, the next check() raises TrainingFaultError
   naming it, and its dump holds the exact pre-step weights;
3. a finite loss spike after the detectors' warm-up: the dump budget takes it, so its update is held on the device;
   its dump holds the exact pre-step weights, training goes on, and the next steps update again.
Prints one line per part; exit 1 on a failure.
    python -m scripts.check_sync_free --device cuda:0
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import warnings

import torch

from forensics.capture import Guard, GuardConfig
from forensics.core.errors import TrainingFaultError
from forensics.format import open_dump

SEQ, WARM = 16, 40  # the spike comes after the default 32-step warm-up of the loss detector


def model_and_optimizer(device: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def step(model, optimizer, guard, ids, labels, sample_ids, embeds=None) -> tuple[bool, list[str]]:
    """One step of two micro-batches; returns check()'s decision and where check() synced (file:line each)."""
    for mb in range(2):
        batch = {"input_ids": ids, "labels": labels, "sample_ids": [f"{sample_ids}-{mb}-{i}" for i in range(2)]}
        guard.record_batch(batch)
        loss = (
            model(input_ids=ids, labels=labels).loss
            if embeds is None or mb == 0
            else model(inputs_embeds=embeds, labels=labels).loss
        )
        guard.record_loss(loss)
        (loss / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if ids.is_cuda:  # the previous step's numbers have landed: what is counted below is check()'s own syncs (on a
        torch.cuda.synchronize()  # real run check() waits for them only when the GPU is a whole step behind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ids.is_cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            decision = guard.check(grad_norm=norm)
        finally:
            if ids.is_cuda:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [
        f"{w.filename}:{w.lineno}"
        for w in caught  # where check() synced ("called a synchronizing CUDA op")
        if "called a synchronizing" in str(w.message)
    ]
    if decision:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return decision, syncs


def weights_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def check_nan(device: str) -> list[str]:
    model, optimizer = model_and_optimizer(device)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp(), run_id="nan"))
    ids = torch.randint(0, 64, (2, SEQ), device=device)
    bad_step, problems, syncs = 3, [], []
    before = after = None
    try:
        for s in range(6):
            embeds = None
            if s == bad_step:
                embeds = model.transformer.wte(ids).detach().clone()
                embeds[0, 3] = float("inf")
                before = copy.deepcopy(model.state_dict())
            syncs += step(model, optimizer, guard, ids, ids, f"s{s}", embeds)[1]
            if s == bad_step:
                after = copy.deepcopy(model.state_dict())
        problems.append("no TrainingFaultError at the step after the NaN")
    except TrainingFaultError as fault:
        if f"step {bad_step}:" not in str(fault):
            problems.append(f"the error names another step: {fault}")
    guard.close()
    if syncs:
        problems.append(f"{len(syncs)} syncs inside check() on healthy steps, at {sorted(set(syncs))}")
    if len(guard.dumps) != 1:
        problems.append(f"{len(guard.dumps)} dumps")
    else:
        dump = open_dump(guard.dumps[0])
        if dump.step != bad_step or dump.trigger.kind.value != "nonfinite_loss":
            problems.append(f"dump of step {dump.step} ({dump.trigger.kind.value})")
        if before is None or not weights_equal(before, dump.model_state()):
            problems.append("dumped weights differ from the pre-step weights")
    if before is None or after is None or not weights_equal(before, after):
        problems.append("the NaN step was applied")
    return problems


def check_spike(device: str) -> list[str]:
    model, optimizer = model_and_optimizer(device)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp(), run_id="spike"))
    ids = torch.arange(SEQ, device=device).remainder(64).repeat(2, 1)
    wrong = torch.randint(0, 64, (2, SEQ), device=device, generator=torch.Generator(device).manual_seed(5))
    states, problems, syncs = [], [], []
    for s in range(WARM + 3):
        states.append(copy.deepcopy(model.state_dict()))
        decision, counted = step(model, optimizer, guard, ids, wrong if s == WARM else ids, f"s{s}")
        syncs += counted
        if not decision:
            problems.append(f"check() returned False at step {s}")
    states.append(copy.deepcopy(model.state_dict()))
    guard.close()
    if syncs:
        problems.append(f"{len(syncs)} syncs inside check(), at {sorted(set(syncs))}")
    steps = [open_dump(p).step for p in guard.dumps]
    if steps != [WARM]:
        problems.append(f"spike dumps at steps {steps}, expected [{WARM}]")
    else:
        dump = open_dump(guard.dumps[0])
        if dump.trigger.kind.value != "loss_spike":
            problems.append(f"dump trigger {dump.trigger.kind.value}")
        if not weights_equal(states[WARM], dump.model_state()):
            problems.append("dumped weights differ from the spike step's pre-step weights")
    if not weights_equal(states[WARM], states[WARM + 1]):
        problems.append("the dumped spike's update was applied")
    if weights_equal(states[WARM + 1], states[WARM + 2]):
        problems.append("training did not go on after the spike")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0")
    device = parser.parse_args().device
    failed = False
    for name, check, ok in (
        (
            "nan",
            check_nan,
            "no sync in check(); NaN step skipped on the device, raised at the next check(), "
            "dumped with its pre-step weights bitwise",
        ),
        (
            "spike",
            check_spike,
            "spike held on the device, dumped with its pre-step weights bitwise, training went on (no sync in check())",
        ),
    ):
        problems = check(device)
        failed = failed or bool(problems)
        print(f"sync-free check on {device}, {name}: " + ("OK: " + ok if not problems else "; ".join(problems)))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
