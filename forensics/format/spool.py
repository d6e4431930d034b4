"""Verified local copies of a dump's files in object storage: each file is fetched once, every chunk checked against
the manifest's sha256 as it arrives and written into a temporary directory (the spool) that is deleted with the Dump
(or at exit). Every loader then reads that copy, so:

- what is read is exactly what was verified: a file replaced in the bucket afterwards changes nothing (as on a
  local disk), and one replaced before its chunk arrived is refused (DumpCorruptError naming the file);
- no byte crosses the network twice in a replay (the optimizer state read by the load and again by the remedies,
  a streamed replay's blocks read again and again: all from the local copy);
- a file of up to STREAM_BYTES comes in one GET, a larger one in ranges of STREAM_BYTES fetched in parallel, each reply
  read chunk by chunk as it arrives (s3fs; other stores: ranged GETs of FETCH_BYTES), FETCH_THREADS GETs at once;
- host memory holds what it holds for a local dump, plus STREAM_HELD per GET in flight (FETCH_THREADS x 24 MiB at
  most, 96 MiB; 256 MiB for a store that cannot stream a reply, FETCH_THREADS x FETCH_BYTES).

A replay starts the fetch of every file the moment it opens the dump (Dump.prefetch), the command even before it
imports torch (forensics.format.prefetch), so the transfer overlaps what the replay does before it needs the bytes.

Room: a copy is made only where the temp directory (TMPDIR) keeps KEEP_FREE bytes free beside it. A large tensor
file with no room is read by ranged GETs instead (forensics.format.location.ChunkCache), each chunk verified again
whenever it is fetched again; any other file must have room (it is small: one chunk, or a micro-batch).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path

from forensics.core.errors import DumpCorruptError, StorageError
from forensics.format import threads
from forensics.format.location import RangeReader, RemotePath, streams
from forensics.format.manifest import safe_name

FETCH_BYTES = 64 << 20
"""Bytes one ranged GET asks for where the storage library cannot stream a reply (gcsfs, adlfs, memory://: whole chunks
of the manifest, sixteen of 4 MiB, held in memory until verified and written), and the pieces an old format's chunk
larger than this is streamed in. Object stores serve 8-16 MiB ranges at full speed already; a larger GET costs fewer
requests (moto's server copies the whole object for each ranged GET: fetching a 0.35 GB dump took 5.9 s in 16 MiB
GETs, 4.8 s in 32 MiB ones, 3.4 s in 64 MiB ones, `s3fs get` 4.1 s, which itself fetches 50 MiB ranges)."""
STREAM_BYTES = 256 << 20
"""Bytes one GET asks for where the storage library streams a reply (s3fs): a file up to this size comes in one GET,
a larger one in ranges of it fetched in parallel. The reply is read and verified chunk by chunk as it arrives, so a GET
holds STREAM_HELD in memory at most, whatever its size; fewer, longer GETs cost fewer requests (a store's cost per
request can grow with the object: moto's server copies the whole object for each ranged GET) while FETCH_THREADS
of them at once keep a large file's transfer parallel."""
STREAM_HELD = 24 << 20
"""Host memory one streamed GET holds at most: the chunk being filled (4 MiB) and the HTTP client's read-ahead
(aiohttp parses ahead of the reader until its buffer fills: 16-17 MiB in all measured on a 48 MiB reply;
tests/storage/test_url_fetch.py holds a fetch to this)."""
FETCH_THREADS = 4
"""GETs in flight at once, for every file of every dump of the process (a request waits on the network, not a core;
sha256 releases the GIL): FETCH_THREADS x STREAM_HELD (96 MiB) in memory on their way to the disk at most, the stated
cache of a URL replay (FETCH_THREADS x FETCH_BYTES, 256 MiB, where replies are not streamed)."""
KEEP_FREE = 2 << 30
"""Bytes the temp directory keeps free beside the copies: a file that would leave less is read by ranges instead."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_pending = 0
"""Bytes promised to copies not yet complete (the disk's free space does not show them yet), process-wide."""


def _fetch_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="forensics-fetch")
        return _pool


class Spool:
    """The temporary directory of one Dump's local copies (made on first use, deleted by `close` or at exit)."""

    def __init__(self) -> None:
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._count = 0
        self._lock = threading.Lock()

    def admit(self, name: str, size: int, required: bool) -> Path | None:
        """The path for a copy of the listed file `name` (a plain name: the manifest's check, so errors about the copy
        name the file), of `size` bytes, its room promised; None when the temp directory would keep less than
        KEEP_FREE free (the caller reads the file by ranges).

        Raises:
            StorageError: `required` (a file that cannot be read by ranges) and there is no room even for it.
        """
        global _pending
        with self._lock:
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="forensics-spool-")
            free = shutil.disk_usage(self._dir.name).free
            with _pool_lock:
                room = free - _pending
                if room - size < KEEP_FREE and not (required and room >= size):
                    if required:
                        raise StorageError(
                            f"no room in {tempfile.gettempdir()} for a verified copy of a {size:,}-byte file of the "
                            "dump: point TMPDIR at a directory with room, or download the dump first"
                        )
                    return None
                _pending += size
            self._count += 1
            return Path(self._dir.name) / (name if safe_name(name) else f"file-{self._count}")

    @staticmethod
    def settle(size: int) -> None:
        """A copy of `size` bytes is complete (or abandoned): the disk's free space accounts for it now."""
        global _pending
        with _pool_lock:
            _pending = max(0, _pending - size)

    def close(self) -> None:
        with self._lock:
            if self._dir is not None:
                self._dir.cleanup()
                self._dir = None


