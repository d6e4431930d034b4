"""Benchmark: step time of a guarded training loop with and without the precursor monitor, interleaved, as a ratio.

GPU: GPT-2 small (124M), 2 micro-batches x 4 x 1024 tokens, bf16 autocast, fused AdamW, clip_grad_norm_.
CPU: a small GPT-2 stand-in (4 layers, width 256, 2 x 4 x 128 tokens), AdamW.
Modes: guarded (GuardConfig()), precursors (GuardConfig(precursors=PrecursorConfig())), and
precursors_no_optimizer (PrecursorConfig(optimizer=False): no update-ratio / Adam-floor pass). Each round builds
each mode's Guard afresh (closing a Guard removes its hooks), warms it up, and times `--steps` steps; the report
is the median over rounds and the ratio against `guarded` of the same rounds.
Usage: python -m scripts.bench.precursor_overhead [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from capture import Guard, GuardConfig, PrecursorConfig
from scripts.bench.common import gpt2, machine, median, timed

MODES = {"guarded": None, "precursors": PrecursorConfig(),
         "precursors_no_optimizer": PrecursorConfig(optimizer=False)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size, batch, seq = ("small", 4, 1024) if device == "cuda" else ("tiny", 4, 128)
    micro = 2
    torch.manual_seed(0)
    model = gpt2(size, device)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    data = [{"input_ids": torch.randint(0, vocab, (batch, seq), device=device),
             "sample_ids": list(range(i * batch, (i + 1) * batch))} for i in range(micro)]

    def step(guard: Guard) -> None:
        for b in data:
            guard.record_batch(b)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(input_ids=b["input_ids"], labels=b["input_ids"]).loss
            guard.record_loss(loss)
            (loss / micro).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.check(grad_norm=norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, precursors in MODES.items():
            guard = Guard(model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp(), on_nonfinite="continue",
                                                               precursors=precursors))
            for _ in range(2):
                step(guard)

            def steps(guard: Guard = guard) -> None:
                for _ in range(args.steps):
                    step(guard)

            times[mode].append(timed(steps, device) / args.steps)
            guard.close()
    base = median(times["guarded"])
    print(f"machine: {machine()}")
    print(f"model: GPT-2 {size}, {micro} x {batch} x {seq} tokens per step, {args.rounds} rounds x {args.steps} steps")
    print(f"{'mode':<26} {'step time':>11} {'ratio':>7}")
    for mode, values in times.items():
        print(f"{mode:<26} {median(values) * 1e3:9.2f} ms {median(values) / base:7.3f}")


if __name__ == "__main__":
    main()
