"""A large dump file written with O_DIRECT through a few reused aligned buffers: no page cache between the state and
the disk.

A buffered write copies every byte into page-cache pages the kernel must first allocate (and, on a VM whose host
reclaims free guest memory, fault in from the host: 0.6-1.3 s per GiB on the 2-core dev machine, varying 10x from one
write to the next), then writes them out at the fsync. `DirectFile` copies the bytes into BUFFERS page-aligned
buffers allocated once per file, and an I/O thread hands each full buffer to the disk with O_DIRECT while the caller
fills the next: the CPU the page cache took is left to the hash (forensics/format/digest.py), and a multi-GB dump no
longer evicts the job's own page cache (its data set). The last, unaligned bytes are written without O_DIRECT. The
file's bytes are the same; the caller's fsync makes it durable (O_DIRECT writes may sit in the disk's own cache).

Only a local disk's file system (ext4, xfs, btrfs, f2fs) is written this way: elsewhere (network and parallel file
systems, FUSE, tmpfs), where O_DIRECT is refused, or with FORENSICS_DIRECT_IO=0, `open_direct` gives `None` and the
caller writes through the page cache instead (forensics/format/writeback.py).
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import queue
import sys
import threading
from typing import Any

import numpy as np

ALIGN = 4096  # O_DIRECT needs the buffer, the file offset and the length aligned to the logical block (512 or 4096)
BUFFER = 8 << 20  # bytes per aligned buffer: one O_DIRECT write each
BUFFERS = 3  # one being filled, one being written, one spare: the copy and the disk never wait for each other
# (two I/O threads writing at their offsets were measured on the 2-core machine beside two busy processes, 2026-11-28:
# no gain, raw+sha256 / raw direct 1.96, 1.59 against 1.82, 1.66 with one)
MIN_BYTES = 16 << 20  # below this a file goes through the page cache: three 8 MiB buffers are not worth it


LOCAL_DISK_FILE_SYSTEMS = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0xF2F52010: "f2fs",
}
"""statfs f_type of the file systems O_DIRECT is used on: a local disk's, where it skips the page cache and nothing
else. On network and parallel file systems (NFS, Lustre, GPFS, FUSE) O_DIRECT changes how writes travel (each 8 MiB
write a synchronous round trip), so their dumps keep the page cache's path; so does any file system not listed."""


@functools.lru_cache(maxsize=1)
def _statfs() -> Any:
    """libc's statfs (Linux; the process's own symbols: no library search, no subprocess), None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return None


def file_system_type(directory: os.PathLike | str) -> int | None:
    """statfs(2)'s f_type of the file system holding `directory` (Linux), None where it cannot be read."""
    import ctypes

    statfs = _statfs()
    if statfs is None:
        return None
    buffer = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first field, a long
    if statfs(os.fsencode(directory), buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def open_direct(path: os.PathLike | str) -> "DirectFile | None":
    """A new file at `path` (truncated if it exists) written with O_DIRECT, or None where the file system is not a
    local disk's (LOCAL_DISK_FILE_SYSTEMS), refuses O_DIRECT, or the platform has none, or FORENSICS_DIRECT_IO=0.

    Raises:
        OSError: the file cannot be created (permission, a missing directory, a full disk).
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or os.environ.get("FORENSICS_DIRECT_IO", "1") == "0":
        return None
    if file_system_type(os.path.dirname(os.path.abspath(path))) not in LOCAL_DISK_FILE_SYSTEMS:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | flag, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # the file system has no O_DIRECT
            return None
        raise
    try:
        return DirectFile(fd)
    except BaseException:  # its buffers or thread could not be made: the descriptor goes with it
        os.close(fd)
        raise


class DirectFile:
    """A write-only file (an O_DIRECT descriptor) that copies what it is given into aligned buffers, written out by
    its own thread. `flush()` writes everything given so far (the unaligned tail without O_DIRECT) and raises the
    first write error; `close()` stops the thread and closes the descriptor (after an error too).

    Example:
        >>> out = open_direct(path)  # doctest: +SKIP
        >>> out.write(data); out.flush(); os.fsync(out.fileno()); out.close()
    """

    def __init__(self, fd: int):
        self.fd = fd
        self._free: queue.Queue = queue.Queue()
        for _ in range(BUFFERS):
            self._free.put(mmap.mmap(-1, BUFFER))  # page-aligned, touched once per file, reused for every byte
        self._full: queue.Queue = queue.Queue()
        self._buffer: mmap.mmap | None = None
        self._fill = 0  # bytes in the buffer being filled
        self._error: OSError | None = None
        self._tail = False  # the unaligned tail is written: O_DIRECT is off, nothing more may come
        self._thread = threading.Thread(target=self._run, name="forensics-direct-write", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        return self.fd

    def write(self, data: Any) -> int:
        """Copies `data` into the buffers (the caller may reuse its memory once this returns); full buffers go to
        the disk on the I/O thread."""
        if self._tail:
            raise ValueError("DirectFile: write after flush")
        self._raise()
        source = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        done = 0
        while done < len(source):
            if self._buffer is None:
                self._buffer, self._fill = self._free.get(), 0
                self._raise()
            take = min(len(source) - done, BUFFER - self._fill)
            # numpy copies without the GIL: two files written at once copy on both cores
            np.copyto(np.frombuffer(self._buffer, np.uint8, take, self._fill), source[done : done + take])
            self._fill += take
            done += take
            if self._fill == BUFFER:
                self._full.put((self._buffer, BUFFER))
                self._buffer = None
        return len(source)

    def flush(self) -> None:
        """Writes everything given so far: the aligned part with O_DIRECT, the rest through the page cache.

        Raises:
            OSError: a write failed (a full disk, a file-size limit).
        """
        if self._tail:
            return
        buffer, fill = self._buffer, self._fill
        aligned = fill - fill % ALIGN
        if buffer is not None and aligned:
            self._full.put((buffer, aligned))
        self._buffer = None
        self._drain()
        self._raise()
        self._tail = True
        if buffer is not None and fill > aligned:
            self._direct_off()
            _write_all(self.fd, memoryview(buffer)[aligned:fill])

    def close(self) -> None:
        """Stops the I/O thread and closes the file; what was not flushed is lost (the caller removes the file)."""
        if self._thread.is_alive():
            self._full.put(None)
            self._thread.join()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, view: memoryview) -> None:
        """One buffer to the disk; a file system that took O_DIRECT at open but refuses the write itself (EINVAL:
        an alignment it does not support) gets this and every later write through the page cache."""
        done = 0
        while done < len(view):
            try:
                done += os.write(self.fd, view[done:])
            except OSError as exc:  # a refused write writes nothing: the rest goes again, buffered
                if exc.errno != errno.EINVAL or not self._direct_off():
                    raise

    def _direct_off(self) -> bool:
        """Clears O_DIRECT on the file; False when it was off already."""
        import fcntl  # POSIX only: a DirectFile exists only where os.O_DIRECT does

        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        if not flags & os.O_DIRECT:
            return False
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        return True

    def _drain(self) -> None:
        """Waits until the I/O thread has written every buffer handed to it."""
        self._full.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._full.get()
            try:
                if item is None:
                    return
                buffer, size = item
                if self._error is None:
                    try:
                        self._write(memoryview(buffer)[:size])
                    except OSError as exc:
                        self._error = exc
                self._free.put(buffer)
            finally:
                self._full.task_done()


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
