"""Where a dump lives: a directory on this machine (pathlib.Path) or under an fsspec URL in object storage.

`as_location("s3://bucket/dumps")` gives a RemotePath, which offers the part of pathlib.Path the dump reader
and writer use (`/`, `name`, `parent`, `is_file`, `is_dir`, `stat`, `open`, `iterdir`, `glob`), so that one reader
and one writer serve both. A RemotePath has no `__fspath__`: an `os.*` call handed one fails instead of touching
a local file of the same name. The helpers below (`lstat`, `open_read`, `open_write`, `RangeReader`, `remove_tree`)
take either kind.

What object storage changes, and how the format copes:
- There is no rename: a writer writes its files straight under the rank dump's final name, the manifest last
  (forensics.format.writer). A rank dump without a manifest is incomplete: every reader says so and never reads it.
- A dump's files are fetched once into verified local copies that every loader reads (forensics.format.spool);
  without room for one, a large tensor file is read in byte ranges (`RangeReader.read_into`: one ranged GET per
  piece), each chunk verified against the manifest whenever it is fetched (`ChunkCache.read_through`).
- Credentials come from where the storage library looks (the environment, a config file, an instance or pod
  role); a URL carrying a password is refused, and a RemotePath prints as `protocol://bucket/key` only.

- Every request is bounded: `StorageTimeouts` (connect / read timeout, retries) go to the storage library (s3fs:
  botocore's `connect_timeout`, `read_timeout`, `retries`), from the Guard's DumpConfig or, for the commands,
  `--storage-timeout` / $FORENSICS_STORAGE_TIMEOUT and $FORENSICS_STORAGE_RETRIES.

fsspec (and the protocol's package, e.g. s3fs for s3://) is imported only when a URL is used:
`pip install 'forensics[s3]'` (or `[gcs]`, `[azure]`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import math
import os
import re
import stat
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, Union, cast

from forensics.core.errors import StorageError, cut_text

READ_BLOCK = 8 << 20
"""Bytes a sequential remote read fetches at a time (hashing, zstd members, headers): one tensor read is a ranged
GET of its own size instead."""
CACHE_BYTES = 256 << 20
"""Verified chunks of a remote file read by ranges held for its reader (ChunkCache): 64 of 4 MiB."""
WRITE_BLOCK = 32 << 20
"""Bytes a remote writer buffers before it sends a part (S3 multipart: at least 5 MiB a part, at most 10,000
parts, so one file may reach 320 GB). Two files are written at once: 64 MiB of buffers."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
}
EXTRAS = {"s3fs": "s3", "gcsfs": "gcs", "adlfs": "azure"}


def is_url(value: object) -> bool:
    """A location in object storage: `scheme://...` other than `file://` (a RemotePath counts too)."""
    if isinstance(value, RemotePath):
        return True
    if not isinstance(value, str):
        return False
    match = _URL.match(value)
    return match is not None and match.group(1).lower() != "file"


@dataclass(frozen=True)
class StorageTimeouts:
    """How long one request to object storage may wait, and how often it is tried, before the operation fails.

    The worst case of one request is about (connect + read) x (retries + 1) seconds: with the defaults, 2 minutes
    against an endpoint that accepts connections and never answers; one that refuses them fails in seconds."""

    seconds: float = 20.0
    """Connect timeout, and read timeout (the wait for a reply's next bytes), each, in seconds."""
    retries: int = 2
    """Attempts after the first (a timeout, a dropped connection, a throttled request)."""

    def __post_init__(self) -> None:
        if not (self.seconds > 0 and math.isfinite(self.seconds)) or self.retries < 0:
            raise ValueError(
                f"storage timeouts need seconds > 0 and retries >= 0, got seconds={self.seconds}, "
                f"retries={self.retries}"
            )

    @property
    def worst_case_s(self) -> float:
        """The longest one request may take before it fails (every attempt timing out on connect and read)."""
        return 2 * self.seconds * (self.retries + 1)

    @classmethod
    def from_environment(cls) -> StorageTimeouts:
        """$FORENSICS_STORAGE_TIMEOUT (seconds) and $FORENSICS_STORAGE_RETRIES, else the defaults.

        Raises:
            ValueError: a variable is set to something that is not a positive number (says which).
        """
        values: dict[str, Any] = {}
        for name, key, kind in (
            ("FORENSICS_STORAGE_TIMEOUT", "seconds", float),
            ("FORENSICS_STORAGE_RETRIES", "retries", int),
        ):
            text = os.environ.get(name, "").strip()
            if text:
                try:
                    values[key] = kind(text)
                except ValueError:
                    raise ValueError(f"${name}={cut_text(text, 40)!r} is not a number") from None
        return cls(**values)


