"""Reads dumps lazily and safely: manifest first, each file checked (size, sha256) before it is parsed."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
from concurrent.futures import CancelledError, Future
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterator

from forensics.core.errors import (
    DumpCorruptError,
    DumpNotFoundError,
    ForensicsError,
    NotADumpError,
    UnsupportedVersionError,
    cut_text,
)
from forensics.core.redact import redacted_environment
from forensics.format import jsonio, spec
from forensics.format.archive import unpack_archive
from forensics.format.digest import chunk_digests
from forensics.format.header import read_entries
from forensics.format.limits import HASH_CHUNK, MAX_JSON_FILE, ArchiveLimits
from forensics.format.location import (
    ChunkCache,
    Location,
    RangeReader,
    RemotePath,
    as_location,
    lstat,
    lstat_mode,
    open_read,
)
from forensics.format.members import check_member, check_member_header, read_json_member, read_tensor_member
from forensics.format.manifest import check_manifest
from forensics.format.records import checked_history, checked_precursors
import forensics.format.prefetch as prefetch
from forensics.format.spool import Spool, SpooledFile
from forensics.core.trigger import Trigger

if TYPE_CHECKING:  # torch is imported only when tensors are read: inspect and verify start fast
    import torch

    from forensics.format.shards import ShardedState
    from forensics.core.rng import RngState


def read_manifest(directory: Location) -> dict:
    """Parses manifest.json of a rank dump directory and checks it against the schema (forensics.format.manifest)."""
    path = directory / spec.MANIFEST
    if not path.is_file() or path.is_symlink():
        raise NotADumpError(
            f"{directory} is not a complete dump: it has no {spec.MANIFEST} "
            "(the writer may have died before finishing; nothing there can be trusted)"
        )
    size = path.stat().st_size
    if size > MAX_JSON_FILE:
        raise DumpCorruptError(f"{path} is {size} bytes; a manifest is at most {MAX_JSON_FILE}", spec.MANIFEST)
    try:
        manifest = jsonio.parse_json(path.read_bytes())
    except ValueError as exc:  # also UnicodeDecodeError, JSONDecodeError, depth, number and duplicate-key limits
        raise DumpCorruptError(f"{path} {jsonio.refusal(exc)}", spec.MANIFEST) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != spec.FORMAT_NAME:
        raise DumpCorruptError(f"{path} is not a forensics manifest (format != {spec.FORMAT_NAME!r})", spec.MANIFEST)
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise DumpCorruptError(
            f"{path}: format_version must be an integer, got {cut_text(repr(version))}", spec.MANIFEST
        )
    if version > spec.FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"{directory} is dump format version {version}, but this forensics reads up to version "
            f"{spec.FORMAT_VERSION}. Upgrade forensics (pip install -U forensics) to read it."
        )
    if version < 1:
        raise DumpCorruptError(f"{path}: format_version {version} does not exist", spec.MANIFEST)
    missing = [key for key in spec.REQUIRED_MANIFEST_KEYS if key not in manifest]
    if missing:
        raise DumpCorruptError(f"{path} lacks required keys {missing}", spec.MANIFEST)
    try:
        manifest = jsonio.from_jsonable(manifest)
    except ValueError as exc:
        raise DumpCorruptError(f"{path} {jsonio.refusal(exc)}", spec.MANIFEST) from exc
    check_manifest(manifest, str(path))
    if "environment" in manifest:  # a dump written before a credential's form was known still shows none
        manifest["environment"] = redacted_environment(manifest["environment"])
    return manifest


REMOTE_FETCHES_MIN = 4
"""Chunks of a file in object storage fetched (and hashed) at once, at least: a request waits on the network, so a
2-core host still keeps several in flight (more would only run ahead of the reader: ChunkCache drops what it
cannot hold, and the reader fetches it again)."""


REMOTE_AHEAD = 32
"""Chunks of a file in object storage fetched ahead of the reader (128 MiB of 4 MiB chunks; ChunkCache holds 64)."""


def _workers(remote: bool) -> int:
    cores = min(32, os.cpu_count() or 1)
    return max(REMOTE_FETCHES_MIN, cores) if remote else cores


class ChunkVerifier:
    """Checks a file's chunks against their sha256s (manifest `chunks`) on a pool of threads, in the background
    and in file order, so a reader can overlap verification with reading: `wait(begin, end)` returns once every
    chunk holding a byte of that range matched, and raises DumpCorruptError for one that did not. No byte is
    handed on before the chunk holding it is verified; the file is hashed at multi-core speed while it is read.
    """

    def __init__(
        self, path: Location, name: str, size: int, chunk_size: int, digests: list[str], workers: int | None = None
    ):
        from concurrent.futures import ThreadPoolExecutor

        if chunk_size <= 0 or len(digests) != max(1, -(-size // chunk_size)):
            raise DumpCorruptError(f"{path}: the manifest's chunk digests do not cover the file", name)
        self.path, self.name, self.size, self.chunk_size, self.digests = path, name, size, chunk_size, digests
        self.cache = ChunkCache(chunk_size, digests=digests, name=name) if isinstance(path, RemotePath) else None
        """Object storage with no room for a local copy (forensics.format.spool): the chunks verified, kept for the
        reader; one fetched again is verified again."""
        self._pool = ThreadPoolExecutor(
            max_workers=workers or _workers(isinstance(path, RemotePath)),
            thread_name_prefix="forensics-verify",
        )
        self._matched, self._count_lock, self._submit_lock = 0, threading.Lock(), threading.Lock()
        self._chunks: list[Future[bool] | None] = [None] * len(digests)
        self._failed: int | None = None
        """The first chunk found not to match (the one a later wait names: the checks after it were cancelled)."""
        self._started = 0
        self._submit(0, REMOTE_AHEAD if self.cache is not None else len(digests))

    def _submit(self, first: int, stop: int) -> None:
        """Starts the checks of chunks [first, stop) not started yet. On disk every chunk starts at once; in object
        storage only REMOTE_AHEAD beyond what the reader asked for, so the chunks fetched wait in the cache (bounded)
        for the reader instead of being dropped and fetched again."""
        with self._submit_lock:
            if self._started == len(self._chunks):
                return
            for index in range(first, min(stop, len(self._chunks))):
                if self._chunks[index] is None:
                    self._chunks[index] = self._pool.submit(self._check, index)
                    self._started += 1
            if self._started == len(self._chunks):
                self._pool.shutdown(wait=False)  # every chunk started: the threads end when they are done

    def _check(self, index: int) -> bool:
        digest = hashlib.sha256()
        start, end = index * self.chunk_size, min(self.size, (index + 1) * self.chunk_size)
        with RangeReader(self.path) as handle:
            if self.cache is not None:  # one request for the chunk, kept for the reader once it matched
                data = handle.fetch(end - start, start)
                digest.update(data)
                matched = len(data) == end - start and digest.hexdigest() == self.digests[index]
                if matched:
                    self.cache.put(index, data)
            else:
                offset = start
                while offset < end:
                    data = handle.read(min(HASH_CHUNK, end - offset), offset)
                    if not data:
                        return False
                    digest.update(data)
                    offset += len(data)
                matched = digest.hexdigest() == self.digests[index]
        if matched:
            with self._count_lock:
                self._matched += 1
        return matched

    def wait(self, begin: int, end: int) -> None:
        first, last = begin // self.chunk_size, max(begin, end - 1) // self.chunk_size
        self._submit(first, last + 1 + (REMOTE_AHEAD if self.cache is not None else 0))
        for index in range(first, min(last, len(self._chunks) - 1) + 1):
            chunk = self._chunks[index]
            try:
                matched = chunk is not None and chunk.result()
            except CancelledError:  # closed after another chunk did not match (another reader's wait)
                matched = False
            if not matched:
                self.close()
                if self._failed is None:
                    self._failed = index
                raise DumpCorruptError(
                    f"{self.path} does not match its sha256 in the manifest (chunk {self._failed}): the "
                    "file was changed or corrupted",
                    self.name,
                )

    def wait_all(self) -> None:
        self.wait(0, self.size)

    @property
    def done(self) -> bool:
        """Every chunk matched (a counter: asked after every tensor read, it must not walk 10,000 futures)."""
        return self._matched == len(self._chunks)

    def close(self) -> None:
        for chunk in self._chunks:
            if chunk is not None:
                chunk.cancel()


def _check_rank_name(directory: Location, manifest: dict) -> None:
    """A directory named for a rank (rank-<R>) holds that rank's dump: a copy of another rank's dump under its name
    would be replayed, verified and counted twice while rank R's is lost."""
    named = spec.rank_of_dir_name(directory.name)
    if named is not None and named != manifest["rank"]:
        raise DumpCorruptError(
            f"{directory} is named for rank {named}, but its manifest says rank {manifest['rank']}"
            f" (whose own directory is {spec.rank_dir_name(manifest['rank'])}): a rank dump was "
            f"copied or renamed, and rank {named}'s dump is not there",
            spec.MANIFEST,
        )


