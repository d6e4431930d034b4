"""Streaming safetensors writer and a validating reader."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

from forensics.core.device_sync import DeviceFence, on_device_of
from forensics.core.errors import DumpCorruptError
from forensics.format.header import Entry, parse_header
from forensics.format.location import ChunkCache, RangeReader, as_location, file_size, open_read
from forensics.format.spec import MAX_SAFETENSORS_HEADER
from forensics.core.unfilled import unfilled

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _code


SAFETENSORS_DTYPES = frozenset(_DTYPE_NAMES)


def tensor_bytes(value: Any) -> int:
    """The bytes a tensor's elements take (0 for anything that is not a tensor)."""
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def write_safetensors(out, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Writes `tensors` in safetensors layout to `out` (anything with .write), one tensor at a time."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensor {key!r} has dtype {tensor.dtype}, which safetensors cannot store")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
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
    chunk k+1 copies off the device while chunk k is written, and no fresh host pages are touched.

    Safe on any thread and for tensors on any mix of devices (forensics.core.device_sync): each copy runs with its
    tensor's device current, and its completion event is recorded on the stream that did the copy, so a chunk
    is handed on only once its bytes have landed (a writer thread's current device is 0 whatever the job chose:
    an event recorded there waits for nothing, and the stale bytes of the buffer's last use were written)."""
    cuda = [t for t in tensors if t.is_cuda]
    if not cuda:
        yield from (_as_bytes(t) for t in tensors)
        return
    # (device byte view, (start, end)) in write order; CPU tensors as whole views (no range)
    chunks: list[tuple[torch.Tensor, tuple[int, int] | None]] = []
    for tensor in tensors:
        if not tensor.is_cuda:
            chunks.append((tensor, None))
            continue
        if not tensor.numel():
            continue
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), STAGING_CHUNK):
            chunks.append((flat, (start, min(start + STAGING_CHUNK, flat.numel()))))
    with on_device_of(cuda[0]):  # the pinned buffers belong to the job's device, not to a context made on cuda:0
        staging = [torch.empty(STAGING_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    landed: dict[int, DeviceFence] = {}  # per staging buffer: its last copy's completion

    def issue(k: int) -> None:
        source, span = chunks[k]
        if span is not None:
            start, end = span
            with on_device_of(source):
                staging[k % 2][: end - start].copy_(source[start:end], non_blocking=True)
                landed[k % 2] = DeviceFence([source.device])

    if chunks:
        issue(0)
    for k, (source, span) in enumerate(chunks):
        if k + 1 < len(chunks):
            issue(k + 1)  # the other buffer: it was written out before this chunk began
        if span is None:
            yield _as_bytes(source)
            continue
        landed[k % 2].wait()
        yield staging[k % 2][: span[1] - span[0]].numpy().data


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    write_safetensors(buffer, tensors)
    return buffer.getvalue()


def check_header(data: bytes | bytearray | memoryview, name: str) -> None:
    """Refuses a safetensors blob whose declared header would not fit (truncated or hostile)."""
    if len(data) < 8:
        raise DumpCorruptError(f"{name} is truncated (shorter than a safetensors header)", name)
    (size,) = struct.unpack("<Q", bytes(data[:8]))
    if size > MAX_SAFETENSORS_HEADER or size + 8 > len(data):
        raise DumpCorruptError(f"{name} has a safetensors header of {size} bytes that does not fit the file", name)


def load_safetensors_bytes(data: bytes | bytearray, name: str) -> dict[str, torch.Tensor]:
    """Parses a whole safetensors blob (already checksummed) into CPU tensors that share its memory; the header is
    checked as SafetensorsFile checks it (forensics.format.header)."""
    check_header(data, name)
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    entries = parse_header(bytes(data[8 : 8 + length]), 8 + length, len(data), name)
    buffer = (
        torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8)
        if len(data)
        else torch.empty(0, dtype=torch.uint8)
    )
    return tensors_in(buffer, entries, name)


def tensors_in(buffer: torch.Tensor, entries: dict[str, Entry], name: str) -> dict[str, torch.Tensor]:
    """The tensors `entries` (checked: forensics.format.header) place in `buffer`, a whole safetensors file as uint8:
    views of it (a decompressed micro-batch is never copied again), an unaligned entry its own aligned copy."""
    tensors = {}
    for key, (dtype, shape, offset, nbytes) in torch_entries(entries, name).items():
        if nbytes == 0:
            tensors[key] = torch.empty(shape, dtype=dtype)
            continue
        raw = buffer[offset : offset + nbytes]
        if offset % raw.new_empty((), dtype=dtype).element_size():
            raw = raw.clone()  # an unaligned entry (not from forensics's writer): its own aligned copy
        tensors[key] = raw.view(dtype).reshape(shape)
    return tensors


def torch_entries(entries: dict[str, Entry], name: str) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """{key: (torch dtype, shape, file offset, bytes)} of checked header entries."""
    out = {}
    for key, entry in entries.items():
        if entry.dtype not in _DTYPES_BY_CODE:
            raise DumpCorruptError(
                f"{name}: tensor {str(key)[:120]!r} has dtype {entry.dtype}, which this torch "
                f"({torch.__version__}) cannot hold",
                name,
            )
        out[key] = (_DTYPES_BY_CODE[entry.dtype], list(entry.shape), entry.offset, entry.nbytes)
    return out


def load_safetensors_file(path, name: str) -> dict[str, torch.Tensor]:
    """Reads a safetensors file (already checksummed) into CPU tensors, one tensor read at a time."""
    return dict(iter_safetensors_file(path, name, "cpu"))


def iter_safetensors_file(path, name: str, device) -> "Iterator[tuple[str, torch.Tensor]]":
    """(key, tensor) of a safetensors file (already checksummed), read one at a time onto `device`."""
    with SafetensorsFile(path, name) as handle:
        for key in handle.keys():
            yield key, handle.read(key, device)


_DTYPES_BY_CODE = {code: dtype for dtype, code in _DTYPE_NAMES.items()}

READ_PIECE_MIN = 2 << 20
"""A tensor larger than this is read by several threads at once, in up to READ_THREADS pieces of at least this size:
one thread's copy out of the page cache runs at a fraction of what the memory and the disk give, and a model's
tensors are mostly of a few to a few hundred MB (a 0.7B Llama's attention weights 16 MB each)."""

READ_THREADS = min(8, os.cpu_count() or 1)


def read_pieces(nbytes: int) -> list[tuple[int, int]]:
    """[begin, end) byte ranges that split a tensor of `nbytes` among the reader threads."""
    count = max(1, min(READ_THREADS, nbytes // READ_PIECE_MIN))
    step = -(-nbytes // count)
    return [(start, min(nbytes, start + step)) for start in range(0, nbytes, step)] if nbytes else []


@functools.cache
def _reader_pool() -> ThreadPoolExecutor:
    """The threads that read large tensors' pieces (one pool per process, made on first use)."""
    return ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="forensics-read")


class SafetensorsFile:
    """A safetensors file read tensor by tensor with `pread`, never memory-mapped: on the CPU each tensor is read
    straight into its own memory, for a device through a pinned (CUDA) staging buffer of that tensor's size whose
    copy to the device overlaps the next read, so the host holds about two tensors beyond what the caller keeps.

    The header is checked before anything is allocated: its size, every entry's dtype, shape and byte range
    (inside the file, matching numel x item size, no two overlapping). The file is checksummed already, or
    `verified(begin, end)` returns once that byte range is (forensics.format.reader.ChunkVerifier): it is
    called before the header is parsed and before each tensor read is handed on (`verify_first`: before it is read,
    for a local copy still being fetched, forensics.format.spool).
    """

    def __init__(
        self,
        path,
        name: str,
        verified: "Callable[[int, int], None] | None" = None,
        cache: "ChunkCache | None" = None,
        verify_first: bool = False,
    ):
        self.path, self.name, self._range_verified = str(path), name, verified
        self._verify_first = verify_first or cache is not None
        """A range is read only once it is verified (a local copy being fetched, a remote file's cached chunks);
        otherwise the read and the verification run at once, and the tensor is handed on after both."""
        self._file: RangeReader | None = None  # none (yet, or closed)
        check_file_header(path, name)
        self._file = RangeReader(path, cache)
        try:
            self._entries = self._parse_header(self._file)
        except BaseException:
            self.close()
            raise

    def _parse_header(self, file: RangeReader) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
        (length,) = struct.unpack("<Q", file.read(8, 0))
        if self._range_verified is not None:
            self._range_verified(0, 8 + length)
        return torch_entries(parse_header(file.read(length, 8), 8 + length, file.size, self.name), self.name)

    def keys(self) -> list[str]:
        return sorted(self._entries)  # safetensors' own order: sorted by name

    def keys_in_file_order(self) -> list[str]:
        """The keys by where their bytes lie: a reader going through the file front to back (behind its
        verification)."""
        return sorted(self._entries, key=lambda key: self._entries[key][2])

    def shape(self, key: str) -> list[int]:
        return list(self._entry(key)[1])

    def _entry(self, key: str) -> tuple[torch.dtype, list[int], int, int]:
        if key not in self._entries:
            raise DumpCorruptError(f"{self.name} lacks tensor {key[:120]!r}", self.name)
        return self._entries[key]

    def read(self, key: str, device="cpu") -> torch.Tensor:
        dtype, shape, offset, nbytes = self._entry(key)
        device = torch.device(device)
        pinned = device.type == "cuda"
        # pinned memory of the reading device (not a context on cuda:0), unfilled: the read overwrites all of it
        with torch.cuda.device(device) if pinned else contextlib.nullcontext(), unfilled():
            raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        view = raw.numpy().data if nbytes else memoryview(b"")
        if self._range_verified is not None and self._verify_first:
            self._range_verified(offset, offset + nbytes)  # object storage: the verification fetched it; read it there
        pieces = read_pieces(nbytes)
        if len(pieces) > 1:  # a large tensor: its pieces read by several threads (pread releases the GIL)
            list(_reader_pool().map(lambda piece: self._pread_into(view, offset, piece[0], piece[1], key), pieces))
        elif pieces:
            self._pread_into(view, offset, 0, nbytes, key)
        if self._range_verified is not None:
            self._range_verified(offset, offset + nbytes)
        tensor = raw.view(dtype).reshape(shape)
        if device.type == "cpu":
            return tensor
        # not blocking: the next tensor is read while this one crosses the bus; the pinned allocator keeps `raw`'s
        # block from reuse until the copy is done, and the device tensor is ready in stream order
        return tensor.to(device, non_blocking=pinned)

    def _pread_into(self, view: memoryview, offset: int, begin: int, end: int, key: str) -> None:
        """Bytes [begin, end) of the tensor at file `offset` into view[begin:end]."""
        if self._file is None:
            raise ValueError(f"{self.name} is closed")
        while begin < end:
            got = self._file.read_into(view[begin:end], offset + begin)
            if got <= 0:
                raise DumpCorruptError(f"{self.name} ended while reading {key[:120]!r}", self.name)
            begin += got

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def check_file_header(path, name: str) -> None:
    with open_read(path) as handle:
        head = handle.read(8)
    if len(head) < 8:
        raise DumpCorruptError(f"{name} is truncated (shorter than a safetensors header)", name)
    (size,) = struct.unpack("<Q", head)
    if size > MAX_SAFETENSORS_HEADER or size + 8 > file_size(as_location(path)):
        raise DumpCorruptError(f"{name} has a safetensors header of {size} bytes that does not fit the file", name)
