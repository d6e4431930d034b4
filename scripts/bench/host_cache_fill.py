"""How fast the streamed replay's host cache page-locks its slabs (replay/load/host_cache.py), by fill threads.

For each thread count, a HostBlockCache of `--gib` GiB on cuda:0 makes all its slabs (fault-in by zero_, then
cudaHostRegister) with nothing else running, and a second time while `--readers` threads copy a file's worth of
bytes out of the page cache (the load's reads beside the fill); prints GiB/s of each. The cache uses FILL_THREADS.
First the parts of one slab's making, 1 GiB slabs on one thread: zero_ of fresh memory (torch's threads), the
kernel's fault-in alone (madvise MADV_POPULATE_WRITE, Linux 5.14+), cudaHostRegister of faulted memory, and of
fresh memory (the driver faults it in).
Usage: python -m scripts.bench.host_cache_fill [--gib 8] [--threads 1,2,4] [--readers 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from forensics.replay.load import host_cache
from scripts.bench.common import machine


def fill(gib: int, threads: int) -> float:
    """Seconds until every slab of a `gib` GiB cache is made with `threads` fill threads."""
    host_cache.FILL_THREADS = threads
    started = time.perf_counter()
    cache = host_cache.HostBlockCache(gib << 30, torch.device("cuda", 0))
    while cache._next_slab():  # waits for each slab in turn, as the load's offers do
        pass
    seconds = time.perf_counter() - started
    assert cache.slab_bytes == gib << 30 and not cache.refused
    cache.close()
    return seconds


def parts(gib: int) -> None:
    """GiB/s of each part of making `gib` slabs of 1 GiB, one after another."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    cudart = torch.cuda.cudart()

    def fresh() -> list[torch.Tensor]:
        return [torch.empty(1 << 30, dtype=torch.uint8) for _ in range(gib)]

    def populate(slab: torch.Tensor) -> None:
        start = -(-slab.data_ptr() // page) * page
        length = (slab.data_ptr() + slab.numel() - start) // page * page
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), 23) != 0:  # MADV_POPULATE_WRITE
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")

    def register(slabs: list[torch.Tensor]) -> None:
        for slab in slabs:
            assert int(cudart.cudaHostRegister(slab.data_ptr(), slab.numel(), 0)) == 0

    def unregister(slabs: list[torch.Tensor]) -> None:
        for slab in slabs:
            cudart.cudaHostUnregister(slab.data_ptr())

    def timed(fn, slabs) -> float:
        started = time.perf_counter()
        fn(slabs)
        return gib / (time.perf_counter() - started)

    def populate_all(slabs: list[torch.Tensor]) -> None:
        for slab in slabs:
            populate(slab)

    slabs = fresh()
    zero = timed(lambda s: [t.zero_() for t in s], slabs)
    on_faulted = timed(register, slabs)
    unregister(slabs)
    slabs = fresh()
    try:
        madvise = f"{timed(populate_all, slabs):.1f} GiB/s"
    except OSError as exc:
        madvise = f"not here ({exc})"
    slabs = fresh()
    on_fresh = timed(register, slabs)
    unregister(slabs)
    print(
        f"{gib} x 1 GiB: zero_ {zero:.1f} GiB/s; MADV_POPULATE_WRITE {madvise}; cudaHostRegister of faulted memory "
        f"{on_faulted:.1f} GiB/s, of fresh memory {on_fresh:.1f} GiB/s",
        flush=True,
    )


def read_beside(path: str, readers: int, stop: threading.Event) -> None:
    """`readers` threads reading `path` from the page cache over and over until `stop` is set."""
    size = os.path.getsize(path)
    piece = size // readers

    def loop(index: int) -> None:
        buffer = bytearray(64 << 20)
        fd = os.open(path, os.O_RDONLY)
        try:
            while not stop.is_set():
                for offset in range(index * piece, (index + 1) * piece, len(buffer)):
                    if stop.is_set():
                        break
                    os.preadv(fd, [buffer], offset)  # releases the GIL, as the load's reader threads do
        finally:
            os.close(fd)

    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(loop, range(readers)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=int, default=8)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--readers", type=int, default=8)
    args = parser.parse_args()
    print(machine(), f"torch threads {torch.get_num_threads()}")
    torch.zeros(1, device="cuda:0")
    parts(min(args.gib, 4))
    with tempfile.NamedTemporaryFile(dir="/tmp") as scratch:  # 2 GiB in the page cache, read by the readers
        block = os.urandom(64 << 20)
        for _ in range(32):
            scratch.write(block)
        scratch.flush()
        for threads in (int(t) for t in args.threads.split(",")):
            alone = fill(args.gib, threads)
            stop = threading.Event()
            reading = threading.Thread(target=read_beside, args=(scratch.name, args.readers, stop))
            reading.start()
            try:
                beside = fill(args.gib, threads)
            finally:
                stop.set()
                reading.join()
            print(
                f"fill threads {threads}: {args.gib / alone:.1f} GiB/s alone, {args.gib / beside:.1f} GiB/s beside "
                f"{args.readers} page-cache readers",
                flush=True,
            )


if __name__ == "__main__":
    main()
