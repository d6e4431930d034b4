"""Benchmark: what the Guard's host snapshots (RecordConfig.snapshot_every) cost — the stall of one snapshot
against a plain copy of the same bytes into preallocated host memory (the memcpy / PCIe limit, measured in the
same run), the step time with snapshots every K steps against none, and the host memory they hold.

Model: GPT-2 small (124M) on a GPU, the CPU stand-in otherwise; AdamW (fp32 weights + two moments).
Usage: python -m scripts.bench.host_snapshot [--every 8] [--rounds 4] [--steps 16]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from forensics.capture import Guard, GuardConfig, RecordConfig
from forensics.capture.state.sharding import state_bytes
from scripts.bench.common import gpt2, machine, median, sync, timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--size", default=None, help="small (GPT-2 124M) or tiny; default: small on GPU, tiny on CPU")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = args.size or ("small" if device == "cuda" else "tiny")
    batch, seq = (4, 1024) if device == "cuda" else (2, 128)  # a CPU step must stay seconds long
    torch.manual_seed(0)
    model = gpt2(size, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = {"input_ids": torch.randint(0, model.config.vocab_size, (batch, seq), device=device)}
    data["labels"] = data["input_ids"]
    guards = {
        name: Guard(
            model,
            optimizer,
            config=GuardConfig(
                dump_dir=tempfile.mkdtemp(),
                recording=RecordConfig(snapshot_every=every, window_steps=max(32, 2 * every), capture_exceptions=False),
            ),
        )
        for name, every in (("no snapshots", 0), (f"snapshot every {args.every}", args.every))
    }

    def step(guard: Guard) -> None:
        guard.record_batch(data)
        loss = model(**data).loss
        guard.record_loss(loss)
        loss.backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for guard in guards.values():  # warm-up: Adam state exists, the snapshot buffers are allocated
        for _ in range(args.every + 1):
            step(guard)
    times: dict[str, list[float]] = {name: [] for name in guards}
    for _ in range(args.rounds):  # interleaved, so drift hits both alike
        for name, guard in guards.items():
            times[name].append(timed(lambda guard=guard: [step(guard) for _ in range(args.steps)], device) / args.steps)

    snapshots = guards[f"snapshot every {args.every}"].snapshots
    state = guards["no snapshots"].state.references()
    nbytes = state_bytes(state)
    stalls, copies = [], []
    flat = [t for t in state["model"].values()] + [
        v for entries in state["optimizer"]["state"].values() for v in entries.values() if isinstance(v, torch.Tensor)
    ]
    targets = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device == "cuda") for t in flat]
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        snapshots.take(0, state)  # the stall the loop sees (the copies themselves run on after it on a GPU)
        stalls.append(time.perf_counter() - start)
        copies.append(timed(lambda: [b.copy_(t, non_blocking=True) for b, t in zip(targets, flat)], device))
    base = median(times["no snapshots"])
    print(f"# host_snapshot  {machine()}")
    print(f"model {size}: state {nbytes / 2**20:.0f} MiB (weights + AdamW moments); {batch} x {seq} tokens per step")
    for name, values in times.items():
        print(f"  {name:<22} {median(values) * 1e3:8.1f} ms/step  ratio {median(values) / base:.3f}")
    print(
        f"  one snapshot: loop stall {median(stalls) * 1e3:.1f} ms; plain copy of the same bytes into host "
        f"memory {median(copies) * 1e3:.1f} ms ({nbytes / median(copies) / 1e9:.2f} GB/s); ratio "
        f"{median(stalls) / median(copies):.2f}"
    )
    print(
        f"  host memory held: {snapshots.bytes_held / 2**20:.0f} MiB = {snapshots.bytes_held / nbytes:.1f} x the state"
    )


if __name__ == "__main__":
    main()
