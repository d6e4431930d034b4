"""What the Guard's RNG capture (forensics/core/rng.RngCapture) costs on this host, piece by piece.

Microseconds per call, the median of `--calls` calls, warm (the calls back to back) and cold (one call right after a
forward / backward of a small model on the device, as the Guard's record_batch runs): each generator's get_state,
the CUDA (seed, offset) key, and the whole capture with nothing drawn since the last one and with every device's
offset moved in between; for scale, a 5 KB allocation by anyone (right after a backward the first allocation pays for
the allocator's housekeeping of what the backward freed: a cost moved from the next allocation, not added).
Usage: python -m scripts.bench.rng_capture [--calls 2000] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

import numpy as np
import torch

from forensics.core import thirdparty
from forensics.core.rng import RngCapture
from scripts.bench.common import machine


def warm(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


def cold(fn: Callable[[], object], calls: int, step: Callable[[], None]) -> float:
    times = []
    for _ in range(calls):
        step()
        started = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(machine(), f"device {device}, torch {torch.__version__}, devices visible {torch.cuda.device_count()}")
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)]).to(device)
    batch = torch.randn(32, 256, device=device)

    def step() -> None:
        model(batch).square().mean().backward()

    step()
    capture = RngCapture()
    capture()
    generators = tuple(torch.cuda.default_generators) if device.type == "cuda" else ()

    def drawn_capture() -> object:
        for index in range(len(generators)):
            torch.cuda.default_generators[index].set_offset(generators[index].get_offset() + 4)
        return capture()

    pieces: list[tuple[str, Callable[[], object]]] = [
        ("random.getstate()", random.getstate),
        ("numpy.random.get_state()", np.random.get_state),
        ("torch CPU get_state()", torch.default_generator.get_state),
    ]
    if generators:
        pieces += [
            ("CUDA get_state(), device 0", generators[0].get_state),
            ("CUDA (seed, offset) key, device 0", lambda: thirdparty.cuda_rng_key(generators[0])),
            (f"CUDA keys, all {len(generators)} devices", lambda: [thirdparty.cuda_rng_key(g) for g in generators]),
        ]
    pieces += [
        ("RngCapture(), nothing drawn", capture),
        ("for scale: bytearray(5056), any allocation", lambda: bytearray(5056)),
    ]
    if generators:
        pieces += [("RngCapture(), offsets moved (+set_offset)", drawn_capture)]
    for label, fn in pieces:
        print(f"{label:40s} warm {warm(fn, args.calls):8.1f} us   cold {cold(fn, args.calls // 10, step):8.1f} us")


if __name__ == "__main__":
    main()
