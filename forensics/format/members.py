"""The zstd members of a dump (a micro-batch's `batch-<i>.safetensors.zst` and `batch-<i>.json.zst`), decompressed
within what their headers declare.

A member is read once its sha256 matched, but its contents are still untrusted: a 98 KB frame may declare 3 GiB. So
nothing is allocated for a member before its size is known and checked: the zstd frame header's declared size against
the cap for its kind (decompressed_limit), and for tensors the safetensors header (decompressed first, on its own)
against the frame by `tensor_member_problem`, the one rule the writer also applies to what it writes (what the Guard
writes, its reader accepts): the bytes the header's entries account for must be what the frame declares, within
MAX_DECOMPRESSED. Then that size is checked against what the host can hold now (limits.memory_room); only then is the
destination allocated, once, at its final size, and the rest decompressed straight into it (never a buffer that
grows). There is no ratio rule: an all-zero tensor of any size that fits the host is a legitimate batch. `verify`
runs the same reader with nowhere to keep the data (in a small reused buffer: no room needed): one reader, one set of
rules for replay, verify and inspect.
"""

from __future__ import annotations

import struct
from typing import IO, TYPE_CHECKING, Literal, overload

import zstandard

from forensics.core.errors import DumpCorruptError, cut_text
from forensics.format import spec
from forensics.format.header import Entry, data_end, parse_header
from forensics.format.limits import HASH_CHUNK, MAX_DECOMPRESSED, MAX_JSON_FILE, memory_room
from forensics.format.location import Location, open_read

if TYPE_CHECKING:
    import torch

ZSTD_FRAME_HEADER_MAX = 18
"""Bytes of the longest zstd frame header (it may declare the frame's decompressed size)."""


def decompressed_limit(name: str) -> int:
    """The most a zstd member may decompress to: a JSON skeleton as much as any JSON file, tensors MAX_DECOMPRESSED."""
    return MAX_JSON_FILE if name.endswith(spec.JSON_ZSTD_SUFFIX) else MAX_DECOMPRESSED


def tensor_member_problem(total: int, declared: int | None) -> str | None:
    """Why a tensor member whose safetensors header accounts for `total` bytes, in a zstd frame declaring `declared`
    (None: not declared), is not one the format allows (None: it is) — a phrase to follow the file's name. The one
    rule for the writer (on what it writes) and every reader (before allocating anything)."""
    if declared is not None and declared != total:
        return f"declares {declared} decompressed bytes, but its safetensors header accounts for {total}"
    if total > MAX_DECOMPRESSED:
        return f"would decompress to {total} bytes, more than the {MAX_DECOMPRESSED} a micro-batch file may hold"
    return None


def declared_size(head: bytes, path: Location, name: str) -> int | None:
    """The decompressed size a zstd frame header declares (None: it does not say), refused above the cap for `name`.

    Raises:
        DumpCorruptError: not a zstd frame, or it declares more than such a file may hold.
    """
    try:
        declared = zstandard.get_frame_parameters(head).content_size
    except zstandard.ZstdError as exc:
        raise DumpCorruptError(f"{path} is not a valid zstd frame ({cut_text(exc)})", name) from exc
    limit = decompressed_limit(name)
    if declared == zstandard.CONTENTSIZE_UNKNOWN:
        return None
    if declared > limit:
        raise DumpCorruptError(
            f"{path} declares {declared} decompressed bytes, more than the {limit} such a file may hold; refusing it",
            name,
        )
    return declared


class _Frame:
    """One member being decompressed: the declared size checked before a byte is inflated, then read into views."""

    def __init__(self, raw: IO[bytes], path: Location, name: str):
        self.path, self.name = path, name
        self.declared = declared_size(raw.read(ZSTD_FRAME_HEADER_MAX), path, name)
        raw.seek(0)
        self._stream = zstandard.ZstdDecompressor().stream_reader(raw)

    def fail(self, what: str) -> DumpCorruptError:
        return DumpCorruptError(f"{self.path} {what}; refusing it", self.name)

    def read_into(self, view: memoryview) -> int:
        """Fills `view` from the stream; returns how many bytes came (fewer: the frame ended)."""
        got = 0
        try:
            while got < len(view):
                n = self._stream.readinto(view[got:])
                if not n:
                    break
                got += n
        except zstandard.ZstdError as exc:
            raise DumpCorruptError(f"{self.path} is not a valid zstd frame ({cut_text(exc)})", self.name) from exc
        return got

    def skip(self, count: int) -> int:
        """Decompresses `count` bytes into a small reused buffer (verify keeps nothing); returns how many came."""
        scratch, got = memoryview(bytearray(min(HASH_CHUNK, max(count, 1)))), 0
        while got < count:
            n = self.read_into(scratch[: min(len(scratch), count - got)])
            if not n:
                break
            got += n
        return got

    def at_end(self) -> bool:
        return self.read_into(memoryview(bytearray(1))) == 0


