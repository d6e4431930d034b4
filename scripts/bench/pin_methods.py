"""Ways to page-lock host memory for the streamed replay's host cache (replay/load/host_cache.py), side by side.

Each way makes `--gib` GiB of page-locked memory in 1 GiB slabs on 1, 4 and 8 threads and prints GiB/s and the
process's CPU seconds per GiB (fault-in that spins torch's OpenMP teams shows there):
- `zero_+register`: ordinary memory (torch.empty) faulted in by `zero_` (torch's threads), then cudaHostRegister
  (what the cache does);
- `memset+register`: the same faulted in by one libc memset on the calling thread (no OpenMP team);
- `populate+register`: the kernel faults it in (madvise MADV_POPULATE_WRITE, Linux 5.14+), then registered;
- `thp populate+register`: an anonymous mapping advised MADV_HUGEPAGE (transparent 2 MiB pages), populated, registered;
- `thp register`: the same, the driver's registration faulting it in;
- `cudaHostAlloc`: torch's pinned allocation (1 thread only: it is serial).
Then host->device GiB/s from a slab of each kind, and what /sys says of transparent huge pages.
Usage: python -m scripts.bench.pin_methods [--gib 16] [--threads 1,4,8]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from scripts.bench.common import machine

SLAB = 1 << 30
HUGE = 2 << 20
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.memset.restype = ctypes.c_void_p
_libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)


def _madvise(address: int, length: int, advice: int) -> None:
    if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice})")


def _register(slab: torch.Tensor) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister: {rc}")


class Made:
    """A page-locked slab and what frees it."""

    def __init__(self, slab: torch.Tensor, mapping: mmap.mmap | None = None, registered: bool = True):
        self.slab, self.mapping, self.registered = slab, mapping, registered

    def free(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.slab.data_ptr())
        self.slab = None  # type: ignore[assignment]
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a view still exported: the mapping goes with the last one
                pass


def _huge_mapping() -> tuple[mmap.mmap, torch.Tensor]:
    mapping = mmap.mmap(-1, SLAB + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = (-whole.data_ptr()) % HUGE
    slab = whole[skip : skip + SLAB]
    _madvise(slab.data_ptr(), SLAB, mmap.MADV_HUGEPAGE)
    return mapping, slab


def zero_register() -> Made:
    slab = torch.empty(SLAB, dtype=torch.uint8)
    slab.zero_()
    _register(slab)
    return Made(slab)


def memset_register() -> Made:
    slab = torch.empty(SLAB, dtype=torch.uint8)
    _libc.memset(slab.data_ptr(), 0, SLAB)
    _register(slab)
    return Made(slab)


def populate_register() -> Made:
    slab = torch.empty(SLAB, dtype=torch.uint8)
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-slab.data_ptr() // page) * page
    _madvise(start, (slab.data_ptr() + SLAB - start) // page * page, MADV_POPULATE_WRITE)
    _register(slab)
    return Made(slab)


def thp_populate_register() -> Made:
    mapping, slab = _huge_mapping()
    _madvise(slab.data_ptr(), SLAB, MADV_POPULATE_WRITE)
    _register(slab)
    return Made(slab, mapping)


def thp_register() -> Made:
    mapping, slab = _huge_mapping()
    _register(slab)
    return Made(slab, mapping)


def host_alloc() -> Made:
    return Made(torch.empty(SLAB, dtype=torch.uint8, pin_memory=True), registered=False)


WAYS: dict[str, Callable[[], Made]] = {
    "zero_+register": zero_register,
    "memset+register": memset_register,
    "populate+register": populate_register,
    "thp populate+register": thp_populate_register,
    "thp register": thp_register,
    "cudaHostAlloc": host_alloc,
}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(way: Callable[[], Made], gib: int, threads: int) -> tuple[float, float, list[Made]]:
    """(GiB/s, CPU-s per GiB, the slabs) of making `gib` slabs on `threads` threads."""
    cpu, started = _cpu_seconds(), time.perf_counter()

    def one(_: int) -> Made:
        with torch.cuda.device(0):
            return way()

    with ThreadPoolExecutor(threads) as pool:
        made = list(pool.map(one, range(gib)))
    seconds = time.perf_counter() - started
    return gib / seconds, (_cpu_seconds() - cpu) / gib, made


def h2d(slab: torch.Tensor) -> float:
    target = torch.empty(SLAB, dtype=torch.uint8, device="cuda:0")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(slab, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 1 / best


def anon_huge_gib() -> float:
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / (1 << 20)
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--threads", default="1,4,8")
    args = parser.parse_args()
    print(machine(), f"torch threads {torch.get_num_threads()}, kernel {os.uname().release}")
    for knob in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{knob}", encoding="ascii") as handle:
                print(f"transparent_hugepage/{knob}: {handle.read().strip()}")
        except OSError as exc:
            print(f"transparent_hugepage/{knob}: unreadable ({exc})")
    torch.zeros(1, device="cuda:0")
    for name, way in WAYS.items():
        for threads in [int(t) for t in args.threads.split(",")] if name != "cudaHostAlloc" else [1]:
            gib = args.gib if name != "cudaHostAlloc" else min(args.gib, 4)
            try:
                rate, cpu, made = run(way, gib, threads)
            except (OSError, RuntimeError) as exc:
                print(f"{name:24s} {threads} threads: failed ({exc})", flush=True)
                continue
            huge = anon_huge_gib()
            speed = h2d(made[0].slab) if threads == 1 else float("nan")
            print(
                f"{name:24s} {threads} threads: {gib} GiB at {rate:6.2f} GiB/s, {cpu:5.2f} CPU-s/GiB; "
                f"AnonHugePages {huge:5.1f} GiB; host->device {speed:5.1f} GiB/s",
                flush=True,
            )
            for slab in made:
                slab.free()


if __name__ == "__main__":
    main()
