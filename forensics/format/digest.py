"""A file's integrity as the dump format defines it: per-chunk sha256s, hashed on many cores while the file is written.

Format version 3 (docs/DUMP_FORMAT.md "Checksums"): a file larger than one chunk (spec.CHUNK_BYTES) lists the
sha256 of each chunk (`chunks`), and its `sha256` is the sha256 of those digests (32 raw bytes each, in file
order); a file of one chunk keeps the plain sha256 of its bytes. Every chunk is independent, so writing and
verifying run at many cores' hash speed instead of one core's, and the file's digest still covers every byte.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, Protocol

from forensics.format import threads
from forensics.format.spec import CHUNK_BYTES

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor


def digest_of_chunks(chunks: list[str]) -> str:
    """The `sha256` of a file with chunk digests (format version >= 3): the sha256 of its chunk digests' bytes."""
    return hashlib.sha256(b"".join(bytes.fromhex(chunk) for chunk in chunks)).hexdigest()


def chunk_digests(data: bytes | memoryview, chunk_size: int) -> list[str]:
    """The sha256 of each `chunk_size` chunk of `data` (the last may be short)."""
    view = memoryview(data).cast("B")
    return [
        hashlib.sha256(view[start : start + chunk_size]).hexdigest()
        for start in range(0, max(len(view), 1), chunk_size)
    ]


_POOL: ThreadPoolExecutor | None = None
_POOL_PID: int | None = None


def _hash_pool() -> ThreadPoolExecutor:
    """The threads every HashingWriter of the process shares (hashlib releases the GIL on large updates); a
    process forked from one that had them (a data-loader worker) starts its own."""
    global _POOL, _POOL_PID
    if _POOL is None or _POOL_PID != os.getpid():
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="forensics-sha256")
        _POOL_PID = os.getpid()
    return _POOL


class Sink(Protocol):
    """Where HashingWriter passes the bytes on: an open binary file, or a wrapper of one (EarlyWriteback)."""

    def write(self, data: Any, /) -> Any: ...


class HashingWriter:
    """File wrapper that counts bytes and sha256s each CHUNK_BYTES chunk of the file on the way to disk.

    A large write is cut at the file's chunk boundaries and its pieces are hashed on a shared pool of threads
    while the same bytes are being written by the caller's thread: the write returns once both are done, so
    the caller may reuse its buffer (a pinned staging buffer) right away, and hashing runs at several cores'
    speed beside the disk write instead of bounding it. The data is hashed from the caller's own memory,
    never copied. (Letting the hash of memory that stays unchanged trail the write, waited for only at the end, was
    measured on the 2-core machine beside two busy processes, 2026-11-28: no gain, the hash is bound by the CPU
    there, not by waiting: raw+sha256 / raw direct 1.98, 1.96 against 1.91, 1.85.)
    """

    PARALLEL_MIN = 1 << 20  # below this, a thread hand-off costs more than it saves

    def __init__(self, raw: Sink, chunk_bytes: int = CHUNK_BYTES):
        self.raw = raw
        self.size = 0
        self.chunk_bytes = chunk_bytes
        self._done: list[bytes] = []  # digests of the completed chunks, in file order
        self._open = hashlib.sha256()  # the chunk being filled
        self._fill = 0

    def _pieces(self, view: memoryview) -> list[tuple["hashlib._Hash", memoryview, int]]:
        """`view` cut at the file's chunk boundaries: (the hash of the chunk each piece belongs to, the piece,
        how full that chunk is after it)."""
        pieces, hasher, fill = [], self._open, self._fill
        while len(view):
            take = min(len(view), self.chunk_bytes - fill)
            fill += take
            pieces.append((hasher, view[:take], fill))
            view = view[take:]
            if fill == self.chunk_bytes:
                hasher, fill = hashlib.sha256(), 0
        return pieces

    def _settle(self, pieces: list[tuple["hashlib._Hash", memoryview, int]]) -> None:
        for hasher, _, fill in pieces:
            if fill == self.chunk_bytes:
                self._done.append(hasher.digest())
                self._open, self._fill = hashlib.sha256(), 0
            else:
                self._open, self._fill = hasher, fill

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        pieces = self._pieces(view)
        if len(view) < self.PARALLEL_MIN:
            self.raw.write(view)
            for hasher, piece, _ in pieces:
                hasher.update(piece)
        else:
            pool = _hash_pool()
            jobs = [threads.submit(pool, hasher.update, piece) for hasher, piece, _ in pieces]
            try:
                self.raw.write(view)
            finally:
                for job in jobs:
                    job.result()  # the caller's buffer is not read after this returns
        self._settle(pieces)
        self.size += len(view)

    def chunk_digests(self) -> list[str] | None:
        """Per-chunk sha256s of the whole file (the last chunk may be short), or None for a file of one chunk."""
        if self.size <= self.chunk_bytes:
            return None
        return [d.hex() for d in self._done] + ([self._open.hexdigest()] if self._fill else [])

    def hexdigest(self) -> str:
        """The file's `sha256`: of its bytes (one chunk), else of its chunk digests (format version 3)."""
        chunks = self.chunk_digests()
        if chunks is None:
            return self._done[0].hex() if self._done else self._open.hexdigest()
        return digest_of_chunks(chunks)