def is_rank_dump(path: Location) -> bool:
    return (path / spec.MANIFEST).is_file()


def rank_dirs(step_dir: Location) -> list[Location]:
    return sorted((p for p in step_dir.glob("rank-*") if p.is_dir() and not p.is_symlink()), key=str)


def step_rank_dirs(root: Location, run_id: str, step: int) -> list[Location]:
    """The complete rank dumps of `run_id`'s step under `root`: a rank directory, a step directory, a run
    directory or a dump_dir (where another node wrote its ranks' parts of a sharded dump)."""
    name = spec.step_dir_name(step)
    for candidate in (root, root / name, root / run_id / name):
        if is_rank_dump(candidate):
            return [candidate]
        if candidate.is_dir() and not candidate.is_symlink():
            ranks = [r for r in rank_dirs(candidate) if is_rank_dump(r)]
            if ranks:
                return ranks
    return []


class Dump:
    """One rank dump. Cheap to open: only the manifest is read until a loader is called."""

    def __init__(self, directory: str | os.PathLike[str] | Location, archive_tmp: Any = None):
        self.path: Location = as_location(directory)
        self.manifest = read_manifest(self.path)
        _check_rank_name(self.path, self.manifest)
        self._archive_tmp = archive_tmp  # keeps an unpacked archive's temp dir alive
        self._verified: set[str] = set()
        self._handles: dict[str, Any] = {}
        self._optimizer_indexes: dict[spec.StateFiles, dict] = {}
        self._verifiers: dict[str, ChunkVerifier | SpooledFile] = {}
        self._spool = Spool() if isinstance(self.path, RemotePath) else None
        """Object storage: the verified local copies every loader reads (forensics.format.spool)."""
        self._open_lock = threading.RLock()
        self.set_aside: dict[str, str] = {}
        """Listed files found damaged and left out (forensics.format.verify.set_aside_damaged): the dump reads as one
        without them. File name -> why."""
        self.shard_dirs: list[Location] = []
        """Sharded layout: more directories (step, run or dump_dir of other nodes) holding this dump's ranks."""

    # -- plain fields ------------------------------------------------------------------------
    step = property(lambda self: int(self.manifest["step"]))
    rank = property(lambda self: int(self.manifest["rank"]))
    world_size = property(lambda self: int(self.manifest["world_size"]))
    trigger = property(
        lambda self: Trigger.from_dict(self.manifest["trigger"]),
        doc="What fired (forensics.core.trigger.Trigger), read from the checked manifest.",
    )
    recipe = property(lambda self: self.manifest.get("recipe") or {})
    precision = property(lambda self: self.manifest.get("precision") or {})
    micro_batches_meta = property(lambda self: self.manifest["micro_batches"])
    num_micro_batches = property(lambda self: len(self.manifest["micro_batches"]))

    def sample_ids(self, index: int) -> list:
        return list(self.micro_batches_meta[index].get("sample_ids") or [])

    # -- checked file access -----------------------------------------------------------------
    def _listed(self, name: str) -> tuple[Location, int, str]:
        """The path, size and sha256 of a file the manifest lists, after `lstat` shows a regular file of
        that size inside the dump (no link, no device): nothing is read yet."""
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise DumpCorruptError(f"{name} is not listed in {self.path / spec.MANIFEST}", name)
        if name in self.set_aside:
            raise DumpCorruptError(f"{self.path / name} was set aside: {self.set_aside[name]}", name)
        path = self.path / name
        try:
            info = lstat(path)
        except FileNotFoundError:
            raise DumpCorruptError(f"{path} is missing (listed in the manifest)", name) from None
        if not stat.S_ISREG(info.st_mode):
            raise DumpCorruptError(
                f"{path} is not a regular file (a link, directory or device); a dump holds only plain files", name
            )
        if info.st_size != entry["size"]:
            raise DumpCorruptError(
                f"{path} is {info.st_size} bytes but the manifest says {entry['size']}: "
                "the file is truncated or was changed",
                name,
            )
        if name.endswith(".json") and info.st_size > MAX_JSON_FILE:  # refused before a byte is hashed
            raise DumpCorruptError(
                f"{path} is {info.st_size} bytes, more than the {MAX_JSON_FILE} a JSON file may have", name
            )
        return path, entry["size"], entry["sha256"]

    def check_listed(self, name: str) -> None:
        """A listed file is a regular file of its listed size inside the dump (one lstat; nothing is read).

        Raises:
            DumpCorruptError: it is missing, set aside, not a regular file, or of another size.
        """
        self._listed(name)

    def verify_file(self, name: str) -> Location:
        """Checks a listed file's size and sha256 without holding it in memory; returns its path. A large file
        with per-chunk digests (manifest `chunks`) is verified on many threads at once (hashlib releases
        the GIL), at multi-core hash speed instead of one core's."""
        path, size, sha256 = self._listed(name)
        if name in self._verified:
            return self._read_path(name, path)
        if self._in_chunks(name):
            verifier = self._chunk_verifier(name)
            verifier.wait_all()
            if verifier.cache is not None and name not in self._handles:  # no reader follows: hold nothing
                verifier.cache.clear()
            ok, path = True, self._read_path(name, path)
        else:
            digest, seen = hashlib.sha256(), 0
            with open_read(path) as handle:
                while chunk := handle.read(HASH_CHUNK):
                    digest.update(chunk)
                    seen += len(chunk)
            ok = seen == size and digest.hexdigest() == sha256
        if not ok:
            raise DumpCorruptError(
                f"{path} does not match its sha256 in the manifest: the file was changed or corrupted", name
            )
        self._verified.add(name)
        return path

    def start_verifying(self, names) -> None:
        """Starts the background chunk checks of the listed files among `names` that have chunk digests (in object
        storage: their fetch into verified local copies, every file), so they run concurrently on every core
        (verify_file then waits for its own); one that cannot be opened waits for verify_file to say why."""
        for name in names:
            if name not in self._verified and name in self.manifest["files"] and self._in_chunks(name):
                with contextlib.suppress(DumpCorruptError):
                    self._chunk_verifier(name)

    def prefetch(self) -> None:
        """Object storage: starts fetching every listed file into its verified local copy now (a replay reads them
        all, and its report waits for every one to match), in the order the replay needs them: the files it reads
        whole before the load (JSON, micro-batches, RNG; smallest first), then the state's tensor files, the
        optimizer state last. FETCH_THREADS GETs at once (forensics.format.spool). On disk: nothing to do."""
        if self._spool is None:
            return
        files = self.manifest["files"]

        def order(name: str) -> tuple[bool, bool, int]:
            optimizer = name.endswith(spec.OPTIMIZER_TENSORS)
            return bool(files[name].get("chunks")), optimizer, int(files[name]["size"])

        self.start_verifying(sorted((name for name in files if name not in self.set_aside), key=order))

    def _in_chunks(self, name: str) -> bool:
        """Verified chunk by chunk while it is read: a file with chunk digests, and every file in object storage
        (fetched into its local copy: forensics.format.spool)."""
        return self._spool is not None or bool(self.manifest["files"].get(name, {}).get("chunks"))

    def _chunk_verifier(self, name: str) -> ChunkVerifier | SpooledFile:
        """The background verification of a listed file (started on first use). In object storage, the file's fetch
        into a verified local copy; a large tensor file with no room for one, ranged reads verified chunk by chunk
        (a file without chunk digests is one chunk)."""
        with self._open_lock:  # one copy of a file, whichever thread asks first
            return self._start_verifier(name)

    def _start_verifier(self, name: str) -> ChunkVerifier | SpooledFile:
        if name not in self._verifiers:
            path, size, sha256 = self._listed(name)
            entry = self.manifest["files"][name]
            chunk_size, digests = int(entry.get("chunk_size") or max(size, 1)), entry.get("chunks") or [sha256]
            local = None
            if self._spool is not None and isinstance(path, RemotePath):
                ranged = bool(entry.get("chunks")) and name.endswith(".safetensors")
                local = self._spool.admit(name, size, required=not ranged)
            if local is not None:
                assert self._spool is not None and isinstance(path, RemotePath)
                self._verifiers[name] = SpooledFile(path, name, size, chunk_size, digests, local, self._spool)
            else:
                self._verifiers[name] = ChunkVerifier(path, name, size, chunk_size, digests)
        return self._verifiers[name]

    def _read_path(self, name: str, path: Location) -> Location:
        """Where a verified file is read: its local copy when it has one (object storage), else where it lies."""
        verifier = self._verifiers.get(name)
        return verifier.local if isinstance(verifier, SpooledFile) else path

    def close(self) -> None:
        """Ends the background checks and deletes the local copies of a dump in object storage (a later read fetches
        again). Reading a dump on disk holds nothing to release."""
        if self._spool is None:
            return
        with self._open_lock:
            for handle in self._handles.values():
                handle.close()
            for verifier in self._verifiers.values():
                verifier.close()
            self._handles.clear()
            self._verifiers.clear()
            self._verified.clear()
            self._spool.close()

    def _range_check(self, name: str) -> Callable[[int, int], None] | None:
        """For reading a listed file while it is verified: a function that returns once a byte range is verified
        (None: the file is verified already, now, in full, as a file without chunk digests is)."""
        if name in self._verified or not self._in_chunks(name):
            self.verify_file(name)
            return None
        verifier = self._chunk_verifier(name)

        def check(begin: int, end: int) -> None:
            verifier.wait(begin, end)
            if verifier.done:
                self._verified.add(name)

        return check

    def read_file(self, name: str, limit: int = MAX_JSON_FILE) -> bytes:
        """The bytes of a listed file of at most `limit` bytes, after checking its size and sha256."""
        path, size, sha256 = self._listed(name)
        if size > limit:
            raise DumpCorruptError(f"{path} is {size} bytes, more than the {limit} such a file may have", name)
        if self._spool is not None:  # object storage: the verified local copy
            return self.verify_file(name).read_bytes()
        data, chunks = path.read_bytes(), self.manifest["files"][name].get("chunks")
        if chunks:  # every chunk checked: the manifest's check tied `sha256` to them (format version 3)
            matches = chunk_digests(data, int(self.manifest["files"][name]["chunk_size"])) == chunks
        else:
            matches = hashlib.sha256(data).hexdigest() == sha256
        if len(data) != size or not matches:
            raise DumpCorruptError(
                f"{path} does not match its sha256 in the manifest: the file was changed or corrupted", name
            )
        self._verified.add(name)
        return data

    def has_file(self, name: str) -> bool:
        """Listed in the manifest and not set aside as damaged."""
        return name in self.manifest["files"] and name not in self.set_aside

    def _json(self, name: str) -> Any:
        try:
            return jsonio.loads(self.read_file(name))
        except ValueError as exc:  # also UnicodeDecodeError, JSONDecodeError, a malformed float tag, limits
            raise DumpCorruptError(f"{self.path / name} {jsonio.refusal(exc)}", name) from exc

    def _json_object(self, name: str, required: tuple[str, ...] = ()) -> dict:
        value = self._json(name)
        if not isinstance(value, dict) or any(key not in value for key in required):
            raise DumpCorruptError(f"{self.path / name} must be a JSON object with {list(required)}", name)
        return value

    def _tensors(self, name: str) -> dict[str, "torch.Tensor"]:
        from forensics.format.tensors import load_safetensors_file  # torch: only when tensors are read

        if self._spool is not None:  # object storage: the local copy, or verified ranged reads without room for one
            handle = self.tensor_file(name)
            return {key: handle.read(key) for key in handle.keys()}
        return load_safetensors_file(self.verify_file(name), name)

    def check_structure(self, name: str) -> None:
        """`verify`: a listed file's size and sha256, then what replay checks of its structure before it trusts it:
        a JSON file parses as a dump's JSON may (no key twice, not nested too deep); a safetensors file's header
        (entries of known dtypes whose byte ranges fit the data, none overlapping); a zstd member decompresses as
        replay reads it (forensics.format.members), keeping no tensor data.

        Raises:
            DumpCorruptError: naming the file and the rule it breaks.
        """
        path = self.verify_file(name)
        if name.endswith(spec.ZSTD_SUFFIX):
            check_member(path, name)
        elif name.endswith(".safetensors"):
            read_entries(path, name)
        elif name.endswith(".json"):
            self._json(name)

    def structure_problems(self) -> list[str]:
        """`inspect`: the safetensors headers of the listed files that break the rules replay and verify apply
        (headers only: nothing is hashed or decompressed beyond them), worded for people."""
        problems = []
        for name in self.manifest["files"]:
            path = self.path / name
            if not stat.S_ISREG(lstat_mode(path)) or not (
                name.endswith(".safetensors") or name.endswith(spec.ZSTD_SUFFIX)
            ):
                continue
            try:
                if name.endswith(spec.ZSTD_SUFFIX):
                    check_member_header(path, name)
                else:
                    read_entries(path, name)
            except DumpCorruptError as exc:
                problems.append(str(exc))
        return problems

    def size_mismatches(self) -> list[str]:
        """`inspect`: the listed files that are missing, not regular files, or not of their listed size (one lstat
        each, nothing read), worded for people; `verify` checks their contents too."""
        problems = []
        for name, entry in self.manifest["files"].items():
            try:
                info = lstat(self.path / name)
            except OSError:
                problems.append(f"{name} is missing")
                continue
            if not stat.S_ISREG(info.st_mode):
                problems.append(f"{name} is not a regular file")
            elif info.st_size != entry["size"]:
                problems.append(f"{name} has {info.st_size:,} bytes, the manifest lists {entry['size']:,}")
        return problems

    # -- the sharded layout (forensics.format.shards) ---------------------------------------------
    @property
    def sharded(self) -> bool:
        """True when this rank dump holds only its own part of the state (format version 2)."""
        return self.manifest.get("layout") is not None

    def peers(self) -> list["Dump"]:
        """The other rank dumps of this dump's step: beside it, and in `shard_dirs` (one per rank)."""
        found: dict[int, Dump] = {self.rank: self}
        for root in [self.path.parent, *self.shard_dirs]:
            for directory in step_rank_dirs(as_location(root), self.manifest["run_id"], self.step):
                if directory.resolve() != self.path.resolve():
                    dump = Dump(directory, self._archive_tmp)
                    found.setdefault(dump.rank, dump)
        return [found[rank] for rank in sorted(found) if rank != self.rank]

    @cached_property
    def shards(self) -> "ShardedState":
        """The complete state of a sharded dump, read from every rank dump of the step that holds a part.

        Raises:
            DumpIncompleteError: some tensor has parts no rank dump found holds (names them and the ranks).
        """
        from forensics.format.shards import ShardedState, ShardIndex

        index = ShardIndex([self, *self.peers()])
        index.require_complete(self.world_size)
        return ShardedState(index)

    # -- loaders -----------------------------------------------------------------------------
    @property
    def state_missing(self) -> str | None:
        """Why this dump holds no pre-step state (a step that raised and left the device unusable), or None."""
        return self.manifest.get("state_missing")

    @property
    def snapshot_step(self) -> int | None:
        """The step of the Guard's host snapshot this dump holds (spec.SNAPSHOT_STATE), or None."""
        snapshot = self.manifest.get("snapshot")
        return int(snapshot["step"]) if snapshot and self.has_file(spec.SNAPSHOT_STATE.model) else None

    def _sharded_state(self, files: spec.StateFiles) -> bool:
        return self.sharded and files == spec.PRE_STEP_STATE  # a snapshot is only written in the full layout

    def model_state(self, files: spec.StateFiles = spec.PRE_STEP_STATE) -> dict[str, torch.Tensor]:
        """The weights of the pre-step state (or of `files`: spec.SNAPSHOT_STATE), all at once."""
        return dict(self.iter_model_tensors(files=files)) if self._sharded_state(files) else self._tensors(files.model)

    def iter_model_tensors(
        self,
        device: str | "torch.device" = "cpu",
        files: spec.StateFiles = spec.PRE_STEP_STATE,
        names: "set[str] | None" = None,
    ) -> Iterator[tuple[str, "torch.Tensor"]]:
        """The pre-step weights one tensor at a time (only `names`, when given), read with pread straight onto
        `device` in file order, each handed on once the chunks holding it are verified: the host never holds the
        whole state. A sharded dump assembles each tensor from the rank dumps that hold its parts."""
        if self._sharded_state(files):
            yield from self.shards.iter_tensors(files.model, str(device), names)
            return
        handle = self.tensor_file(files.model)  # verified chunk by chunk while it is read
        for key in handle.keys_in_file_order():
            if names is None or key in names:
                yield key, handle.read(key, device)

    def optimizer_meta(self, files: spec.StateFiles = spec.PRE_STEP_STATE) -> dict | None:
        """Class, param groups and the non-tensor state of the optimizer (`optimizer.json`; no tensor is read),
        or None when the dump has no optimizer state."""
        if not self.has_file(files.optimizer_json):
            return None
        meta = self._json_object(files.optimizer_json, ("class", "param_groups"))
        raw_state = meta.get("state") or {}
        if (
            not isinstance(raw_state, dict)
            or not all(isinstance(v, dict) for v in raw_state.values())
            or not isinstance(meta["class"], str)
            or not isinstance(meta["param_groups"], list)
            or not all(
                isinstance(g, dict)
                and isinstance(g.get("params", []), list)
                and all(isinstance(p, str) for p in g.get("params", []))
                for g in meta["param_groups"]
            )
        ):
            raise DumpCorruptError(
                f"{self.path / files.optimizer_json} does not have the documented layout "
                "(class: str, param_groups: [{..., params: [...]}], state: {name: {...}})",
                files.optimizer_json,
            )
        for index, group in enumerate(meta["param_groups"]):
            lr = group.get("lr", 0.0)
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr < float("inf"):
                raise DumpCorruptError(
                    f"{self.path / files.optimizer_json}: param group {index}'s learning rate is "
                    f"{cut_text(repr(lr), 60)}, not a finite number >= 0: the file was edited (or the "
                    "job's scheduler made it so, which is then the cause to fix)",
                    files.optimizer_json,
                )
        return {
            "class": meta["class"],
            "param_groups": meta["param_groups"],
            "state": {name: dict(values) for name, values in raw_state.items()},
        }

    def _optimizer_index(self, files: spec.StateFiles) -> dict[str, dict[str, tuple[str, list[int]]]]:
        """{param name: {state key: (tensor key in optimizer.safetensors, shape)}}, from the verified file's
        header (or a sharded dump's table): nothing but the header is read."""
        if files in self._optimizer_indexes:
            return self._optimizer_indexes[files]
        name = files.optimizer_tensors
        if not self.has_file(name):
            return {}
        if self._sharded_state(files):
            shapes = {key: row["shape"] for key, row in self.manifest["layout"]["tensors"].get(name, {}).items()}
        else:  # the header only: the rest of the file is verified in the background, read when a parameter is
            handle = self.tensor_file(name)
            shapes = {key: handle.shape(key) for key in handle.keys()}
        index: dict[str, dict[str, tuple[str, list[int]]]] = {}
        for key, shape in shapes.items():
            parts = key.split("/", 1)
            if len(parts) != 2 or "/" not in parts[1]:
                raise DumpCorruptError(f"{name} key {cut_text(repr(key), 80)} is not 'state/<param name>/<key>'", name)
            param, entry = parts[1].rsplit("/", 1)
            index.setdefault(param, {})[entry] = (key, shape)
        self._optimizer_indexes[files] = index
        return index

    def optimizer_shapes(self, files: spec.StateFiles = spec.PRE_STEP_STATE) -> dict[str, dict[str, list[int]]]:
        """{param name: {state key: shape}} of the optimizer's tensor state, without reading any tensor."""
        return {
            name: {k: shape for k, (_, shape) in entries.items()}
            for name, entries in self._optimizer_index(files).items()
        }

    def optimizer_tensors(
        self, name: str, device: str | "torch.device" = "cpu", files: spec.StateFiles = spec.PRE_STEP_STATE
    ) -> dict[str, "torch.Tensor"]:
        """The tensor state of ONE parameter (`{"exp_avg": ..., ...}`), read with pread (or
        assembled from a sharded dump's ranks) onto `device`: replay holds one parameter's state at a time."""
        entries = self._optimizer_index(files).get(name, {})
        if not entries:
            return {}
        if self._sharded_state(files):
            return {k: self.shards.tensor(files.optimizer_tensors, key, str(device)) for k, (key, _) in entries.items()}
        handle = self.tensor_file(files.optimizer_tensors)
        return {k: handle.read(key, device) for k, (key, _) in entries.items()}

    def tensor_file(self, name: str) -> Any:
        """A forensics.format.tensors.SafetensorsFile on a listed file, kept open for later reads. A large file is
        verified while it is read: its header and each tensor only once the chunks holding them matched."""
        from forensics.format.tensors import SafetensorsFile

        with self._open_lock:  # the replay reads optimizer state ahead on another thread
            if name not in self._handles:
                check = self._range_check(name)
                verifier = self._verifiers.get(name)
                if isinstance(verifier, SpooledFile):  # the local copy, each range read once it arrived and matched
                    if check is not None:
                        check(0, min(verifier.size, 8))  # the header's size, read before the header is parsed
                    self._handles[name] = SafetensorsFile(verifier.local, name, check, verify_first=True)
                else:
                    cache = verifier.cache if verifier is not None else None
                    self._handles[name] = SafetensorsFile(self._listed(name)[0], name, check, cache)
            return self._handles[name]

    def optimizer_state(self, files: spec.StateFiles = spec.PRE_STEP_STATE) -> dict | None:
        """The whole optimizer state at once (`{"class", "param_groups", "state": {name: {key: value}}}`); replay
        reads it parameter by parameter instead (optimizer_meta / optimizer_tensors)."""
        meta = self.optimizer_meta(files)
        if meta is None:
            return None
        state = meta["state"]
        for name in self._optimizer_index(files):
            state.setdefault(name, {}).update(self.optimizer_tensors(name, files=files))
        return meta

    def scheduler_state(self) -> dict | None:
        return self._json_object(spec.SCHEDULER) if self.has_file(spec.SCHEDULER) else None

    def scaler_state(self) -> dict | None:
        return self._json_object(spec.SCALER) if self.has_file(spec.SCALER) else None

    @cached_property
    def _rng(self) -> tuple[list, dict[str, torch.Tensor]]:
        meta = self._json_object(spec.RNG_JSON, ("micro_batches",))["micro_batches"]
        if (
            not isinstance(meta, list)
            or len(meta) != self.num_micro_batches
            or not all(isinstance(m, dict) for m in meta)
        ):
            raise DumpCorruptError(
                f"{self.path / spec.RNG_JSON}: 'micro_batches' must list one object per "
                f"micro-batch ({self.num_micro_batches})",
                spec.RNG_JSON,
            )
        return meta, self._tensors(spec.RNG_TENSORS)

    def rng_state(self, index: int) -> "RngState":
        from forensics.core.rng import RngState

        meta, tensors = self._rng
        try:
            return RngState.from_parts(meta[index], tensors, f"mb{index}")
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, OverflowError) as exc:
            raise DumpCorruptError(
                f"{self.path / spec.RNG_JSON}: the RNG state of micro-batch {index + 1} is "
                f"malformed ({type(exc).__name__}: {cut_text(exc, 120)})",
                spec.RNG_JSON,
            ) from exc

    def micro_batch(self, index: int) -> Any:
        if not 0 <= index < self.num_micro_batches:
            raise IndexError(f"micro-batch {index} does not exist; this dump has {self.num_micro_batches}")
        from forensics.format.tensors import tensors_in
        from forensics.format.batch_tree import decode_tree

        name = spec.batch_tensors_name(index)
        buffer, entries = read_tensor_member(self.verify_file(name), name)
        tensors = tensors_in(buffer, entries, name)
        name = spec.batch_json_name(index)
        try:
            skeleton = jsonio.loads(read_json_member(self.verify_file(name), name))
        except ValueError as exc:
            raise DumpCorruptError(f"{self.path / name} {jsonio.refusal(exc)}", name) from exc
        return decode_tree(skeleton, tensors)

    def window(self) -> list[dict]:
        """The flight recorder (docs/DUMP_FORMAT.md): per recorded step before this one, oldest first,
        `{"step", "sample_ids": [per micro-batch], "rng": [RngState per micro-batch], "lr", "loss_scale",
        "divisor", "loss", "grad_norm", "clipped"}`; [] when the dump has none."""
        from forensics.core.rng import RngState

        if not self.has_file(spec.WINDOW_JSON):
            return []
        rows = self._json_object(spec.WINDOW_JSON, ("steps",))["steps"]
        tensors = self._tensors(spec.WINDOW_RNG) if self.has_file(spec.WINDOW_RNG) else {}
        out = []
        try:
            for row in rows:
                step = int(row["step"])
                ids, rngs = list(row["sample_ids"]), list(row["rng"])
                if len(ids) != len(rngs) or not all(i is None or isinstance(i, list) for i in ids):
                    raise ValueError("sample_ids and rng must list one entry per micro-batch")
                states = [RngState.from_parts(meta, tensors, f"s{step}/mb{i}") for i, meta in enumerate(rngs)]
                out.append({**row, "step": step, "sample_ids": ids, "rng": states})
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, OverflowError) as exc:
            raise DumpCorruptError(
                f"{self.path / spec.WINDOW_JSON} does not have the documented layout "
                f"({type(exc).__name__}: {cut_text(exc, 120)})",
                spec.WINDOW_JSON,
            ) from exc
        return out

    def precursors(self) -> dict | None:
        """The precursor monitor's table (docs/DUMP_FORMAT.md `precursors.json`): `{"columns": [{"layer",
        "statistic"}], "steps": [int], "values": [[float | None per column] per step], "firings": [...],
        "config": {...}}`, every value checked once (forensics/format/records.py); None when the dump has none. Layer
        names are untrusted text."""
        if not self.has_file(spec.PRECURSORS):
            return None
        try:
            return checked_precursors(self._json_object(spec.PRECURSORS, ("columns", "steps", "values")))
        except ValueError as exc:
            raise DumpCorruptError(
                f"{self.path / spec.PRECURSORS} does not have the documented layout ({cut_text(exc, 160)})",
                spec.PRECURSORS,
            ) from exc

    def silent(self) -> dict | None:
        """A silent-corruption dump's evidence (docs/DUMP_FORMAT.md `silent.json`), its computations checked
        (forensics/core/silent.py, `Computation.from_dict`); None when the dump has none. Names are untrusted text."""
        if not self.has_file(spec.SILENT):
            return None
        from forensics.core.silent import Computation  # torch: only when a silent dump is read

        value = self._json_object(spec.SILENT, ("check", "step", "rank"))
        try:
            for key in ("job", "recompute"):
                if key in value:
                    value[key] = Computation.from_dict(value[key])
            cross = value.get("cross_rank")
            if cross is not None:
                cross["reference"] = Computation.from_dict(cross["reference"])
                cross["this_rank"] = Computation.from_dict(cross["this_rank"])
            seeds = value.get("seeds") or []
            if not isinstance(seeds, list) or not all(isinstance(x, (int, float)) for x in seeds):
                raise ValueError("seeds must be numbers")
        except (KeyError, TypeError, ValueError) as exc:
            raise DumpCorruptError(
                f"{self.path / spec.SILENT} does not have the documented layout ({cut_text(exc, 160)})", spec.SILENT
            ) from exc
        return value

    def history(self) -> dict:
        """The loss history (docs/DUMP_FORMAT.md `history.json`), every value checked (forensics/format/records.py)."""
        try:
            return checked_history(self._json_object(spec.HISTORY))
        except ValueError as exc:
            raise DumpCorruptError(f"{self.path / spec.HISTORY}: {cut_text(exc, 160)}", spec.HISTORY) from exc

    def total_size(self) -> int:
        return sum(int(entry.get("size", 0)) for entry in self.manifest["files"].values())