def read_json_member(path: Location, name: str) -> bytes | bytearray:
    """A JSON member's bytes: into one buffer of its declared size (at most MAX_JSON_FILE), or, for a frame that does
    not declare its size, in pieces refused as soon as they pass MAX_JSON_FILE.

    Raises:
        DumpCorruptError: not zstd, more than it may hold, or not what its frame declares.
    """
    limit = decompressed_limit(name)
    with open_read(path) as raw:
        frame = _Frame(raw, path, name)
        if frame.declared is not None:
            out = bytearray(frame.declared)
            got = frame.read_into(memoryview(out))
            if got != frame.declared or not frame.at_end():
                raise frame.fail(f"does not decompress to the {frame.declared} bytes its frame declares")
            return out
        pieces: list[bytes] = []
        total = 0
        while True:
            piece = bytearray(min(HASH_CHUNK, limit + 1 - total))
            n = frame.read_into(memoryview(piece))
            total += n
            if total > limit:
                raise frame.fail(f"decompresses to more than {limit} bytes, the most such a file may hold")
            if not n:
                return b"".join(pieces)
            pieces.append(bytes(piece[:n]))


@overload
def read_tensor_member(
    path: Location, name: str, keep: Literal[True] = True
) -> tuple[torch.Tensor, dict[str, Entry]]: ...
@overload
def read_tensor_member(path: Location, name: str, keep: bool) -> tuple[torch.Tensor | None, dict[str, Entry]]: ...


def read_tensor_member(path: Location, name: str, keep: bool = True) -> tuple[torch.Tensor | None, dict[str, Entry]]:
    """A safetensors member: the whole file as one uint8 tensor (None with `keep=False`: streamed and counted, for
    `verify`) and its header's checked entries. Its safetensors header is decompressed and checked first; the
    destination is allocated only for the size that header accounts for, once it matches what the frame declares
    (tensor_member_problem) and fits in what the host can hold now (limits.memory_room).

    Raises:
        DumpCorruptError: naming the file and what it claims against what it may hold.
    """
    with open_read(path) as raw:
        frame = _Frame(raw, path, name)
        head, header, entries, total = _tensor_header(frame)
        start = 8 + len(header)
        buffer = None
        room = memory_room() if keep else None
        if room is not None and total > room:
            raise frame.fail(
                f"would decompress to {total} bytes, more than this host can hold now ({room} bytes: its "
                "available memory and this process's limits); read it on a host with more memory"
            )
        if keep:
            import torch

            from forensics.core.unfilled import unfilled

            with unfilled():  # every byte is overwritten below
                buffer = torch.empty(total, dtype=torch.uint8)
            view = buffer.numpy().data if total else memoryview(bytearray())
            view[:8], view[8:start] = head, header
            got = frame.read_into(view[start:])
        else:
            got = frame.skip(total - start)
        if got < total - start:
            raise frame.fail(f"ends after {start + got} of the {total} bytes its safetensors header accounts for")
        if not frame.at_end():
            raise frame.fail(f"holds more than the {total} bytes its safetensors header accounts for")
    return buffer, entries


def _tensor_header(frame: _Frame) -> tuple[bytearray, bytearray, dict[str, Entry], int]:
    """The 8-byte length, the header, its checked entries and the size they account for, of a tensor member's frame
    (nothing beyond the header decompressed), once that size passes tensor_member_problem."""
    head = bytearray(8)
    if frame.read_into(memoryview(head)) < 8:
        raise frame.fail("is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", head)
    bound = frame.declared if frame.declared is not None else MAX_DECOMPRESSED
    if length > spec.MAX_SAFETENSORS_HEADER or 8 + length > bound:
        raise frame.fail(f"has a safetensors header of {length} bytes that does not fit the file")
    header = bytearray(length)
    if frame.read_into(memoryview(header)) < length:
        raise frame.fail("ends inside its safetensors header")
    entries = parse_header(header, 8 + length, bound, frame.name)
    total = data_end(entries, 8 + length)
    problem = tensor_member_problem(total, frame.declared)
    if problem is not None:
        raise frame.fail(problem)
    return head, header, entries, total


def check_member_header(path: Location, name: str) -> None:
    """`inspect`: a zstd member's frame header within its cap and, for tensors, its safetensors header checked
    against it (only the headers are decompressed; the file is not hashed)."""
    with open_read(path) as raw:
        frame = _Frame(raw, path, name)
        if not name.endswith(spec.JSON_ZSTD_SUFFIX):
            _tensor_header(frame)


def check_member(path: Location, name: str) -> None:
    """`verify`: a zstd member decompresses as replay would read it (tensors: the header's entries and sizes; JSON: within its cap and parseable as a dump's JSON), keeping no tensor data."""
    if name.endswith(spec.JSON_ZSTD_SUFFIX):
        from forensics.format import jsonio

        data = read_json_member(path, name)
        try:
            jsonio.loads(data)
        except ValueError as exc:
            raise DumpCorruptError(f"{path} {jsonio.refusal(exc)}", name) from exc
    else:
        read_tensor_member(path, name, keep=False)
