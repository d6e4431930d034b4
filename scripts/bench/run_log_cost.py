"""Benchmark: what the run log adds to a healthy step (issue 52), as a ratio against the same Guard without it.

The host-bound loop of capture_overhead's `host` configuration (12 x Linear(256), AdamW, one thread, check(grad_norm=)),
two Guards on two copies of the model — RecordConfig(run_log=True), the default, and run_log=False — in interleaved
rounds of 512 steps (two flushes each: the writer thread's work falls inside the rounds), medians of the rounds'
step time. Also the run log's own costs: RunLog.step on the training thread, and the writer thread's conversion and
segment rewrite per step (measured inline). Usage: python -m scripts.bench.run_log_cost [--rounds 8]
"""

from __future__ import annotations

import argparse
import copy
import math
import tempfile
import time

import torch

from forensics.capture import Guard, GuardConfig, RecordConfig
from forensics.capture.recording.run_log import RunLog
from forensics.format.run_log import EventKind
from scripts.bench.common import machine, median


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])
    loops = {}
    for name, on in (("run_log", True), ("no_run_log", False)):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        config = GuardConfig(dump_dir=tempfile.mkdtemp(), recording=RecordConfig(run_log=on))
        loops[name] = (model, optimizer, Guard(model, optimizer, config=config))
    x = torch.randn(16, 256)

    def step(name: str) -> None:
        model, optimizer, guard = loops[name]
        guard.record_batch({"x": x, "sample_ids": list(range(16))})
        loss = model(x).pow(2).mean()
        guard.record_loss(loss)
        loss.backward()
        if guard.check(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for name in loops:
        for _ in range(50):
            step(name)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for r in range(args.rounds):
        for name in sorted(loops, reverse=bool(r % 2)):
            start = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            times[name].append((time.perf_counter() - start) / args.steps)
    for _, _, guard in loops.values():
        guard.close()
    med = {name: median(t) for name, t in times.items()}

    inline = RunLog(tempfile.mkdtemp(), "bench", 0, 1)  # everything on this thread: hot path + writer work
    inline.event(EventKind.TRIGGER, 0, trigger="loss_spike", message="m", dumped=False)  # written from now on
    hot = RunLog(tempfile.mkdtemp(), "bench", 0, 1, background=lambda fn: None)  # the training thread's part only
    n = 20_000
    start = time.perf_counter()
    for s in range(n):
        hot.step(s, 2.5, 1.0, 1e-3, None, False, False, None)
    hot_us = (time.perf_counter() - start) / n * 1e6
    start = time.perf_counter()
    for s in range(n):
        inline.step(s, 2.5, 1.0, 1e-3, None, False, False, None)
    all_us = (time.perf_counter() - start) / n * 1e6
    print(f"machine: {machine()}")
    print(f"{args.rounds} interleaved rounds of {args.steps} steps, 12 x Linear(256), AdamW, one thread; medians:")
    for name in loops:
        print(f"  {name:<11} {med[name] * 1e3:7.3f} ms/step")
    print(f"  ratio run_log / no_run_log: {med['run_log'] / med['no_run_log']:.4f}")
    print(
        f"RunLog.step on the training thread: {hot_us:.2f} us/step; with the writer thread's work: {all_us:.2f} us/step"
    )


if __name__ == "__main__":
    main()