def resolve(path: str | os.PathLike[str] | Location, limits: ArchiveLimits | None = None) -> tuple[Location, Any]:
    """Returns a directory for `path` (a local path or an fsspec URL; a .tar.zst is unpacked into a local temp dir)
    and the temp dir holder."""

    path = as_location(path)
    if path.name == spec.MANIFEST and path.is_file():
        path = path.parent  # the user pointed at the manifest itself
    if not path.exists():
        raise DumpNotFoundError(f"{path} does not exist. Pass a dump directory or a {spec.ARCHIVE_SUFFIX} file.")
    if path.is_file():
        return unpack_archive(path, limits)
    return path, None


def open_dump(
    path: str | os.PathLike[str] | Location,
    rank: int | None = None,
    limits: ArchiveLimits | None = None,
    shard_dirs: Sequence[str | os.PathLike[str] | Location] = (),
) -> Dump:
    """Opens a rank dump, a step directory (choose `rank`), or a packed `.tar.zst` of either.

    Args:
        path: the dump: a directory, a `.tar.zst`, or an fsspec URL of either (s3://bucket/run/step-000000042).
            Nothing is imported, unpickled or executed.
        rank: for a step directory holding several ranks: which one. Default: the rank that saw the
            fault first-hand (manifest trigger.local), else the lowest rank present.
        limits: what unpacking an archive may produce (default ArchiveLimits()).
        shard_dirs: a sharded dump (each rank wrote its own part of the state): directories of other nodes
            holding rank dumps of the same step (their dump_dir, run or step directory).
    Returns:
        Dump, whose manifest is read and validated; weights are read only when asked.
    Example:
        >>> dump = open_dump("crash_dumps/run/step-000000042")  # doctest: +SKIP
        >>> dump.trigger.kind  # doctest: +SKIP
        <TriggerKind.NONFINITE_LOSS: 'nonfinite_loss'>
    """
    return prefetch.claim(path, rank, limits, shard_dirs) or open_unclaimed(path, rank, limits, shard_dirs)


