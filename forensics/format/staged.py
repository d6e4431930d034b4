"""How a dump file reaches the disk: copied once into aligned staging buffers, each buffer's chunks hashed while the
same buffer is written (O_DIRECT where the file system allows it), what was written made durable as it goes.

The bytes are copied from the caller (a tensor, a pinned device-staging buffer) into one of a ring of page-aligned
buffers, and `write` returns: the caller may reuse its memory at once. A full buffer is then handed to two kinds
of worker at the same time: the shared hash pool (forensics.format.digest) computes the sha256 of each of its
chunks, and the file's own I/O thread writes it with `pwrite`. A buffer is filled again only once both are done.
The copy is the one the page cache would have made anyway; hashing it there costs no extra copy and lets hashing
and writing each run as a steady stream behind the caller, limited only by the slower of the two.

Why O_DIRECT: a buffered write copies every byte into the page cache and the kernel writes it back later; on a
machine with few cores that copy and the writeback compete with the sha256 of the same bytes, and the fsync at
the end waits for all of it. Straight from the staging buffer there is nothing to write back, and a flusher
thread fdatasyncs what has landed every FLUSH_EVERY bytes, so the closing fsync has little left to do.
O_DIRECT needs the buffer address, the file offset and the length aligned to the device's logical block size:
every write but the last is a whole buffer, the last is padded to ALIGN with zeros and the file cut back to its
size. A file system that refuses O_DIRECT (EINVAL at open or at a write: tmpfs on older kernels, some network
and FUSE file systems), a platform without it, or a small file gets the same buffers through the page cache.
The bytes, and so the digests, are the same either way.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from forensics.format.digest import file_digest, hash_pool
from forensics.format.spec import CHUNK_BYTES

ALIGN = 4096  # the largest logical block size of common disks: a multiple of every smaller one
STAGE_BYTES = 4 * CHUNK_BYTES  # per staging buffer: whole chunks, so a chunk is hashed from one buffer in one go
STAGE_BUFFERS = 4  # in the ring: hashing and writing may each run up to three buffers behind the copy
FLUSH_EVERY = 8 * STAGE_BYTES  # bytes written after which the flusher fdatasyncs them (see _flush_early)
DIRECT_MIN = STAGE_BYTES  # a smaller file goes through the page cache: nothing to gain from bypassing it


def _sha256_of(buffer: mmap.mmap, start: int, end: int) -> bytes:
    with memoryview(buffer) as whole, whole[start:end] as piece:
        return hashlib.sha256(piece).digest()


class StagedFile:
    """One dump file written front to back, with its integrity (docs/DUMP_FORMAT.md "Checksums").

    `write(data)` copies and returns; `finish()` writes the rest, fsyncs, and makes `size`, `hexdigest()` and
    `chunk_digests()` final; `close()` releases the buffers and threads (always: use it as a context manager).

    Args:
        path: the file, created or truncated.
        size_hint: the bytes expected (O_DIRECT only from DIRECT_MIN on; the file may end up any size).
    Example:
        >>> with StagedFile(tmp_dir / "model.safetensors", size_hint=n) as out:  # doctest: +SKIP
        ...     out.write(header); out.write(tensor_bytes)
        ...     out.finish()
        >>> out.hexdigest()                                                     # doctest: +SKIP
    """

    chunk_bytes = CHUNK_BYTES

    def __init__(self, path: str | os.PathLike, size_hint: int):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = size_hint >= DIRECT_MIN and hasattr(os, "O_DIRECT")
        self._fd = None
        if self.direct:
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self._fd is None:
            self._fd = os.open(path, flags, 0o644)
        count = STAGE_BUFFERS if size_hint > STAGE_BYTES else 1
        self._buffers = [mmap.mmap(-1, STAGE_BYTES) for _ in range(count)]
        self._busy: list[list[Future]] = [[] for _ in range(count)]  # hash and write jobs reading each buffer
        self._current, self._fill, self._offset = 0, 0, 0  # buffer being filled, bytes in it, its file offset
        self._digests: list[Future] = []  # one per chunk, in file order
        self._io: ThreadPoolExecutor | None = None  # this file's pwrites, in order, one at a time
        self._landed = threading.Condition()  # a write ended: the flusher may have something to make durable
        self._unflushed = 0  # bytes written since the flusher's last fdatasync began
        self._finishing = False
        self._flusher: threading.Thread | None = None
        self.size = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        while len(view):
            if self._fill == 0:
                self._reclaim(self._current)
            take = min(len(view), STAGE_BYTES - self._fill)
            self._buffers[self._current][self._fill:self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == STAGE_BYTES:
                self._hand_on()

    def _reclaim(self, index: int) -> None:
        """Waits until nothing reads buffer `index` any more (raising what its write raised)."""
        jobs, self._busy[index] = self._busy[index], []
        for job in jobs:
            job.result()

    def _hand_on(self) -> None:
        """Hashes the current buffer's chunks and writes it, both in the background; moves to the next buffer."""
        if self._io is None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix="forensics-write-io")
            self._flusher = threading.Thread(target=self._flush_early, name="forensics-flush", daemon=True)
            self._flusher.start()
        buffer, length = self._buffers[self._current], self._fill
        hashes = [hash_pool().submit(_sha256_of, buffer, start, min(start + self.chunk_bytes, length))
                  for start in range(0, length, self.chunk_bytes)]
        self._digests.extend(hashes)
        written = self._io.submit(self._write_out, buffer, length, self._offset)
        self._busy[self._current] = [*hashes, written]
        self._current, self._fill = (self._current + 1) % len(self._buffers), 0
        self._offset += length

    def _write_out(self, buffer: mmap.mmap, length: int, offset: int) -> None:
        with memoryview(buffer) as whole, whole[:length] as view:
            self._pwrite_all(view, offset)
        with self._landed:
            self._unflushed += length
            self._landed.notify()

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self._fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._leave_direct()  # the file system took the flag at open but refuses the write

    def _leave_direct(self) -> None:
        import fcntl

        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def _flush_early(self) -> None:
        """Makes what was written durable while the rest is still being hashed and written (fdatasync flushes
        the disk's own cache too), so the fsync of finish() has little left to wait for."""
        while True:
            with self._landed:
                self._landed.wait_for(lambda: self._finishing or self._unflushed >= FLUSH_EVERY)
                if self._finishing:
                    return
                self._unflushed = 0
            try:
                os.fdatasync(self._fd)
            except OSError:
                return  # finish()'s own fsync reports it

    def finish(self) -> None:
        """Writes what is left (padded to ALIGN under O_DIRECT, then cut back to the file's size), waits for every
        hash and write, and fsyncs the file."""
        tail = self._fill
        if tail:
            buffer = self._buffers[self._current]
            self._digests.extend(hash_pool().submit(_sha256_of, buffer, start, min(start + self.chunk_bytes, tail))
                                 for start in range(0, tail, self.chunk_bytes))
            padded = -(-tail // ALIGN) * ALIGN if self.direct else tail
            buffer[tail:padded] = bytes(padded - tail)
            for index in range(len(self._buffers)):
                if index != self._current:
                    self._reclaim(index)  # the writes before the tail, in order, before the tail's own
            with memoryview(buffer) as whole, whole[:padded] as view:
                self._pwrite_all(view, self._offset)
            if padded != tail:
                os.ftruncate(self._fd, self._offset + tail)
            self._offset += tail
            self._fill = 0
        for index in range(len(self._buffers)):
            self._reclaim(index)
        self._stop_background()
        for job in self._digests:
            job.result()
        os.fsync(self._fd)

    def chunk_digests(self) -> list[str] | None:
        """Per-chunk sha256s of the whole file (after finish), or None for a file of one chunk."""
        return file_digest([job.result() for job in self._digests], self.size)[1]

    def hexdigest(self) -> str:
        """The file's `sha256` (after finish): of its bytes (one chunk), else of its chunk digests (format 3)."""
        return file_digest([job.result() for job in self._digests], self.size)[0]

    def _stop_background(self) -> None:
        if self._flusher is not None:
            with self._landed:
                self._finishing = True
                self._landed.notify()
            self._flusher.join()
            self._flusher = None
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    def close(self) -> None:
        """Waits for every job still reading a buffer (errors were raised by finish, or are moot), then frees all."""
        for jobs in self._busy:
            for job in jobs:
                job.exception()  # waits; an error here was raised already or the write is being abandoned
        self._busy = [[] for _ in self._buffers]
        for job in self._digests:
            job.exception()
        self._stop_background()
        for buffer in self._buffers:
            buffer.close()
        self._buffers = []
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "StagedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
