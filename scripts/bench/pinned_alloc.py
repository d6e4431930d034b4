"""How fast host memory for gradients taken off a GPU can be made and filled (replay/run/stream_blocks.GradStore).

Compares, for the same bytes in 1 GiB slabs: torch's pinned allocation (cudaHostAlloc through the caching host
allocator), ordinary memory faulted in by torch's threads then registered with cudaHostRegister, pinned allocation
from several threads at once, and the device->host copy speed into pinned and into ordinary memory.
Usage: python -m scripts.bench.pinned_alloc [--gib 4]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from scripts.bench.common import machine

SLAB = 1 << 30


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=int, default=4)
    args = parser.parse_args()
    n = args.gib
    print(machine(), f"torch threads {torch.get_num_threads()}")
    cudart = torch.cuda.cudart()
    keep = []

    def pinned_torch():
        keep.extend(torch.empty(SLAB, dtype=torch.uint8, pin_memory=True) for _ in range(n))

    def registered():
        for _ in range(n):
            t = torch.empty(SLAB, dtype=torch.uint8)
            t.zero_()
            rc = cudart.cudaHostRegister(t.data_ptr(), SLAB, 0)
            assert int(rc) == 0, rc
            keep.append(t)

    def pinned_threads():
        with ThreadPoolExecutor(min(n, 8)) as pool:
            keep.extend(pool.map(lambda _: torch.empty(SLAB, dtype=torch.uint8, pin_memory=True), range(n)))

    def faulted():
        for _ in range(n):
            t = torch.empty(SLAB, dtype=torch.uint8)
            t.zero_()
            keep.append(t)

    for name, fn in (
        ("torch pin_memory=True", pinned_torch),
        ("zero_ + cudaHostRegister", registered),
        ("pin_memory=True on 8 threads", pinned_threads),
        ("ordinary memory, zero_ (faulted)", faulted),
    ):
        seconds = timed(fn)
        print(f"{name:36s} {n} GiB in {seconds:6.2f} s: {n / seconds:6.2f} GiB/s", flush=True)
        if name.startswith("ordinary"):
            pageable = keep[-1]
        elif name.startswith("torch"):
            pinned = keep[-1]
        elif name.startswith("zero_"):
            reg = keep[-1]
    src = torch.empty(SLAB, dtype=torch.uint8, device="cuda").fill_(1)
    for name, dst in (("pinned (cudaHostAlloc)", pinned), ("registered", reg), ("ordinary (faulted)", pageable)):
        seconds = min(timed(lambda dst=dst: dst.copy_(src)) for _ in range(3))
        back = min(timed(lambda dst=dst: src.copy_(dst)) for _ in range(3))
        print(f"copy 1 GiB device->host {name:24s} {1 / seconds:6.2f} GiB/s; host->device {1 / back:6.2f} GiB/s")
    fresh = torch.empty(SLAB, dtype=torch.uint8)
    seconds = timed(lambda: fresh.copy_(src))
    print(f"copy 1 GiB device->host fresh ordinary memory (faults in the copy) {1 / seconds:6.2f} GiB/s")


if __name__ == "__main__":
    main()