_timeouts: StorageTimeouts | None = None
"""The process's timeouts for URLs opened without their own (set_storage_timeouts; None: from the environment)."""


def set_storage_timeouts(timeouts: StorageTimeouts | None) -> None:
    """Sets the timeouts `as_location` gives a URL opened without its own (a command's --storage-timeout)."""
    global _timeouts
    _timeouts = timeouts


def storage_timeouts() -> StorageTimeouts:
    """The timeouts a URL opened without its own gets."""
    return _timeouts if _timeouts is not None else StorageTimeouts.from_environment()


def timeout_options(scheme: str, timeouts: StorageTimeouts) -> dict[str, Any]:
    """The storage library's options that bound each request (fsspec storage options), for `scheme`.

    s3fs: botocore's connect / read timeouts and its retry count (mode "standard": backoff with jitter, throttling
    retried too), and s3fs's own retry loop cut to one pass, which would otherwise repeat botocore's whole cycle
    five times (14 minutes against a hung endpoint). Other protocols keep their library's settings: the Guard's
    stall deadline (DumpConfig.write_stall_timeout) bounds what a job waits for them."""
    if scheme in ("s3", "s3a"):
        return {
            "config_kwargs": {
                **_configured(scheme, "config_kwargs"),  # the user's fsspec config (addressing style, signature ...)
                "connect_timeout": timeouts.seconds,
                "read_timeout": timeouts.seconds,
                "retries": {"max_attempts": timeouts.retries + 1, "mode": "standard"},
            },
        }
    return {}


def _configured(scheme: str, option: str) -> dict[str, Any]:
    """`option` of the user's fsspec configuration for `scheme` ($FSSPEC_S3_CONFIG_KWARGS, fsspec's config files): an
    option passed explicitly replaces it whole, so what the user set there is carried over."""
    import fsspec.config

    value = fsspec.config.conf.get(scheme, {}).get(option)
    return dict(value) if isinstance(value, dict) else {}


def _one_retry_loop(fs: Any, scheme: str) -> None:
    """s3fs retries botocore's whole cycle of attempts `retries` times (a class attribute, 5; no constructor argument):
    one pass, so that StorageTimeouts.retries is the count (this filesystem instance is ours: its options are)."""
    if scheme in ("s3", "s3a") and hasattr(fs, "retries"):
        fs.retries = 1


def as_location(value: str | os.PathLike[str] | RemotePath, timeouts: StorageTimeouts | None = None) -> Location:
    """A Path for a local path or `file://` URL, a RemotePath for any other fsspec URL, whose requests are bounded by
    `timeouts` (default: `storage_timeouts()`).

    Raises:
        StorageError: the URL carries a password, or its filesystem package is not installed (says which).
    """
    if isinstance(value, (RemotePath, Path)):
        return value
    text = os.fspath(value)
    match = _URL.match(text)
    if match is None:
        return Path(text)
    scheme = match.group(1).lower()
    if scheme == "file":
        return Path(urllib.parse.unquote(urllib.parse.urlsplit(text).path))
    _refuse_secrets(text)
    try:
        import fsspec
    except ImportError:
        raise StorageError(f"{text} is a URL: reading or writing it needs fsspec. {_install_hint(scheme)}") from None
    try:
        fs, path = fsspec.core.url_to_fs(text, **timeout_options(scheme, timeouts or storage_timeouts()))
        _one_retry_loop(fs, scheme)
    except ImportError as exc:
        raise StorageError(
            f"{scheme}:// needs a package that is not installed ({exc}). {_install_hint(scheme)}"
        ) from None
    except ValueError as exc:
        raise StorageError(f"{cut_text(text, 120)} is not a URL fsspec can open: {cut_text(exc)}") from None
    return RemotePath(fs, str(path), scheme)


