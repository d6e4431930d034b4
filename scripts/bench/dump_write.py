"""Benchmark: writing a ~1.5 GB model + Adam state as a forensics dump vs torch.save vs raw disk speed.

All three write the same bytes-worth of state to the same directory in one process, interleaved.
Also measures the training stall of a non-fatal (spike) dump: the time `Guard.check` takes to return
when the dump is copied to host memory and written by the background thread.
Usage: python scripts/bench/dump_write.py [--dir /tmp] [--rounds 2] [--params 125]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from capture import Guard, GuardConfig, SpikeConfig
from forensics.format.writer import DumpContent, write_dump
from forensics.rng import capture_rng
from scripts.bench.common import machine, median


def build(params_m: int, device: str):
    """An MLP stack of `params_m` million fp32 parameters with a stepped Adam (state = 2x params)."""
    width = 2048
    layers = max(1, params_m * 1_000_000 // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width, device=device)).sum().backward()
    optimizer.step()
    return model, optimizer, width


def fsync_dir_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--params", type=int, default=125, help="millions of parameters (125 -> ~1.5 GB)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, optimizer, width = build(args.params, device)
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    work = tempfile.mkdtemp(dir=args.dir, prefix="fx-bench-")
    blob = os.urandom(64 << 20)

    def raw_write():
        path = os.path.join(work, "raw.bin")
        with open(path, "wb") as f:
            for _ in range(state_bytes // len(blob)):
                f.write(blob)
            f.write(blob[: state_bytes % len(blob)])
            f.flush()
            os.fsync(f.fileno())
        os.remove(path)

    def torch_save():
        path = os.path.join(work, "state.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        os.remove(path)

    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=work, run_id="bench"))

    def forensics_dump():
        state = guard.collect_state(__import__("capture.snapshot", fromlist=["HostCopy"]).HostCopy(enabled=False))
        content = DumpContent(manifest={"run_id": "bench", "step": 0, "rank": 0, "world_size": 1, "trigger": {},
                                        "micro_batches": []},
                              model=state["model"], optimizer=state["optimizer"], rng=[capture_rng()],
                              micro_batches=[], history={})
        path = write_dump(content, work)
        shutil.rmtree(path.parent.parent)

    results = {"raw": [], "torch.save": [], "forensics": []}
    for _ in range(args.rounds):
        for name, fn in (("raw", raw_write), ("torch.save", torch_save), ("forensics", forensics_dump)):
            start = time.perf_counter()
            fn()
            results[name].append(time.perf_counter() - start)

    # Training stall of a spike dump written in the background (continue policy).
    stall_guard = Guard(model, optimizer, config=GuardConfig(
        dump_dir=work, run_id="stall", loss_spike=SpikeConfig(window=8, warmup=4, min_ratio=1.5)))
    x = torch.randn(4, width, device=device)
    for value in (1.0, 1.0, 1.0, 1.0, 1.0):
        stall_guard.record_batch({"x": x, "sample_ids": [0, 1, 2, 3]})
        stall_guard.record_loss(torch.tensor(value, device=device))
        stall_guard.check(grad_norm=torch.tensor(1.0, device=device))
    stall_guard.record_batch({"x": x, "sample_ids": [0, 1, 2, 3]})
    stall_guard.record_loss(torch.tensor(100.0, device=device))
    start = time.perf_counter()
    stall_guard.check(grad_norm=torch.tensor(1.0, device=device))
    stall = time.perf_counter() - start
    start = time.perf_counter()
    stall_guard.close()
    background = time.perf_counter() - start
    shutil.rmtree(work, ignore_errors=True)

    gb = state_bytes / 1e9
    print(f"machine: {machine()}; target dir {args.dir}")
    print(f"state: {gb:.2f} GB (fp32 weights + Adam exp_avg + exp_avg_sq), on {device}; medians of {args.rounds}")
    for name, values in results.items():
        t = median(values)
        print(f"  {name:<11} {t:7.2f} s  {gb / t:6.2f} GB/s")
    raw, save, ours = (median(results[k]) for k in ("raw", "torch.save", "forensics"))
    print(f"forensics vs torch.save: {save / ours:.2f}x faster; forensics / raw disk bandwidth: {raw / ours:.2f}")
    print(f"spike dump training stall: {stall:.3f} s; background write finished {background:.2f} s later; "
          f"dumps written: {len(stall_guard.dumps)}")


if __name__ == "__main__":
    main()
