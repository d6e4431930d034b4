"""Load, streamed: the streamed blocks' dump values kept in host memory, so that storage is read once per replay.

A streamed replay walks the model block by block in every pass (replay/run/stream_blocks.py): reproduce, localise,
per-layer norms, bisection, fp32, per-sample rows, remedies. Without a cache each walk reads the blocks from the dump
again (13 passes, 708 block reads of 0.6 GB at 13 B). `HostBlockCache` keeps each streamed tensor as the dump holds
it (its dtype, its values) in host memory, up to `capacity` bytes: filled while the load reads the weights
(replay/load/stream_plan.keep_blocks_at_rest) and by any later read of a tensor it could not hold then. A block it
holds is copied to the device (replay/run/read_ahead.BlockReader) instead of read; on a CUDA replay the cache is
page-locked (registered with the driver in slabs, as the gradients' store is), so that copy runs at the bus's speed.

First come, first kept, never evicted: every pass walks the blocks in the same order, so the blocks kept are hits in
every pass (an LRU cache smaller than the model evicts each block just before the next pass asks for it).

`host_cache_capacity` sizes it: the bytes the options give, else on a GPU replay HOST_SHARE of the host's available
memory (/proc/meminfo's MemAvailable), at most the streamed blocks' bytes; on a CPU replay none unless asked for, as
--memory-budget holds the CPU's memory there and a cache would pass it.
"""

from __future__ import annotations

import os
import weakref

import torch

HOST_SHARE = 0.5
"""Share of the host's available memory a GPU replay's cache may take by default: the rest stays for the page cache,
the gradients kept off the device (replay/run/stream_blocks.GradStore) and the user's code."""
SLAB = 1 << 30
"""Bytes of one page-locked allocation (a power of two: the caching host allocator rounds nothing away)."""
ALIGN = 512


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


def host_cache_capacity(device: torch.device, streamed_bytes: int, requested: int | None) -> int:
    """Bytes the cache may hold: `requested` (ReplayOptions.host_cache_bytes) when given, else on a CUDA device
    HOST_SHARE of the available host memory, at most `streamed_bytes`; 0 on the CPU (its budget is the host's)."""
    if requested is not None:
        return max(0, min(int(requested), streamed_bytes))
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
    """Streamed parameters' dump values in host memory, by name, up to `capacity` bytes (page-locked for CUDA)."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity, self.device = capacity, device
        self.held_bytes = 0
        self._tensors: dict[str, torch.Tensor] = {}
        self._pinned = device.type == "cuda"
        self._slabs: list[list] = []
        """[page-locked uint8 tensor, bytes used] of each slab."""
        self._registered: list[torch.Tensor] = []
        weakref.finalize(self, unregister, self._registered)  # a load that failed after filling it never closes it

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def get(self, name: str) -> torch.Tensor | None:
        return self._tensors.get(name)

    def offer(self, name: str, tensor: torch.Tensor) -> bool:
        """Keeps a copy of `tensor` (the dump's value of `name`, on any device) while it fits; True when held."""
        if name in self._tensors:
            return True
        nbytes = tensor.numel() * tensor.element_size()
        if self.held_bytes + nbytes > self.capacity:
            return False
        host = self._buffer(tensor, nbytes)
        if host is None:
            return False
        host.copy_(tensor)
        self._tensors[name] = host
        self.held_bytes += nbytes
        return True

    def _buffer(self, like: torch.Tensor, nbytes: int) -> torch.Tensor | None:
        """Host memory for a copy of `like`: carved from a page-locked slab (CUDA), else its own."""
        if not self._pinned:
            return torch.empty(like.shape, dtype=like.dtype)
        span = -(-nbytes // ALIGN) * ALIGN
        slab = next((s for s in self._slabs if s[0].numel() - s[1] >= span), None)
        if slab is None:
            size = min(max(SLAB, span), max(span, self.capacity - sum(s[0].numel() for s in self._slabs)))
            try:
                with torch.cuda.device(self.device):  # pinned for the replay's device, not a context on cuda:0
                    slab = [pinned_slab(size, self._registered), 0]
            except RuntimeError:  # the host refused to lock more: the tensors kept so far stay
                return None
            self._slabs.append(slab)
        start = slab[1]
        slab[1] += span
        return slab[0][start : start + nbytes].view(like.dtype).view(like.shape)

    def close(self) -> None:
        """Frees what it holds (its slabs unlocked first); it keeps nothing more."""
        self.capacity = 0
        self._tensors.clear()
        unregister(self._registered)
        self._slabs.clear()
        self.held_bytes = 0


__all__ = ["HostBlockCache", "HOST_SHARE", "available_host_memory", "host_cache_capacity", "pinned_slab", "unregister"]