def _install_hint(scheme: str) -> str:
    package = PACKAGES.get(scheme)
    if package is None:
        return "Install fsspec and the filesystem package for that protocol."
    return f"pip install 'forensics[{EXTRAS[package]}]' (or pip install {package})."


def _refuse_secrets(url: str) -> None:
    """A password in a URL would be written into logs, the replay command printed and the dump's own record."""
    netloc = urllib.parse.urlsplit(url).netloc
    if "@" in netloc and ":" in netloc.rsplit("@", 1)[0]:
        raise StorageError(
            "the dump location's URL carries a password (user:secret@...): give credentials the way the storage "
            "library reads them (environment variables, its config file, an instance or pod role), never in the URL"
        )
    query = urllib.parse.urlsplit(url).query.lower()
    if any(word in query for word in ("secret", "token", "signature", "key=", "password", "sig=")):
        raise StorageError(
            "the dump location's URL carries a credential in its query: give credentials through the environment "
            "or the storage library's config instead"
        )


@dataclass(frozen=True)
class RemoteStat:
    """What `os.stat` would say of an object: its size, a regular file or a directory, its modification time."""

    st_size: int
    st_mode: int
    st_mtime: float


class RemotePath:
    """A file or directory (a key prefix) in an fsspec filesystem, with the part of pathlib.Path's interface the
    dump reader and writer use. Object storage has no links, devices or FIFOs: every object is a regular file."""

    __slots__ = ("fs", "path", "protocol")

    def __init__(self, fs: Any, path: str, protocol: str):
        self.fs, self.protocol = fs, protocol
        root = "/" if getattr(fs, "root_marker", "") == "/" else ""  # memory:// and other local-like filesystems
        self.path = root + "/".join(part for part in path.split("/") if part)

    # -- naming ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        return f"{self.protocol}://{self.path.lstrip('/')}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (self.protocol, self.path) == (other.protocol, other.path)

    def __hash__(self) -> int:
        return hash((self.protocol, self.path))

    def __lt__(self, other: RemotePath) -> bool:
        return str(self) < str(other)

    def __truediv__(self, name: str | os.PathLike[str]) -> RemotePath:
        parts = [part for part in PurePosixPath(os.fspath(name)).parts if part not in ("", "/")]
        if any(part in (".", "..") for part in parts) or PurePosixPath(os.fspath(name)).is_absolute():
            raise ValueError(f"{name!r} is not a name below {self}")
        return RemotePath(self.fs, "/".join([self.path, *parts]), self.protocol)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        parts = self.path.strip("/").split("/")
        return self if len(parts) <= 1 else RemotePath(self.fs, "/".join(parts[:-1]), self.protocol)

    @property
    def parents(self) -> list[RemotePath]:
        out, here = [], self
        while here.parent != here:
            here = here.parent
            out.append(here)
        return out

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        return PurePosixPath(self.path).relative_to(other.path)

    def resolve(self) -> RemotePath:
        return self

    def as_posix(self) -> str:
        return str(self)

    # -- what is there --------------------------------------------------------------------------
    def _info(self) -> dict[str, Any] | None:
        with _calling(self, "looking up"):
            try:
                return cast("dict[str, Any]", self.fs.info(self.path))
            except FileNotFoundError:
                return None

    def exists(self) -> bool:
        return self._info() is not None

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "file"

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> RemoteStat:
        info = self._info()
        if info is None:
            raise FileNotFoundError(2, "no such object", str(self))
        mode = stat.S_IFREG | 0o644 if info.get("type") == "file" else stat.S_IFDIR | 0o755
        modified = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
        mtime = modified.timestamp() if hasattr(modified, "timestamp") else float(modified or 0)
        return RemoteStat(int(info.get("size") or 0), mode, mtime)

    def iterdir(self) -> Iterator[RemotePath]:
        with _calling(self, "listing"):
            try:
                names = self.fs.ls(self.path, detail=False, refresh=True)
            except FileNotFoundError:
                names = []
        for name in sorted(names):
            child = RemotePath(self.fs, name, self.protocol)
            if child.path != self.path:
                yield child

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """The direct children whose name matches `pattern` (one path component, as the reader asks)."""
        if "/" in pattern:
            raise ValueError("RemotePath.glob matches names of direct children only")
        return (child for child in self.iterdir() if fnmatch.fnmatchcase(child.name, pattern))

    def rglob(self, name: str) -> Iterator[RemotePath]:
        """Every object below this prefix named `name` (one recursive listing, paged by the store)."""
        with _calling(self, "listing"):
            try:
                found = self.fs.find(self.path)
            except FileNotFoundError:
                found = []
        for key in sorted(found):
            if key.rsplit("/", 1)[-1] == name:
                yield RemotePath(self.fs, key, self.protocol)

    # -- reading and writing --------------------------------------------------------------------
    def open(self, mode: str = "rb") -> IO[bytes]:
        if mode not in ("rb", "wb"):
            raise ValueError(f"RemotePath opens in 'rb' or 'wb', not {mode!r}")
        with _calling(self, "opening"):
            block = READ_BLOCK if mode == "rb" else WRITE_BLOCK
            return cast("IO[bytes]", self.fs.open(self.path, mode, block_size=block))

    def read_bytes(self) -> bytes:
        with self.open("rb") as handle:
            return handle.read()

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object storage has no directories: a prefix exists once an object is under it."""

    def rmdir(self) -> None:
        """An empty prefix is no object: nothing to remove (one holding objects stays, as an rmdir would refuse)."""


Location = Union[Path, RemotePath]
"""Where a dump (or a directory of dumps) lives."""


class SlowRequests:
    """The requests to object storage in flight, and a daemon thread that tells `report(what, where, waited_s)` of
    each one still waiting after NOTICE_AFTER_S, then every NOTICE_AFTER_S more (the commands' progress against a
    slow or hung store: `forensics list s3://...` says what it waits for instead of printing nothing). Off (no
    thread) until a reporter is set."""

    NOTICE_AFTER_S = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[int, tuple[str, str, float]] = {}
        self._next = 0
        self.report: Any = None
        self._thread: threading.Thread | None = None

    def watch(self, report: Any) -> None:
        """Reports slow requests to `report(what, where, waited_s)` from now on (None: stops reporting)."""
        self.report = report
        if report is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="forensics-slow-requests", daemon=True)
            self._thread.start()

    def start(self, what: str, where: RemotePath) -> int | None:
        if self.report is None:
            return None
        with self._lock:
            self._next += 1
            self._in_flight[self._next] = (what, str(where), time.monotonic())
            return self._next

    def end(self, token: int | None) -> None:
        if token is not None:
            with self._lock:
                self._in_flight.pop(token, None)

    def _run(self) -> None:
        told: dict[int, int] = {}
        while True:
            time.sleep(1.0)
            now, report = time.monotonic(), self.report
            with self._lock:
                slow = [
                    (t, w, p, now - at) for t, (w, p, at) in self._in_flight.items() if now - at >= self.NOTICE_AFTER_S
                ]
                told = {t: n for t, n in told.items() if t in self._in_flight}
            for token, what, where, waited in slow:
                times = int(waited // self.NOTICE_AFTER_S)
                if report is not None and told.get(token) != times:
                    told[token] = times
                    try:
                        report(what, where, waited)
                    except Exception:  # noqa: BLE001 - a progress line never fails the command
                        pass


slow_requests = SlowRequests()
"""The process's requests in flight (forensics.cli sets the reporter)."""