def start_fetching(
    path: str | os.PathLike[str] | Location,
    rank: int | None = None,
    limits: ArchiveLimits | None = None,
    shard_dirs: Sequence[str | os.PathLike[str] | Location] = (),
) -> None:
    """Opens the dump at `path` as `open_dump(path, rank, limits, shard_dirs)` would and starts fetching every file it
    lists (Dump.prefetch), on a thread; returns at once. The next open_dump with the same arguments takes that Dump
    (forensics.format.prefetch). For a dump in object storage, before a replay's slow imports."""

    def open_and_fetch() -> Dump:
        dump = open_unclaimed(path, rank, limits, shard_dirs)
        with contextlib.suppress(ForensicsError, OSError):  # a file the replay then reads says it again
            dump.prefetch()
        return dump

    prefetch.start(path, rank, limits, shard_dirs, open_and_fetch)


def open_unclaimed(
    path: str | os.PathLike[str] | Location,
    rank: int | None = None,
    limits: ArchiveLimits | None = None,
    shard_dirs: Sequence[str | os.PathLike[str] | Location] = (),
) -> Dump:
    """open_dump, never taking a Dump that forensics.format.prefetch opened already (which calls it)."""
    dirs = [as_location(d) for d in shard_dirs]
    try:
        dump = _choose_dump(path, rank, limits)
    except NotADumpError:
        found = _rank_elsewhere(path, rank, limits, dirs)
        if found is None:
            raise
        dump, here = found
        dirs.insert(0, here)  # the ranks of the directory the user named are peers too
    dump.shard_dirs = dirs
    return dump