class SpooledFile:
    """One remote file being copied into the spool: its ranges (a GET each) fetched on the shared pool, each chunk
    checked against its sha256 as it arrives, before anything waits on it. `wait(begin, end)` returns once every
    chunk holding a byte of that range is in `local` and matched (raises DumpCorruptError for one that did not);
    `local` is then read like any local file. The interface of forensics.format.reader.ChunkVerifier."""

    cache = None  # nothing held in memory: the copy is on disk

    def __init__(
        self, path: RemotePath, name: str, size: int, chunk_size: int, digests: list[str], local: Path, spool: Spool
    ):
        if chunk_size <= 0 or len(digests) != max(1, -(-size // chunk_size)):
            raise DumpCorruptError(f"{path}: the manifest's chunk digests do not cover the file", name)
        self.path, self.name, self.size, self.chunk_size, self.digests = path, name, size, chunk_size, digests
        self.local, self._spool = local, spool
        with open(os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as created:
            created.truncate(size)
        self._matched, self._lock, self._settled, self._closed = 0, threading.Lock(), False, False
        self._bad: int | None = None  # the chunk that did not match, once one did
        self._arrived = threading.Condition(self._lock)
        self._ready = [False] * len(digests)
        per = max(1, (STREAM_BYTES if streams(path) else FETCH_BYTES) // chunk_size)  # whole chunks per GET
        self._groups: list[Future[int | None]] = []
        self._group_of: list[int] = []
        self._finished: list[bool] = []
        for first in range(0, len(digests), per):
            stop = min(len(digests), first + per)
            self._group_of.extend([len(self._groups)] * (stop - first))
            self._finished.append(False)
            self._groups.append(threads.submit(_fetch_pool(), self._fetch, len(self._groups), first, stop))

    def _fetch(self, group: int, first: int, stop: int) -> int | None:
        """Fetches chunks [first, stop) into the copy (one GET); returns the first that did not match (None: all
        did, or the copy was closed)."""
        try:
            return self._fetch_chunks(first, stop)
        finally:
            with self._arrived:
                self._finished[group] = True
                self._arrived.notify_all()

    def _fetch_chunks(self, first: int, stop: int) -> int | None:
        if self._closed:  # closed before its turn came: no GET
            return None
        begin, end = first * self.chunk_size, min(self.size, stop * self.chunk_size)
        with RangeReader(self.path) as reader:
            if self.chunk_size <= FETCH_BYTES:  # chunk by chunk as the reply arrives: one chunk in memory
                index = first
                for data in reader.stream(begin, end, self.chunk_size, FETCH_BYTES):
                    if self._closed:
                        return None
                    expected = min(self.chunk_size, self.size - index * self.chunk_size)
                    if len(data) != expected or hashlib.sha256(data).hexdigest() != self.digests[index]:
                        return index
                    _write(self.local, memoryview(data), index * self.chunk_size)
                    del data  # one chunk in memory per GET: this one goes before the next arrives
                    with self._arrived:
                        self._ready[index] = True
                        self._arrived.notify_all()
                    index += 1
                if index != stop:  # the store's object ended early
                    return index
            else:  # one chunk larger than a GET (a file of an old format): in pieces, hashed as they come
                digest, offset = hashlib.sha256(), begin
                for data in reader.stream(begin, end, FETCH_BYTES, FETCH_BYTES):
                    if self._closed:
                        return None
                    digest.update(data)
                    _write(self.local, memoryview(data), offset)
                    offset += len(data)
                    del data
                if offset != end or digest.hexdigest() != self.digests[first]:
                    return first
                with self._arrived:
                    self._ready[first] = True
        with self._lock:
            self._matched += stop - first
            if self._matched == len(self.digests):
                self._settle()
        return None

    def _settle(self) -> None:
        if not self._settled:
            self._settled = True
            self._spool.settle(self.size)

    def wait(self, begin: int, end: int) -> None:
        first, last = begin // self.chunk_size, max(begin, end - 1) // self.chunk_size
        for index in range(first, min(last, len(self.digests) - 1) + 1):
            group = self._group_of[index]
            with self._arrived:
                while not self._ready[index] and not self._finished[group]:
                    self._arrived.wait()
                if self._ready[index]:
                    continue
            try:
                bad = self._groups[group].result()  # a storage error (no connection, no permission) is raised as is
            except CancelledError:  # its GET never ran: the copy was closed (another chunk did not match)
                bad = self._bad
            if self._bad is None:
                self._bad = index if bad is None else bad
            self.close()
            raise DumpCorruptError(
                f"{self.path} does not match its sha256 in the manifest (chunk {self._bad}): "
                "the file was changed or corrupted in the store",
                self.name,
            )

    def wait_all(self) -> None:
        self.wait(0, self.size)

    @property
    def done(self) -> bool:
        return self._matched == len(self.digests)

    def close(self) -> None:
        self._closed = True
        for group in self._groups:
            group.cancel()
        with self._arrived:
            self._finished = [True] * len(self._finished)  # a waiter on a cancelled GET hears of it
            self._arrived.notify_all()
            self._settle()


def _write(path: Path, data: memoryview, offset: int) -> None:
    """`data` into the copy at `offset` (a descriptor of its own per GET: a cancelled copy never writes elsewhere)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        while len(data):
            written = os.pwrite(fd, data, offset)
            data, offset = data[written:], offset + written
    finally:
        os.close(fd)


__all__ = ["FETCH_BYTES", "FETCH_THREADS", "KEEP_FREE", "STREAM_BYTES", "STREAM_HELD", "Spool", "SpooledFile"]
