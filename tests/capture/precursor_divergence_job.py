"""A real divergence, provoked without planting a value: a tiny GPT-2 (random init, no QK-norm) trained with SGD +
momentum at learning rate 1.0 on learnable token sequences diverges by itself, under a Guard with the precursor
monitor on. Used by tests/capture/test_precursors.py (on the CPU) and, as a script, on a GPU (the acceptance run):

    python tests/capture/precursor_divergence_job.py OUTDIR [--device cuda:0]

prints one JSON line (the step the loss or gradients went non-finite, the precursor dump's step, how many steps
ahead it came, the layer and statistic its replay ranks first, the verdict) and exits 1 unless the precursor dump
came >= 10 steps ahead and names a block of the model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig, PrecursorConfig, SpikeConfig
from forensics.core.errors import TrainingFaultError

STEPS = 260  # the run at lr 1.0 goes non-finite between steps ~90 and ~150 depending on the machine's rounding (seeded,
# one CPU thread: ~115 where it was written, 90 on another 2-core box); it stops at its crash, so the cap costs nothing
AHEAD = 10  # the promise: the precursor dump comes at least this many steps before the non-finite step


def gpt2():
    from transformers import GPT2LMHeadModel

    from forensics.demo.models import gpt2_config

    torch.manual_seed(0)
    return GPT2LMHeadModel(gpt2_config(n_layer=3, n_embd=32, n_head=2))


def batches(steps: int):
    """Learnable sequences start + stride * t (mod vocabulary): the model fits them, so its logits grow."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        start, stride = torch.randint(1, 64, (8, 1), generator=gen), torch.randint(1, 6, (8, 1), generator=gen)
        yield {"input_ids": (start + stride * torch.arange(16)) % 63 + 1}


def train(dump_dir, lr: float, steps: int = STEPS, device: str = "cpu") -> tuple[Guard, int | None]:
    """Trains `steps` steps at `lr` under the Guard; returns it (closed) and the first non-finite step (or None)."""
    model = gpt2().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    off = SpikeConfig(enabled=False)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(dump_dir),
            run_id="diverging",
            precursors=PrecursorConfig(),
            detection=DetectionConfig(loss_spike=off, grad_norm_spike=off),
        ),
    )
    nonfinite_at = None
    try:
        for step, batch in enumerate(batches(steps)):
            batch = {k: v.to(device) for k, v in batch.items()}
            guard.record_batch(batch)
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            guard.record_loss(loss)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
            if nonfinite_at is None and not (math.isfinite(float(loss.detach())) and math.isfinite(float(norm))):
                nonfinite_at = step
            if guard.check(grad_norm=norm):
                optimizer.step()
            optimizer.zero_grad()
    except TrainingFaultError:
        pass
    finally:
        guard.close()
    return guard, nonfinite_at


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="dump directory")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from forensics.format import open_dump
    from forensics.core.kinds import TriggerKind
    from forensics.replay.engine import ReplayOptions, run_replay

    guard, nonfinite_at = train(args.out, lr=1.0, device=args.device)
    precursor = [p for p in guard.dumps if open_dump(p).trigger.kind == TriggerKind.PRECURSOR]
    result: dict = {"device": args.device, "nonfinite_at": nonfinite_at, "precursor_dumps": len(precursor)}
    if precursor:
        report = run_replay(precursor[0], ReplayOptions(device=args.device))
        first = (report.get("precursor") or {}).get("ranking", [{}])[0]
        step = open_dump(precursor[0]).step
        result.update(
            precursor_step=step,
            ahead=None if nonfinite_at is None else nonfinite_at - step,
            layer=first.get("layer"),
            statistic=first.get("statistic"),
            started=first.get("started"),
            verdict=report["verdict"]["kind"],
        )
    print(json.dumps(result))
    ok = (
        bool(precursor)
        and nonfinite_at is not None
        and result["ahead"] >= AHEAD
        and str(result.get("layer")).startswith("transformer.h.")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