def _rank_elsewhere(
    path: str | os.PathLike[str] | Location, rank: int | None, limits: ArchiveLimits | None, shard_dirs: list[Location]
) -> tuple[Dump, Location] | None:
    """`rank`'s dump in another node's directory (`shard_dirs`), for a step directory that lacks it, and the
    step directory the user named."""
    if rank is None or not shard_dirs:
        return None
    here = _choose_dump(path, None, limits)
    for root in shard_dirs:
        for directory in step_rank_dirs(root, here.manifest["run_id"], here.step):
            if int(read_manifest(directory)["rank"]) == rank:
                return Dump(directory), here.path.parent
    return None


def _choose_dump(path: str | os.PathLike[str] | Location, rank: int | None, limits: ArchiveLimits | None) -> Dump:
    directory, holder = resolve(path, limits)
    if is_rank_dump(directory):
        if rank is not None and int(read_manifest(directory)["rank"]) != rank:
            raise NotADumpError(f"{directory} is the dump of another rank; pass its step directory to pick rank {rank}")
        return Dump(directory, holder)
    ranks = rank_dirs(directory)
    complete = [r for r in ranks if is_rank_dump(r)]
    if not complete:
        if spec.rank_of_dir_name(directory.name) is not None and not ranks:
            read_manifest(directory)  # a rank's directory without its manifest: says the writer died mid-write
        steps = sorted(p.name for p in directory.glob("step-*"))
        if steps:
            raise NotADumpError(
                f"{directory} is a run directory holding dumps for {', '.join(steps)}; pass one of them"
            )
        if ranks:
            raise NotADumpError(
                f"{directory} holds no complete rank dump ({len(ranks)} without a manifest: "
                "the writer died before finishing)"
            )
        raise NotADumpError(f"{directory} is not a forensics dump (no {spec.MANIFEST}, no rank-* directories)")
    dumps = [Dump(r, holder) for r in complete]
    if rank is not None:
        for dump in dumps:
            if dump.rank == rank:
                return dump
        raise NotADumpError(f"{directory} has no dump for rank {rank}; present: {[d.rank for d in dumps]}")
    local = [d for d in dumps if d.trigger.local]
    return (local or dumps)[0]