@contextlib.contextmanager
def _calling(path: RemotePath, what: str) -> Iterator[None]:
    """Storage errors as OSError (a missing object, no permission: the storage library's own) or StorageError (no
    credentials, an unreachable endpoint), naming the location but never a credential."""
    token = slow_requests.start(what, path)
    try:
        yield
    except OSError as exc:
        if _timed_out(exc):
            raise StorageError(
                f"{what} {path} failed: the store did not answer in time ({type(exc).__name__}: {cut_text(exc, 160)}). "
                "Check the endpoint; how long a request may wait: --storage-timeout / $FORENSICS_STORAGE_TIMEOUT "
                "(DumpConfig.storage_timeout in a job)"
            ) from exc
        raise
    except Exception as exc:
        raise StorageError(
            f"{what} {path} failed: {type(exc).__name__}: {cut_text(exc, 240)} (credentials and the endpoint come "
            "from the storage library's usual places: environment variables, its config file, an instance role)"
        ) from exc
    finally:
        slow_requests.end(token)


def _timed_out(exc: OSError) -> bool:
    """A request that timed out (botocore's ReadTimeoutError / ConnectTimeoutError are OSErrors without an errno,
    like TimeoutError): a store that did not answer, not a file system's refusal."""
    return isinstance(exc, TimeoutError) or (exc.errno is None and "Timeout" in type(exc).__name__)


