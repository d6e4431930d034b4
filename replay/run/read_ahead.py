"""Run, streamed: a block's weights read from the dump (or copied from the host cache), the next block's on a
background thread while this one computes.

`BlockReader.read` reads a block now (the calling thread, its current stream). `start` reads one on a worker thread:
on a GPU the reader's pinned staging copies go to the device on a stream of their own, an event recorded on it
after the last copy; `take` makes the consumer's stream wait for that event and records the tensors as used on it
(so the caching allocator does not hand their memory to the worker's stream while the block computes). The dump's
reader (forensics.format.tensors.SafetensorsFile) stages each tensor in its own pinned buffer and copies it
non-blocking, so the bytes of the next tensor are read while the previous crosses the bus. A tensor the host cache
holds in a form that gives the pass's dtype exactly (replay/load/host_cache.py: held in that dtype, or as the dump
holds it) is copied from it instead, non-blocking from page-locked memory on a GPU (after the cache's own copy into
it, which the stream waits for); one it does not hold is read from the dump and offered to it. `storage_bytes` and
`host_to_device_bytes` count the traffic.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import torch

from forensics.core.errors import DumpCorruptError
from forensics.replay.load.host_cache import HostBlockCache


class BlockReader:
    """Reads blocks' weights from the dump, at most one ahead of the consumer."""

    def __init__(
        self,
        read: Callable[..., Iterator[tuple[str, torch.Tensor]]],
        device: torch.device,
        ahead: bool,
        cache: HostBlockCache | None = None,
    ):
        self._read, self.device, self.cache = read, device, cache
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forensics-stream") if ahead else None
        self._stream = torch.cuda.Stream(device) if ahead and device.type == "cuda" else None
        self.pending: tuple[int, tuple, Future] | None = None
        self.reads = 0
        """Blocks read from the dump (one block read twice counts twice)."""
        self.hits = 0
        """Of them, read ahead and used."""
        self.storage_reads = 0
        """Of them, those that read at least one tensor from the dump (the others came from the host cache)."""
        self.storage_bytes = 0
        """Bytes read from the dump (its dtypes)."""
        self.host_to_device_bytes = 0
        """Bytes copied from host memory to a CUDA device: from the host cache, and the dump's reads (staged on the
        host); 0 on the CPU."""

    def read(self, index: int, names: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """Block `index`'s tensors, `names` -> the dtype each is cast to, on the device in the current stream: from
        the host cache where it holds them, else from the dump."""
        self.reads += 1
        out = {}
        cuda = self.device.type == "cuda"
        for name, dtype in names.items():
            held = self.cache.get(name, dtype) if self.cache is not None else None
            if held is not None:
                out[name] = self._from_host(held, dtype)
                self.host_to_device_bytes += _nbytes(held) if cuda else 0
        missing = {n for n in names if n not in out}
        if missing:
            self.storage_reads += 1
            for name, tensor in self._read(names=missing):
                if name in missing and name not in out:
                    if self.cache is not None:
                        self.cache.offer(name, tensor)
                    self.storage_bytes += _nbytes(tensor)
                    self.host_to_device_bytes += _nbytes(tensor) if cuda else 0
                    out[name] = _cast(tensor, names[name])
        absent = [n for n in names if n not in out]
        if absent:
            raise DumpCorruptError(f"the dump holds no weight {absent[0]!r} of a streamed block", "model.safetensors")
        return out

    def _from_host(self, held: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A copy of the cache's tensor on the device, in `dtype` (held in it, or the dump's value cast on the device:
        fewer bytes cross the bus)."""
        if self.device.type == "cuda":
            return _cast(held.to(self.device, non_blocking=True), dtype)
        cast = _cast(held, dtype)
        return cast if cast is not held else held.clone()  # the pass may write its weights: never the cache's

    def _read_on_worker(self, index: int, names: dict[str, torch.dtype]):
        if self._stream is None:
            return self.read(index, names), None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            tensors = self.read(index, names)
            event = torch.cuda.Event()
            event.record(self._stream)
        return tensors, event

    def start(self, index: int, key: tuple, names: dict[str, torch.dtype]) -> None:
        """Reads block `index` (`key`: the dtypes it is cast to) on the worker thread."""
        if self._pool is None or self.pending is not None:
            return
        self.pending = (index, key, self._pool.submit(self._read_on_worker, index, names))

    def take(self, index: int, key: tuple) -> dict[str, torch.Tensor] | None:
        """The block read ahead, once it is ready for the current stream; None when another one (or none) was."""
        if self.pending is None or self.pending[:2] != (index, key):
            return None
        future = self.pending[2]
        self.pending = None
        tensors, event = future.result()
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in tensors.values():
                tensor.record_stream(current)
        self.hits += 1
        return tensors

    def cancel(self) -> None:
        """Drops the block being read ahead, once its read is over (a failed read's error is dropped with it: the
        block is read again where a pass needs it, and that read raises)."""
        if self.pending is None:
            return
        future = self.pending[2]
        self.pending = None
        with contextlib.suppress(Exception):
            tensors, event = future.result()
            if event is not None:
                event.synchronize()

    def close(self) -> None:
        self.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype or not tensor.is_floating_point() else tensor.to(dtype)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


__all__ = ["BlockReader"]
