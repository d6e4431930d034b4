"""A file's integrity as the dump format defines it: per-chunk sha256s, hashed on many cores while the file is written.

Format version 3 (docs/DUMP_FORMAT.md "Checksums"): a file larger than one chunk (spec.CHUNK_BYTES) lists the
sha256 of each chunk (`chunks`), and its `sha256` is the sha256 of those digests (32 raw bytes each, in file
order); a file of one chunk keeps the plain sha256 of its bytes. Every chunk is independent, so writing and
verifying run at many cores' hash speed instead of one core's, and the file's digest still covers every byte.
The writer hashes each chunk from its staging buffer while that buffer goes to disk (forensics.format.staged).
"""

from __future__ import annotations

import hashlib
import os
from forensics.format.spec import CHUNK_BYTES


def digest_of_chunks(chunks: list[str]) -> str:
    """The `sha256` of a file with chunk digests (format version >= 3): the sha256 of its chunk digests' bytes."""
    return hashlib.sha256(b"".join(bytes.fromhex(chunk) for chunk in chunks)).hexdigest()


def chunk_digests(data: bytes | memoryview, chunk_size: int) -> list[str]:
    """The sha256 of each `chunk_size` chunk of `data` (the last may be short)."""
    view = memoryview(data).cast("B")
    return [hashlib.sha256(view[start:start + chunk_size]).hexdigest()
            for start in range(0, max(len(view), 1), chunk_size)]


def file_digest(digests: list[bytes], size: int) -> tuple[str, list[str] | None]:
    """A file's (`sha256`, `chunks`) from the raw sha256 of each of its CHUNK_BYTES chunks in file order: a file of
    one chunk (or none) has the plain sha256 of its bytes and no chunk list."""
    if size <= CHUNK_BYTES:
        return (digests[0].hex() if digests else hashlib.sha256(b"").hexdigest()), None
    chunks = [digest.hex() for digest in digests]
    return digest_of_chunks(chunks), chunks


_POOL = None
_POOL_PID = None


def hash_pool():
    """The threads every dump file being written shares (hashlib releases the GIL on large updates); a process
    forked from one that had them (a data-loader worker) starts its own."""
    global _POOL, _POOL_PID
    if _POOL is None or _POOL_PID != os.getpid():
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="forensics-sha256")
        _POOL_PID = os.getpid()
    return _POOL