def lstat(path: Location) -> os.stat_result | RemoteStat:
    """`os.lstat` of a local path (a link is not followed), the object's size and kind in object storage.

    Raises:
        FileNotFoundError: nothing is there.
    """
    return path.stat() if isinstance(path, RemotePath) else os.lstat(path)


def lstat_mode(path: Location) -> int:
    """The file type bits of `path` (0: nothing there, or unreadable)."""
    try:
        return lstat(path).st_mode
    except OSError:
        return 0


def file_size(path: Location) -> int:
    return lstat(path).st_size


def open_read(path: Location | str) -> IO[bytes]:
    """A binary file to read sequentially (remote: fetched READ_BLOCK bytes at a time)."""
    return path.open("rb") if isinstance(path, RemotePath) else open(path, "rb")


def open_write(path: Location) -> IO[bytes]:
    """A binary file to write (remote: sent in WRITE_BLOCK parts; the object appears whole when it is closed)."""
    return path.open("wb") if isinstance(path, RemotePath) else open(path, "wb")


def remove_tree(path: Location) -> None:
    """Deletes a directory (every object under a prefix) and everything in it."""
    if isinstance(path, RemotePath):
        with _calling(path, "deleting"):
            with contextlib.suppress(FileNotFoundError):
                path.fs.rm(path.path, recursive=True)
    else:
        import shutil

        shutil.rmtree(path)


