"""How fast the streamed replay's host cache page-locks its slabs (replay/load/host_cache.py), by fill threads.

For each thread count, a HostBlockCache of `--gib` GiB on cuda:0 makes all its slabs (fault-in by zero_, then
cudaHostRegister) with nothing else running, and a second time while `--readers` threads copy a file's worth of
bytes out of the page cache (the load's reads beside the fill); prints GiB/s of each. The cache uses FILL_THREADS.
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