def open_step(
    path: str | os.PathLike[str] | Location, limits: ArchiveLimits | None = None
) -> tuple[list[Dump], list[int]]:
    """All rank dumps of a step directory (or the one of a rank directory) and the ranks missing."""
    directory, holder = resolve(path, limits)
    if is_rank_dump(directory):
        dumps = [Dump(directory, holder)]
    else:
        dumps = [Dump(r, holder) for r in rank_dirs(directory) if is_rank_dump(r)]
        if not dumps:
            open_dump(directory)  # raises the precise error
    _check_same_step(dumps)
    world = dumps[0].world_size
    present = {d.rank for d in dumps}
    missing = [] if is_rank_dump(directory) else sorted(set(range(world)) - present)
    return dumps, missing


def _check_same_step(dumps: list[Dump]) -> None:
    """The rank dumps of one step directory agree on the run, the step and the world size: a rank dump copied in
    from another run or step would be counted, verified and replayed as this step's.

    Raises:
        DumpCorruptError: naming the field and the ranks that disagree.
    """
    for field in ("run_id", "step", "world_size"):
        values: dict = {}
        for dump in dumps:
            values.setdefault(dump.manifest[field], []).append(dump.rank)
        if len(values) > 1:
            shown = "; ".join(f"{field} {value!r} in rank(s) {ranks}" for value, ranks in list(values.items())[:4])
            raise DumpCorruptError(
                f"{dumps[0].path.parent}: its rank dumps are not of one step ({shown}): a rank "
                "dump was copied in from another run or step; pass the rank directory you mean",
                spec.MANIFEST,
            )