class ChunkCache:
    """The verified chunks of one file in object storage read by ranges (no room for a local copy), kept for the
    reader that follows the verification, so each byte crosses the network once where it can (on disk the page cache
    does this). Bounded: when full, a new chunk is not kept (those nearest the reader are); a chunk the reader has
    passed is dropped; a range not held is fetched again, as whole chunks verified again (`read_through`)."""

    def __init__(
        self, chunk_size: int, limit_bytes: int | None = None, digests: list[str] | None = None, name: str = ""
    ):
        self.chunk_size = chunk_size
        self.digests, self.name = digests, name
        """The manifest's sha256 of each chunk: a chunk fetched again (not held) is checked again before it is used."""
        self._most = max(2, (CACHE_BYTES if limit_bytes is None else limit_bytes) // max(1, chunk_size))
        self._held: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def put(self, index: int, data: bytes) -> None:
        with self._lock:
            if len(self._held) < self._most:
                self._held[index] = data

    def clear(self) -> None:
        """Nothing more will be read through it (the file was verified whole, for `verify`)."""
        with self._lock:
            self._held.clear()

    def read_into(self, view: memoryview, offset: int) -> bool:
        """Fills `view` with the bytes at `offset` when every chunk they lie in is held (False: none copied)."""
        size = len(view)
        if size == 0:
            return True
        first, last = offset // self.chunk_size, (offset + size - 1) // self.chunk_size
        with self._lock:
            pieces = [self._held.get(index) for index in range(first, last + 1)]
            for index in [i for i in self._held if i < first]:  # the reader goes front to back: passed for good
                del self._held[index]
        if any(piece is None for piece in pieces):
            return False
        done = 0
        for index, piece in zip(range(first, last + 1), pieces):
            assert piece is not None
            start = max(offset, index * self.chunk_size) - index * self.chunk_size
            take = min(len(piece) - start, size - done)
            view[done : done + take] = piece[start : start + take]
            done += take
        return done == size

    def read_through(self, reader: RangeReader, view: memoryview, offset: int) -> int:
        """Fills `view` from `offset` (fewer bytes only at the end of the file) with verified bytes: held chunks, and
        the others fetched whole and checked against their digests again, so a file replaced in the store after it
        was verified is refused instead of read.

        Raises:
            DumpCorruptError: a chunk fetched again no longer matches its sha256 (naming the file).
        """
        size = max(0, min(len(view), reader.size - offset))
        if size == 0 or self.read_into(view[:size], offset):
            return size
        done = 0
        for index in range(offset // self.chunk_size, (offset + size - 1) // self.chunk_size + 1):
            with self._lock:
                piece = self._held.get(index)
            if piece is None:
                piece = self._fetch_verified(reader, index)
            start = max(offset, index * self.chunk_size) - index * self.chunk_size
            take = min(len(piece) - start, size - done)
            view[done : done + take] = piece[start : start + take]
            done += take
        return done

    def _fetch_verified(self, reader: RangeReader, index: int) -> bytes:
        from forensics.core.errors import DumpCorruptError

        assert self.digests is not None
        begin = index * self.chunk_size
        data = reader.fetch(min(self.chunk_size, reader.size - begin), begin)
        if hashlib.sha256(data).hexdigest() != self.digests[index]:
            raise DumpCorruptError(
                f"{reader.path} was changed in the store after it was verified (chunk {index} no longer matches "
                "its sha256 in the manifest): the object was replaced or rewritten during the replay, and nothing "
                "read from it is used. Replay again once the dump is no longer being changed",
                self.name,
            )
        self.put(index, data)
        return data


STREAM_RESUMES = 2
"""Times a streamed reply cut off midway (a dropped connection, a read timeout) is asked for again from where it stopped:
each attempt is itself bounded by the StorageTimeouts the filesystem was opened with."""


def streams(path: Location) -> bool:
    """A file of s3fs's, whose replies can be read as they arrive (its `_call_s3` hands the stream over)."""
    if not isinstance(path, RemotePath):
        return False
    fs = path.fs
    return hasattr(fs, "_call_s3") and hasattr(fs, "split_path") and getattr(fs, "loop", None) is not None


async def _read_exactly(body: Any, size: int) -> memoryview:
    """`size` bytes of a reply (fewer where it ends) in one buffer, filled as they arrive: no second copy."""
    buffer, got = bytearray(size), 0
    while got < size:
        data = await body.read(size - got)
        if not data:
            break
        buffer[got : got + len(data)] = data
        got += len(data)
    return memoryview(buffer)[:got]


async def _close(body: Any) -> None:
    body.close()


def _s3_stream(path: RemotePath, begin: int, end: int, piece: int) -> Iterator[memoryview]:
    """RangeReader.stream for s3fs: one ranged GET of [begin, end), its reply read `piece` bytes at a time."""
    from fsspec.asyn import sync

    fs = path.fs
    bucket, key, version = fs.split_path(path.path)
    options = {**getattr(fs, "req_kw", {}), **({"VersionId": version} if version else {})}
    offset, body, resumes = begin, None, 0
    try:
        while offset < end:
            try:
                with _calling(path, "reading"):
                    if body is None:
                        reply = sync(
                            fs.loop,
                            fs._call_s3,
                            "get_object",
                            Bucket=bucket,
                            Key=key,
                            Range=f"bytes={offset}-{end - 1}",
                            **options,
                        )
                        body = reply["Body"]
                    data = sync(fs.loop, _read_exactly, body, min(piece, end - offset))
            except (StorageError, ConnectionError):
                if body is None or resumes >= STREAM_RESUMES:
                    raise
                resumes += 1
                sync(fs.loop, _close, body)
                body = None
                continue
            if not len(data):
                return
            offset += len(data)
            yield data
            data = None  # the consumer's, not held while the next piece arrives
    finally:
        if body is not None:
            with contextlib.suppress(Exception):
                sync(fs.loop, _close, body)


class RangeReader:
    """Reads byte ranges of one file: `pread` on a local descriptor (no shared offset: many threads read at
    once), a ranged GET per call in object storage (served from `cache` when the verification fetched it already).
    Close it when done."""

    def __init__(self, path: Location | str, cache: ChunkCache | None = None):
        self.path = path if isinstance(path, RemotePath) else Path(path)
        self.cache = cache
        self._fd = -1
        if isinstance(self.path, RemotePath):
            self.size = self.path.stat().st_size
        else:
            self._fd = os.open(self.path, os.O_RDONLY)
            self.size = os.fstat(self._fd).st_size

    def read(self, size: int, offset: int) -> bytes:
        """Up to `size` bytes at `offset` (fewer only at the end of the file); verified ones where the cache knows
        the chunks' digests."""
        if isinstance(self.path, RemotePath):
            if self.cache is not None and self.cache.digests is not None:
                buffer = bytearray(max(0, min(size, self.size - offset)))
                return bytes(buffer[: self.read_into(memoryview(buffer), offset)])
            return self.fetch(size, offset)
        return os.pread(self._fd, size, offset)

    def fetch(self, size: int, offset: int) -> bytes:
        """Up to `size` bytes at `offset` from the store, as they are there now (one ranged GET)."""
        assert isinstance(self.path, RemotePath)
        end = min(self.size, offset + size)
        if end <= offset:
            return b""
        with _calling(self.path, "reading"):
            return bytes(self.path.fs.cat_file(self.path.path, start=offset, end=end))

    def stream(self, begin: int, end: int, piece: int, block: int) -> Iterator[bytes | memoryview]:
        """The bytes [begin, end) as they are in the store now, in pieces of `piece` bytes (the last one shorter;
        the pieces stop early only where the file does). From ONE GET read as it arrives where the storage library can
        stream a reply (s3fs), so the host holds one piece at a time, never the range; elsewhere from ranged GETs of
        `block` bytes. A reply cut off midway is asked for again from where it stopped (STREAM_RESUMES times)."""
        end = min(end, self.size)
        if isinstance(self.path, RemotePath) and streams(self.path):
            yield from _s3_stream(self.path, begin, end, piece)
            return
        offset = begin
        while offset < end:
            data = self.fetch(min(block, end - offset), offset) if self._fd < 0 else self.read(block, offset)
            if not data:
                return
            for start in range(0, len(data), piece):
                yield data[start : start + piece]
            offset += len(data)

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fills `view` from `offset` on (fewer bytes only at the end of the file); returns how many were read."""
        if not isinstance(self.path, RemotePath):
            return os.preadv(self._fd, [view], offset)
        if self.cache is not None and self.cache.digests is not None:
            return self.cache.read_through(self, view, offset)
        if self.cache is not None and self.cache.read_into(view, offset):
            return len(view)
        data = self.fetch(len(view), offset)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
