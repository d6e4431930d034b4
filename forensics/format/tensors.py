"""Streaming safetensors writer (checksummed as it writes) and a validating reader."""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from typing import BinaryIO, Iterator

import torch

from forensics.errors import DumpCorruptError
from forensics.format.spec import CHUNK_BYTES, MAX_SAFETENSORS_HEADER

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _code


class HashingWriter:
    """File wrapper that counts bytes and sha256s them on the way to disk: the whole file, and each
    CHUNK_BYTES chunk (a reader verifies the chunks of a large file on many cores at once).

    Large chunks are hashed on a helper thread while the same chunk is being written (both release
    the GIL), so checksumming costs little on top of the disk write.
    """

    OVERLAP_MIN = 1 << 20  # below this, a thread hand-off costs more than it saves

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.size = 0
        self.sha256 = hashlib.sha256()
        self.chunks: list[str] = []
        self._chunk = hashlib.sha256()
        self._chunk_fill = 0
        self._pool = None

    def _hash(self, view: memoryview) -> None:
        self.sha256.update(view)
        while len(view):
            take = min(len(view), CHUNK_BYTES - self._chunk_fill)
            self._chunk.update(view[:take])
            self._chunk_fill += take
            view = view[take:]
            if self._chunk_fill == CHUNK_BYTES:
                self.chunks.append(self._chunk.hexdigest())
                self._chunk, self._chunk_fill = hashlib.sha256(), 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        if len(view) >= self.OVERLAP_MIN:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forensics-sha256")
            hashed = self._pool.submit(self._hash, view)
            self.raw.write(view)
            hashed.result()
        else:
            self.raw.write(view)
            self._hash(view)
        self.size += len(view)

    def chunk_digests(self) -> list[str] | None:
        """Per-chunk sha256s of the whole file (the last chunk may be short), or None for a file of one chunk."""
        if self.size <= CHUNK_BYTES:
            return None
        return self.chunks + ([self._chunk.hexdigest()] if self._chunk_fill else [])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


SAFETENSORS_DTYPES = frozenset(_DTYPE_NAMES)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(out, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Writes `tensors` in safetensors layout to `out` (anything with .write), one tensor at a time."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensor {key!r} has dtype {tensor.dtype}, which safetensors cannot store")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # align the data section to 8 bytes
    out.write(struct.pack("<Q", len(encoded)))
    out.write(encoded)
    for view in _host_bytes(list(tensors.values())):
        out.write(view)


STAGING_CHUNK = 64 << 20  # bytes per pinned staging buffer (two of them, reused for every tensor)


def _host_bytes(tensors: list[torch.Tensor]):
    """Yields the bytes of each tensor in order. CUDA tensors go through two reused pinned buffers:
    chunk k+1 copies off the device while chunk k is written, and no fresh host pages are touched."""
    if not any(t.is_cuda for t in tensors):
        yield from (_as_bytes(t) for t in tensors)
        return
    chunks = []  # (device byte view, start, end) in write order; CPU tensors as whole views
    for tensor in tensors:
        if not tensor.is_cuda:
            chunks.append((tensor, None, None))
            continue
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else None
        for start in range(0, flat.numel() if flat is not None else 0, STAGING_CHUNK):
            chunks.append((flat, start, min(start + STAGING_CHUNK, flat.numel())))
    staging = [torch.empty(STAGING_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    events = [torch.cuda.Event(), torch.cuda.Event()]

    def issue(k: int) -> None:
        source, start, end = chunks[k]
        if start is not None:
            staging[k % 2][: end - start].copy_(source[start:end], non_blocking=True)
            events[k % 2].record()

    if chunks:
        issue(0)
    for k, (source, start, end) in enumerate(chunks):
        if k + 1 < len(chunks):
            issue(k + 1)  # the other buffer: it was written out before this chunk began
        if start is None:
            yield _as_bytes(source)
            continue
        events[k % 2].synchronize()
        yield memoryview(staging[k % 2][: end - start].numpy())


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    write_safetensors(buffer, tensors)
    return buffer.getvalue()


def check_header(data: bytes | memoryview, name: str) -> None:
    """Refuses a safetensors blob whose declared header would not fit (truncated or hostile)."""
    if len(data) < 8:
        raise DumpCorruptError(f"{name} is truncated (shorter than a safetensors header)", name)
    (size,) = struct.unpack("<Q", bytes(data[:8]))
    if size > MAX_SAFETENSORS_HEADER or size + 8 > len(data):
        raise DumpCorruptError(f"{name} has a safetensors header of {size} bytes that does not fit the file", name)


def load_safetensors_bytes(data: bytes, name: str) -> dict[str, torch.Tensor]:
    """Parses a whole safetensors blob (already checksummed) into CPU tensors."""
    from safetensors.torch import load

    check_header(data, name)
    try:
        return load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise DumpCorruptError(f"{name} is not valid safetensors: {exc}", name) from exc


def load_safetensors_file(path, name: str) -> dict[str, torch.Tensor]:
    """Reads a safetensors file (already checksummed) into CPU tensors through a memory map: one tensor is
    copied at a time, the file is never held in memory whole."""
    return dict(iter_safetensors_file(path, name, "cpu"))


def iter_safetensors_file(path, name: str, device) -> "Iterator[tuple[str, torch.Tensor]]":
    """(key, tensor) of a safetensors file (already checksummed), read one at a time onto `device`."""
    from safetensors import safe_open

    check_file_header(path, name)
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)
    except DumpCorruptError:
        raise
    except Exception as exc:  # safetensors raises its own error types
        raise DumpCorruptError(f"{name} is not valid safetensors: {exc}", name) from exc


def check_file_header(path, name: str) -> None:
    with open(path, "rb") as handle:
        head = handle.read(8)
    if len(head) < 8:
        raise DumpCorruptError(f"{name} is truncated (shorter than a safetensors header)", name)
    (size,) = struct.unpack("<Q", head)
    if size > MAX_SAFETENSORS_HEADER or size + 8 > os.path.getsize(path):
        raise DumpCorruptError(f"{name} has a safetensors header of {size} bytes that does not fit the file", name)
