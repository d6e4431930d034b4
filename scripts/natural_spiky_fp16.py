"""A run that spikes and then diverges by itself under float16 autocast + a GradScaler and the DEFAULT GuardConfig
(issue 30, items 1 and 2; the GPU acceptance step `natural_fp16`, scripts/gpu_acceptance.sh):

    python scripts/natural_spiky_fp16.py OUTDIR [--device cuda:0] [--lr 1.0] [--steps 600]

A small GPT-2 (random init, no warm-up, no QK-norm) trained with SGD + momentum at a learning rate too high for it,
the loss scaled by a GradScaler (init_scale 2**16), check() called without a grad norm before any scaler.unscale_
(the Guard measures the scaled gradients and divides the scale out). Nothing is planted. Writes OUTDIR/spike_dump.txt
(the first spike dump kept) and OUTDIR/crash_dump.txt, prints one JSON line, and exits 1 unless the crash was dumped,
the spike dumps stayed within GuardConfig.dumping.max_spike_dumps and the spike dump's grad norm is in unscaled units.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from forensics.capture import Guard, GuardConfig
from forensics.core.errors import TrainingFaultError
from forensics.format import open_dump

SCALE = 2.0**16


def batches(steps: int, device: str):
    """Learnable sequences start + stride * t (mod vocabulary): the model fits them and its logits grow."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        start, stride = torch.randint(1, 64, (8, 1), generator=gen), torch.randint(1, 6, (8, 1), generator=gen)
        ids = ((start + stride * torch.arange(16)) % 63 + 1).to(device)
        yield {"input_ids": ids, "labels": ids, "sample_ids": torch.arange(8) + 8 * step}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=32,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
            bos_token_id=0,
            eos_token_id=0,
        )
    ).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    device_type = torch.device(args.device).type
    scaler = torch.amp.GradScaler(device_type, init_scale=SCALE)
    guard = Guard(model, optimizer, scaler=scaler, config=GuardConfig(dump_dir=str(args.out), run_id="natural"))
    fault, started, last = None, time.time(), 0
    try:
        for step, batch in enumerate(batches(args.steps, args.device)):
            last = step
            guard.record_batch(batch)
            with torch.autocast(device_type, dtype=torch.float16):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            guard.record_loss(loss)
            scaler.scale(loss).backward()
            if guard.check():  # no grad_norm, no unscale_: the Guard measures the scaled gradients itself
                scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    except TrainingFaultError as exc:
        fault = exc
    guard.close()
    dumps = [open_dump(p) for p in guard.dumps]
    spikes = sorted((d for d in dumps if d.trigger.kind in ("loss_spike", "grad_norm_spike")), key=lambda d: d.step)
    crash = open_dump(fault.dump_path) if fault is not None and fault.dump_path else None
    budget = crash.manifest.get("dump_budget", {}) if crash is not None else {}
    unscaled = [d.manifest["loss"].get("grad_norm_unscaled_by") for d in spikes]
    summary = {
        "device": torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu",
        "steps_run": last + 1,
        "seconds": round(time.time() - started, 1),
        "crash_step": crash.step if crash else None,
        "crash_kind": crash.trigger.kind.value if crash else None,
        "spike_dumps": [d.step for d in spikes],
        "not_dumped": budget.get("not_dumped"),
        "grad_norm_unscaled_by": unscaled,
        "spike_grad_norms": [d.manifest["loss"].get("grad_norm") for d in spikes],
    }
    print(json.dumps(summary))
    if spikes:
        (args.out / "spike_dump.txt").write_text(
            str(guard.dumps[[open_dump(p).step for p in guard.dumps].index(spikes[0].step)])
        )
    if crash is not None:
        (args.out / "crash_dump.txt").write_text(str(fault.dump_path))
    ok = (
        crash is not None
        and 0 < len(spikes) <= GuardConfig().dumping.max_spike_dumps
        and all(d.step < crash.step for d in spikes)
        and all(u is not None and u > 1 for u in unscaled)
    )
    print(
        "OK: real spikes, then the crash; the crash is dumped, spike dumps within budget, grad norms unscaled"
        if ok
        else "FAILED: a crash dump after 1..max_spike_dumps spike dumps with unscaled grad norms was expected (try "
        "another --lr if the run did not spike or did not diverge)",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
