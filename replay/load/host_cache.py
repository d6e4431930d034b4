"""Load, streamed: the streamed blocks' values kept in host memory, so that storage is read once per replay.

A streamed replay walks the model block by block in every pass (replay/run/stream_blocks.py): reproduce, localise,
per-layer norms, bisection, fp32, per-sample rows, remedies. Without a cache each walk reads the blocks from the dump
again (13 passes, 708 block reads of 0.6 GB at 13 B). `HostBlockCache` keeps each streamed tensor in host memory, up
to `capacity` bytes: filled while the load reads the weights (replay/load/stream_plan.keep_blocks_at_rest) and by any
later read of a tensor it could not hold then. A block it holds is copied to the device
(replay/run/read_ahead.BlockReader) instead of read; on a CUDA replay the cache is page-locked (registered with the
driver in slabs, as the gradients' store is), so that copy runs at the bus's speed.

What it holds: each tensor in the dtype the passes compute it in (`keep`: FSDP2's param_dtype, bf16 blocks of fp32
master weights), cast where the tensor lies when offered (on the device at load: the cast the streamer does, bitwise),
so the cache takes half the bytes to fill and each walk moves half the bytes; a tensor without a `keep` dtype is held
as the dump holds it. Where the capacity has room beyond those copies of every block (`reserve`: asked for with
ReplayOptions.host_cache_bytes, `host_cache_capacity`), a tensor held in another dtype is also held as the dump holds
it, first come, first kept: the passes in the dump's dtype (the fp32 re-run, the optimizer's update check over fp32
master weights) copy those; a tensor without one is read from the dump for them, as without a cache.
`get(name, dtype)` hands out a held value only where it gives the pass's values exactly: held in `dtype`, or held as
the dump holds it (cast on the device).

Filling it costs nothing on the load's path (CUDA): the slabs are faulted in and registered ahead of need by
FILL_THREADS background threads (at most `capacity` bytes; when the host refuses to lock more, what is held stays and
the rest is not kept), and each offered tensor is copied into its slab on a stream of the cache's own, ordered after
the offering stream's work, which goes on after it only on the device (the host never waits; a pass writing its
weights in place cannot race the copy), the source kept alive until the copy is done (`record_stream`); `get` makes
the consumer's stream wait for that copy. The load waits only where the slabs come slower than its reads
(`fill_wait_seconds`).

First come, first kept, never evicted: every pass walks the blocks in the same order, so the blocks kept are hits in
every pass (an LRU cache smaller than the model evicts each block just before the next pass asks for it).

`host_cache_capacity` sizes it: the bytes the options give, else on a GPU replay HOST_SHARE of the host's available
memory (/proc/meminfo's MemAvailable), at most the bytes the streamed blocks take as the passes compute them; on a
CPU replay none unless asked for, as --memory-budget holds the CPU's memory there and a cache would pass it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from forensics.core.sizes import words

logger = logging.getLogger(__name__)

HOST_SHARE = 0.5
"""Share of the host's available memory a GPU replay's cache may take by default: the rest stays for the page cache,
the gradients kept off the device (replay/run/stream_blocks.GradStore) and the user's code."""
SLAB = 1 << 30
"""Bytes of one page-locked allocation (a power of two: the caching host allocator rounds nothing away)."""
ALIGN = 512
FILL_THREADS = max(2, min(8, (os.cpu_count() or 8) // 4))
"""Threads faulting in and registering the cache's slabs beside the load: a quarter of the cores, 2 to 8 (zero_ runs
on torch's own threads as well; the driver's registration is one thread's work). On the 2 x H200 host (32 cores) two
threads page-locked 70.9 GiB in 19.6 s beside the 13 B load, which then waited for them (2026-11-28, 07:49); one
H200 host (16 cores) measured 4 threads at 10.2 GiB/s beside 8 page-cache readers, 2 at 7.6
(scripts/bench/host_cache_fill.py)."""


def available_host_memory() -> int:
    """Bytes the host can give without swapping: MemAvailable (Linux), else the physical memory's size; 0 unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def host_cache_capacity(device: torch.device, streamed_bytes: int, requested: int | None, dump_values: int = 0) -> int:
    """Bytes the cache may hold. `streamed_bytes`: the blocks as the passes compute them; `dump_values`: the dump's
    values of those held in another dtype (FSDP2's fp32 master weights of bf16 blocks). `requested`
    (ReplayOptions.host_cache_bytes) when given, up to both; else on a CUDA device HOST_SHARE of the available host
    memory, up to the first alone: page-locking the dump's values beside the load slowed it more than reading them
    from the dump again in the passes that need them costs (13 B FSDP2 bf16 on 2 x H200, 2026-11-28: 70.9 GiB
    locked, load 23.1 s and replay 2.87 x the unconstrained one; 23.3 GiB, 7.1 s and 1.95 x, its fp32 re-run 2.0 ->
    4.6 s); 0 on the CPU (its budget is the host's)."""
    if requested is not None:
        return max(0, min(int(requested), streamed_bytes + dump_values))
    if device.type != "cuda":
        return 0
    return max(0, min(int(available_host_memory() * HOST_SHARE), streamed_bytes))


def pinned_slab(size: int, registered: list[torch.Tensor]) -> torch.Tensor:
    """`size` bytes of page-locked host memory: ordinary memory faulted in by torch's threads, then registered with
    the driver (8.5 GiB/s on a 32-core host, against 2.2 GiB/s for cudaHostAlloc, which zeroes and locks page by
    page on one thread: BENCHMARKS.md, scripts/bench/pinned_alloc.py), appended to `registered` (unregister them with
    `unregister` before they are freed); cudaHostAlloc where registering fails."""
    slab = torch.empty(size, dtype=torch.uint8)
    slab.zero_()
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(slab.data_ptr(), size, 0)) == 0:
        registered.append(slab)
        return slab
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def unregister(registered: list[torch.Tensor]) -> None:
    """The slabs `pinned_slab` registered unlocked, once every copy that may still touch them is done."""
    if not registered:
        return
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    for slab in registered:
        cudart.cudaHostUnregister(slab.data_ptr())
    registered.clear()


class HostBlockCache:
    """Streamed parameters' values in host memory, by name, up to `capacity` bytes (page-locked for CUDA).

    `keep`: the dtype to hold each name in (the dtype the passes compute it in), others as offered. `reserve`: the
    bytes those copies of every block take; where `capacity` has room beyond them, a tensor held in another dtype than
    the dump's is also held as the dump holds it (for the passes in the dump's dtype: the fp32 re-run, the update
    check), first come, first kept."""

    def __init__(
        self, capacity: int, device: torch.device, keep: dict[str, torch.dtype] | None = None, reserve: int = 0
    ):
        self.capacity, self.device = capacity, device
        self.keep = dict(keep or {})
        self.reserve = reserve
        self.held_bytes = 0
        self._held: dict[str, torch.Tensor] = {}
        """Each name's copy in its `keep` dtype (the dump's where it has none)."""
        self._exact: set[str] = set()
        """Names whose copy in `_held` is the dump's value as it holds it: good for a pass in any dtype."""
        self._dump_values: dict[str, torch.Tensor] = {}
        """The dump's values of names held in another dtype as well, where the capacity had room beyond `reserve`."""
        self.dump_value_bytes = 0
        self._pinned = device.type == "cuda"
        self._slabs: list[list] = []
        """[page-locked uint8 tensor, bytes used] of each slab made so far."""
        self._registered: list[torch.Tensor] = []
        weakref.finalize(self, unregister, self._registered)  # a load that failed after filling it never closes it
        self._copies: dict[tuple[str, torch.dtype], Any] = {}
        """(name, dtype) -> the CUDA event recorded after that copy into the cache (dropped once it completed)."""
        self._copy_stream: Any = None
        self._coming: list[Future] = []
        """Slabs being made by the fill threads, in the order they were asked for."""
        self._fill: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._release: threading.Thread | None = None
        """The thread unlocking and freeing the slabs after `close`."""
        self.fill_wait_seconds = 0.0
        """Time offers waited for a slab still being made (the load's reads were faster than the pinning)."""
        self.fill_seconds = 0.0
        """Time the fill threads spent faulting in and registering slabs (in all; they run beside the load)."""
        self.fill_span = 0.0
        """Seconds from the first slab asked for to the last one made (wall time of the fill)."""
        self.slab_bytes = 0
        """Bytes of the slabs made (page-locked)."""
        self.refused = False
        """The host refused to lock more memory: what is held stays, nothing more is kept."""
        if self._pinned and capacity > 0:
            self._start_fill()

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def __len__(self) -> int:
        return len(self._held)

    def dtypes(self) -> dict[torch.dtype, int]:
        """Bytes held per dtype."""
        out: dict[torch.dtype, int] = {}
        for tensor in [*self._held.values(), *self._dump_values.values()]:
            out[tensor.dtype] = out.get(tensor.dtype, 0) + _nbytes(tensor)
        return out

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """A held value of `name` that gives a pass computing it in `dtype` its values exactly: held in `dtype`, else
        as the dump holds it (the caller casts it on the device); ready for the current stream. None otherwise
        (`dtype` None: the copy in its `keep` dtype)."""
        held, dump_value = self._held.get(name), self._dump_values.get(name)
        if held is not None and (dtype is None or held.dtype == dtype):
            return self._ready(name, held)
        if dump_value is not None:
            return self._ready(name, dump_value)
        if held is not None and name in self._exact:
            return self._ready(name, held)
        return None

    def _ready(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """`host`, its copy in awaited by the current stream (on the device) while it runs."""
        event = self._copies.get((name, host.dtype))
        if event is not None:
            if event.query():
                self._copies.pop((name, host.dtype), None)
            else:
                torch.cuda.current_stream(self.device).wait_event(event)
        return host

    def offer(self, name: str, tensor: torch.Tensor) -> bool:
        """Keeps a copy of `tensor` (the dump's value of `name`, on any device) cast to its `keep` dtype where it
        lies, while it fits, and one as it is where the capacity has room beyond `reserve`; True when the first is
        held. Does not wait for the copies (CUDA)."""
        keep = self.keep.get(name, tensor.dtype) if tensor.is_floating_point() else tensor.dtype
        if name not in self._held and self._keep(name, tensor, keep, self._held) and keep == tensor.dtype:
            self._exact.add(name)
        if keep != tensor.dtype and name not in self._dump_values:
            if self.reserve + self.dump_value_bytes + _nbytes(tensor) <= self.capacity:
                if self._keep(name, tensor, tensor.dtype, self._dump_values):
                    self.dump_value_bytes += _nbytes(tensor)
        return name in self._held

    def _keep(self, name: str, tensor: torch.Tensor, dtype: torch.dtype, into: dict[str, torch.Tensor]) -> bool:
        """A copy of `tensor` in `dtype` put `into` the dict while it fits."""
        nbytes = tensor.numel() * torch.empty((), dtype=dtype).element_size()
        if self.held_bytes + nbytes > self.capacity:
            return False
        host = self._buffer(tensor.shape, dtype, nbytes)
        if host is None:
            return False
        source = tensor if dtype == tensor.dtype else tensor.to(dtype)  # where it lies: the streamer's cast, bitwise
        if self._pinned and source.is_cuda:
            self._copy_in(name, host, source)
        else:
            host.copy_(source)
        into[name] = host
        self.held_bytes += nbytes
        return True

    def _copy_in(self, name: str, host: torch.Tensor, source: torch.Tensor) -> None:
        """`source` copied into `host` on the cache's stream, after the offering stream's work on it; the offering
        stream's later work (a pass writing its weights in place, the memory handed to the next tensor) waits for the
        copy on the device, the host never does; `source`'s memory is not handed to another stream before then."""
        with torch.cuda.device(source.device):
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(source.device)
            stream, offering = self._copy_stream, torch.cuda.current_stream(source.device)
            stream.wait_stream(offering)
            with torch.cuda.stream(stream):
                host.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            source.record_stream(stream)
            offering.wait_event(event)
        self._copies[(name, host.dtype)] = event

    def describe(self, streamed_bytes: int) -> str:
        """The stage log's line: what it holds (bytes, dtypes) and how its fill went."""
        tiers: dict[torch.dtype, int] = {}
        for tensor in self._held.values():
            tiers[tensor.dtype] = tiers.get(tensor.dtype, 0) + _nbytes(tensor)
        held = ", ".join(f"{words(n)} {_dtype_name(d)}" for d, n in tiers.items()) or "nothing"
        if self.dump_value_bytes:
            dtypes = sorted({_dtype_name(t.dtype) for t in self._dump_values.values()})
            held += (
                f" (as the passes compute) + {words(self.dump_value_bytes)} {'/'.join(dtypes)} (as the dump holds it)"
            )
        line = (
            f"  host cache: {held} of the blocks' {words(streamed_bytes)} in the dump kept in host memory, copied to "
            "the device instead of read from the dump again"
        )
        if self.slab_bytes:
            line += (
                f"; {words(self.slab_bytes)} page-locked in {self.fill_span:.1f} s beside the load, which waited "
                f"{self.fill_wait_seconds:.1f} s for it"
            )
        if self.refused:
            line += " (the host refused to lock more)"
        return line

    # -- slabs -----------------------------------------------------------------------------------
    def _start_fill(self) -> None:
        """The slabs for `capacity` bytes asked of the fill threads, SLAB bytes each (the last one what is left)."""
        self._fill = ThreadPoolExecutor(max_workers=FILL_THREADS, thread_name_prefix="forensics-pin")
        self._fill_started = time.perf_counter()
        left = -(-self.capacity // ALIGN) * ALIGN
        while left > 0:
            size = min(SLAB, left)
            self._coming.append(self._fill.submit(self._make_slab, size))
            left -= size

    def _make_slab(self, size: int) -> torch.Tensor:
        started = time.perf_counter()
        try:
            with torch.cuda.device(self.device):  # pinned for the replay's device, not a context on cuda:0
                return pinned_slab(size, self._registered)
        finally:
            with self._lock:
                self.fill_seconds += time.perf_counter() - started
                self.fill_span = time.perf_counter() - self._fill_started

    def _next_slab(self) -> bool:
        """The next slab the fill threads make, waited for; False when none is coming (all made, or refused)."""
        while self._coming and not self.refused:
            future = self._coming.pop(0)
            started = time.perf_counter()
            try:
                slab = future.result()
            except (RuntimeError, MemoryError, OSError, concurrent.futures.CancelledError) as exc:  # no more locked
                logger.info("host cache: no more page-locked memory (%s): it keeps what it holds", exc)
                self._refuse()
                return False
            finally:
                self.fill_wait_seconds += time.perf_counter() - started
            self._slabs.append([slab, 0])
            self.slab_bytes += slab.numel()
            return True
        return False

    def _refuse(self) -> None:
        self.refused = True
        for future in self._coming:
            future.cancel()
        self._coming.clear()  # a slab being made meanwhile stays unused: `settle` frees it

    def _buffer(self, shape: torch.Size, dtype: torch.dtype, nbytes: int) -> torch.Tensor | None:
        """Host memory for a tensor of `shape` and `dtype`: carved from a page-locked slab (CUDA), else its own."""
        if not self._pinned:
            return torch.empty(shape, dtype=dtype)
        span = -(-nbytes // ALIGN) * ALIGN
        while True:
            slab = next((s for s in self._slabs if s[0].numel() - s[1] >= span), None)
            if slab is not None:
                break
            if span > SLAB:  # larger than any slab the threads make: its own, now
                try:
                    with torch.cuda.device(self.device):
                        slab = [pinned_slab(span, self._registered), 0]
                except RuntimeError:
                    return None
                self._slabs.append(slab)
                self.slab_bytes += span
                break
            if not self._next_slab():
                return None
        start = slab[1]
        slab[1] += span
        return slab[0][start : start + nbytes].view(dtype).view(shape)

    def settle(self) -> None:
        """Once the load offered everything: no more slabs made, and those nothing was carved from (the dump's blocks
        took fewer bytes than the capacity, or a slab came after the host refused one) unlocked and freed."""
        self._stop_fill()
        carved = {id(s[0]) for s in self._slabs if s[1] > 0}
        for slab in [r for r in self._registered if id(r) not in carved]:  # no copy ever touched them
            torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
            self._registered[:] = [r for r in self._registered if r is not slab]
        self._slabs = [s for s in self._slabs if id(s[0]) in carved]
        self.slab_bytes = sum(s[0].numel() for s in self._slabs)

    def _stop_fill(self) -> None:
        """The slabs not yet begun cancelled; those being made finished (their memory registered: see `settle`)."""
        for future in self._coming:
            future.cancel()
        self._coming.clear()
        if self._fill is not None:
            self._fill.shutdown(wait=True)
            self._fill = None

    def close(self, wait: bool = False) -> None:
        """Keeps nothing more: what it held is handed back once the fill threads are done. Page-locked slabs are
        unlocked and freed on a thread of their own (`forensics-unpin`: a 7 B replay's profile spent ~1.9 s unlocking
        and unmapping 36 GiB at its end), the replay's return not held up by the unlocking; `wait`, or at the
        interpreter's exit: done before this returns."""
        self.capacity = 0
        self._stop_fill()
        self._held.clear()
        self._dump_values.clear()
        self._exact.clear()
        self._copies.clear()
        self.held_bytes = 0
        registered, slabs = list(self._registered), self._slabs  # the last references to the slabs' memory
        self._registered.clear()  # (in place: the finalizer's list, now empty)
        self._slabs = []
        if not registered:
            return
        if wait or not threading.main_thread().is_alive():  # at the interpreter's exit (a finalizer): no new thread
            _release(self.device, registered, slabs)
            return
        self._release = threading.Thread(  # not a daemon: the interpreter's exit waits for it, CUDA still up
            target=_release, args=(self.device, registered, slabs), name="forensics-unpin"
        )
        try:
            self._release.start()
        except RuntimeError:  # threads can no longer start (the interpreter is finalising)
            self._release = None
            _release(self.device, registered, slabs)


def _release(device: torch.device, registered: list[torch.Tensor], slabs: list) -> None:
    """`registered` unlocked once `device` finished every copy (`unregister`), then the memory of every slab freed."""
    with torch.cuda.device(device):
        unregister(registered)
    slabs.clear()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


__all__ = ["HostBlockCache", "HOST_SHARE", "available_host_memory", "host_cache_capacity", "pinned_slab", "unregister"]
