"""A safetensors header checked without torch: the one set of rules every reader applies (replay, verify, inspect).

A header is the JSON object after the 8-byte length: per tensor key `{"dtype", "shape", "data_offsets"}` (and an
optional `__metadata__`). `parse_entries` refuses an unknown dtype, a shape and byte range that disagree, a range
outside the data section, two entries that overlap (and, through forensics.format.jsonio, a key listed twice); it
returns what a reader needs to place each tensor. `verify` and `inspect` call it without importing torch.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from forensics.core.errors import DumpCorruptError
from forensics.format.jsonio import parse_json, refusal
from forensics.format.location import Location, as_location, file_size, open_read

ITEM_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
"""Bytes per element of every dtype code a forensics dump may store (forensics.format.tensors maps them to torch)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, as its header places it."""

    dtype: str
    """The safetensors dtype code (ITEM_SIZES)."""
    shape: tuple[int, ...]
    offset: int
    """Where its bytes begin in the file (the data section's start included)."""
    nbytes: int


def parse_header(data: bytes | bytearray, start: int, size: int, name: str) -> dict[str, Entry]:
    """The entries of a safetensors header (`data`, the JSON after the 8-byte length) whose data section runs from
    `start` to `size` bytes of the file.

    Raises:
        DumpCorruptError: the header is not JSON a dump may hold, or an entry is malformed, outside the data or
            overlapping another (naming the file and the entry).
    """
    try:
        header = parse_json(bytes(data))
    except ValueError as exc:
        raise DumpCorruptError(f"{name}: its safetensors header {refusal(exc)}", name) from exc
    return parse_entries(header, start, size, name)


def parse_entries(header: object, start: int, size: int, name: str) -> dict[str, Entry]:
    """The entries of a parsed safetensors header whose data section runs from `start` to `size`, after checking each:
    a known dtype, a shape and byte range that agree and lie inside the data, no two entries overlapping."""
    if not isinstance(header, dict):
        raise DumpCorruptError(f"{name}: the safetensors header is not an object", name)
    entries, spans = {}, []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            code = entry["dtype"]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            numel = 1
            for n in shape:
                numel *= n
            ok = (
                code in ITEM_SIZES
                and all(_count(n) for n in (*shape, begin, end))
                and 0 <= begin <= end <= size - start
                and end - begin == numel * ITEM_SIZES[code]
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise DumpCorruptError(
                f"{name}: safetensors entry {str(key)[:120]!r} has a malformed dtype, shape or byte range", name
            )
        entries[key] = Entry(code, shape, start + begin, end - begin)
        spans.append((begin, end, key))
    spans.sort()
    for (_, a_end, a_key), (b_begin, _, b_key) in zip(spans, spans[1:]):
        if a_end > b_begin:
            raise DumpCorruptError(
                f"{name}: safetensors entries {str(a_key)[:80]!r} and {str(b_key)[:80]!r} overlap "
                "(their data_offsets share bytes)",
                name,
            )
    return entries


def _count(value: object) -> bool:
    """A JSON integer >= 0 (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def data_end(entries: dict[str, Entry], start: int) -> int:
    """The file size the entries justify: the end of the last tensor's bytes (the data section's start when none)."""
    return max([start, *(entry.offset + entry.nbytes for entry in entries.values())])


def read_entries(path: str | os.PathLike[str] | Location, name: str) -> dict[str, Entry]:
    """The checked entries of a safetensors file on disk (its header only is read: `verify`, `inspect`).

    Raises:
        DumpCorruptError: the header does not fit the file, or breaks a rule of parse_entries.
    """
    from forensics.format.spec import MAX_SAFETENSORS_HEADER

    with open_read(as_location(path)) as handle:
        size = file_size(as_location(path))
        head = handle.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        if length is None or length > MAX_SAFETENSORS_HEADER or 8 + length > size:
            raise DumpCorruptError(f"{name} has a safetensors header that does not fit the file ({size} bytes)", name)
        return parse_header(handle.read(length), 8 + length, size, name)
