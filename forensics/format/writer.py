"""Writes one rank dump atomically: every file checksummed, manifest last, directory renamed into place."""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import zstandard

from forensics.core.errors import CaptureError, StorageError
from forensics.core.fsio import fsync_dir
from forensics.format import jsonio, spec, threads
from forensics.format.shards import LocalShard, ShardCopies, shard_entry
from forensics.format.location import Location, RemotePath, as_location, open_write, remove_tree
from forensics.format.stale import remove_stale_temporaries, temporary_name
from forensics.format.digest import HashingWriter
from forensics.format.members import tensor_member_problem
from forensics.format.tensors import safetensors_bytes, tensor_bytes, write_safetensors
from forensics.format.batch_tree import encode_tree
from forensics.format.writeback import EarlyWriteback
from forensics.format import direct_io
from forensics.core.rng import RngState

log = logging.getLogger(__name__)

ZSTD_LEVEL = 3
CONCURRENT_WRITE_MIN = 64 << 20  # below 64 MB of weights, a second writer thread is not worth starting
WATCH_PIECE = 8 << 20  # a watched remote write says it progressed at least every 8 MiB it hands to the store
WRITE_BUFFER = 1 << 20  # small tensors are gathered into one write; a larger one goes straight to the kernel (a
# 16 MiB buffer copied every tensor of up to 16 MiB once more on its way: a whole extra pass over a GPT-2 or Llama
# state, 0.6 s per GiB on the 2-core dev machine when busy)


@dataclass
class DumpContent:
    """Everything one rank dump holds, already detached from the job (CPU tensors or pinned copies)."""

    manifest: dict  # trigger, step, rank, world_size, ... (not format/version/files: the writer adds them)
    model: dict[str, Any]  # name -> tensor, or LocalShard (sharded layout: this rank's part of it)
    rng: list[RngState]  # one per micro-batch, taken right before its forward
    micro_batches: list[Any]
    history: dict
    optimizer: dict | None = None  # {"class", "param_groups": [{..., "params": [names]}], "state": {name: {k: v}}}
    scheduler: dict | None = None
    scaler: dict | None = None
    extra_files: dict[str, bytes] = field(default_factory=dict)
    ready: Callable[[], None] | None = None  # blocks until asynchronous device->host copies have landed
    done: Callable[[], None] | None = None  # called once the write is over (written or not)
    snapshot: dict | None = None
    """The Guard's host snapshot of an earlier step (GuardConfig.recording.snapshot_every): `{"step", "model", "optimizer"}`
    in the full layout, written as spec.SNAPSHOT_STATE."""
    layout: dict | None = None
    """Sharded layout (forensics.format.shards): `{file: {name: {"shape", "dtype"}}}`, every tensor of the
    complete state; this rank's model / optimizer hold only the parts it owns. None: the full state."""
    copies: list[ShardCopies] = field(default_factory=list)
    """Sharded layout: other ranks' sole shards this rank writes too (GuardConfig.dumping.shard_replicas,
    capture/state/buddy.py), as spec.copy_file_name files listed in the manifest's `layout.copies`."""


class Watch(Protocol):
    """Told of each piece a remote write sends (the Guard's stall deadline: capture/dumping/deadline.py); raises to
    stop the write, which then removes what it wrote."""

    def progress(self) -> None: ...


class _Watched:
    """A remote file handle that tells `watch` of every piece sent, a large write cut into WATCH_PIECE pieces so that
    a slow but moving upload keeps saying so."""

    def __init__(self, handle: Any, watch: Watch):
        self.handle, self.watch = handle, watch

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WATCH_PIECE):
            self.watch.progress()
            self.handle.write(view[start : start + WATCH_PIECE])
        self.watch.progress()
        return len(view)


class _DumpDir:
    """The directory being filled (a temporary one on disk; in object storage the rank dump's own prefix), with its
    table of files."""

    def __init__(self, path: Location, watch: Watch | None = None):
        self.path = path
        self.remote = isinstance(path, RemotePath)
        self.watch = watch
        self.files: dict[str, dict] = {}
        self.shards: dict[str, dict] = {}  # file -> {name: where this rank's part sits} (sharded layout)

    def _record(self, name: str, out: HashingWriter, handle) -> None:
        handle.flush()
        if not self.remote:  # an object is whole once its upload completes, when the handle closes
            os.fsync(handle.fileno())
        self.files[name] = {"size": out.size, "sha256": out.hexdigest()}
        chunks = out.chunk_digests()
        if chunks:
            self.files[name].update(chunk_size=out.chunk_bytes, chunks=chunks)

    def _sink(self, handle: Any) -> Any:
        """Where the bytes of a file go: the handle, watched when a watch is set (remote writes)."""
        if self.watch is None:
            return handle
        self.watch.progress()
        return _Watched(handle, self.watch)

    def write_bytes(self, name: str, data: bytes) -> None:
        with open_write(self.path / name) as handle:
            out = HashingWriter(self._sink(handle))
            out.write(data)
            self._record(name, out, handle)

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, jsonio.dumps(obj))

    def write_tensors(self, name: str, values: dict[str, Any]) -> None:
        """Writes tensors (or LocalShards: their data) as safetensors, noting where each part sits."""
        tensors, shards = {}, {}
        for key, value in values.items():
            tensors[key], shards[key] = shard_entry(value)
        if isinstance(self.path, RemotePath):  # streamed to the store in parts as it is hashed; no local copy
            with open_write(self.path / name) as handle:
                out = HashingWriter(self._sink(handle))
                write_safetensors(out, tensors)
                self._record(name, out, handle)
        else:
            big = sum(map(tensor_bytes, tensors.values())) >= direct_io.MIN_BYTES
            direct = direct_io.open_direct(self.path / name) if big else None
            if direct is not None:  # no page cache between the state and the disk (forensics/format/direct_io.py)
                with direct:
                    out = HashingWriter(direct)
                    write_safetensors(out, tensors)
                    self._record(name, out, direct)
            else:
                with open(self.path / name, "wb", buffering=WRITE_BUFFER) as handle:
                    with EarlyWriteback(handle) as early:
                        out = HashingWriter(early)
                        write_safetensors(out, tensors)
                    self._record(name, out, handle)
        self.shards[name] = shards


def _optimizer_parts(optimizer: dict) -> tuple[dict, dict[str, torch.Tensor | LocalShard]]:
    tensors: dict[str, torch.Tensor | LocalShard] = {}
    scalar_state: dict[str, dict] = {}
    for name, entries in optimizer["state"].items():
        scalar_state[name] = {}
        for key, value in entries.items():
            if isinstance(value, (torch.Tensor, LocalShard)):
                tensors[f"state/{name}/{key}"] = value
            else:
                scalar_state[name][key] = value
    meta = {"class": optimizer["class"], "param_groups": optimizer["param_groups"], "state": scalar_state}
    return meta, tensors


def _write_contents(target: _DumpDir, content: DumpContent) -> list[list[dict]]:
    _write_state(target, spec.PRE_STEP_STATE, content.model, content.optimizer)
    if content.snapshot is not None:
        _write_state(target, spec.SNAPSHOT_STATE, content.snapshot["model"], content.snapshot["optimizer"])
    if content.scheduler is not None:
        target.write_json(spec.SCHEDULER, content.scheduler)
    if content.scaler is not None:
        target.write_json(spec.SCALER, content.scaler)
    rng_meta, rng_tensors = [], {}
    for index, state in enumerate(content.rng):
        meta, tensors = state.to_parts(f"mb{index}")
        rng_meta.append(meta)
        rng_tensors.update(tensors)
    target.write_json(spec.RNG_JSON, {"micro_batches": rng_meta})
    target.write_tensors(spec.RNG_TENSORS, rng_tensors)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    unreplayable = []
    for index, batch in enumerate(content.micro_batches):
        encoded = encode_tree(batch)
        for leaf in encoded.unreplayable:
            log.warning(
                "forensics: micro-batch %d leaf %s of type %s cannot be stored; it is recorded as unreplayable",
                index + 1,
                leaf["path"],
                leaf["type"],
            )  # words count from 1
        unreplayable.append(encoded.unreplayable)
        target.write_bytes(spec.batch_tensors_name(index), _tensor_member(compressor, encoded.tensors, index))
        target.write_bytes(spec.batch_json_name(index), compressor.compress(jsonio.dumps(encoded.skeleton)))
    target.write_json(spec.HISTORY, content.history)
    for name, data in content.extra_files.items():
        target.write_bytes(name, data)
    return unreplayable


def _tensor_member(compressor: zstandard.ZstdCompressor, tensors: dict, index: int) -> bytes:
    """A micro-batch's tensors as the zstd member its reader accepts: checked by the reader's own rule
    (members.tensor_member_problem) on the sizes the frame declares and the safetensors header accounts for."""
    raw = safetensors_bytes(tensors)
    blob = compressor.compress(raw)
    problem = tensor_member_problem(len(raw), zstandard.get_frame_parameters(blob).content_size)
    if problem is not None:
        raise ValueError(f"micro-batch {index + 1}'s tensors {problem}")
    return blob


def _write_state(target: _DumpDir, files: spec.StateFiles, model: dict[str, Any], optimizer: dict | None) -> None:
    """One model + optimizer state; the two big files go to disk concurrently (each hashes while it writes)."""
    from concurrent.futures import ThreadPoolExecutor

    big = (
        sum(t.numel() * t.element_size() for t in map(lambda v: shard_entry(v)[0], model.values()))
        >= CONCURRENT_WRITE_MIN
    )
    with ThreadPoolExecutor(max_workers=2 if big else 1, thread_name_prefix="forensics-write") as pool:
        run = functools.partial(threads.submit, pool) if big else (lambda fn, *args: threads.Done(fn(*args)))
        jobs = [run(target.write_tensors, files.model, model)]
        if optimizer is not None:
            meta, tensors = _optimizer_parts(optimizer)
            jobs.append(run(target.write_tensors, files.optimizer_tensors, tensors))
            target.write_json(files.optimizer_json, meta)
        for job in jobs:
            job.result()


def _write_copies(target: _DumpDir, copies: list[ShardCopies]) -> dict:
    """Other ranks' shards, one file per source rank and state file (two at a time when large); returns the
    manifest's `layout.copies`."""
    from concurrent.futures import ThreadPoolExecutor

    files = [
        (spec.copy_file_name(file, received.source_rank), file, received.source_rank, shards)
        for received in copies
        for file, shards in received.files.items()
    ]
    big = (
        sum(s.tensor.numel() * s.tensor.element_size() for *_, shards in files for s in shards.values())
        >= CONCURRENT_WRITE_MIN
    )
    with ThreadPoolExecutor(max_workers=2 if big else 1, thread_name_prefix="forensics-write") as pool:
        for job in [threads.submit(pool, target.write_tensors, stored, shards) for stored, _, _, shards in files]:
            job.result()
    return {
        stored: {"of": file, "rank": source, "shards": target.shards.pop(stored)} for stored, file, source, _ in files
    }


def dump_path(root: str | os.PathLike | Location, run_id: str, step: int, rank: int) -> Location:
    """Where rank `rank`'s dump of `run_id`'s step goes under `root` (a directory or an fsspec URL)."""
    return as_location(root) / run_id / spec.step_dir_name(step) / spec.rank_dir_name(rank)


def write_dump(content: DumpContent, root: str | os.PathLike | Location, watch: Watch | None = None) -> Location:
    """Writes `content` under `root` (a directory, or an fsspec URL such as s3://bucket/dumps) and returns the rank
    dump's location.

    Args:
        watch: told of each piece a remote write sends; when it raises, the write stops and removes what it wrote
            (the Guard's stall deadline, capture/dumping/deadline.py).
    Raises:
        CaptureError: the location cannot be used or is not writable, the disk is full, or a value cannot be stored.
            Nothing is ever taken for a whole dump that is not: on disk nothing half-written is left under a
            dump's final name; in object storage the manifest is written last and what was written is deleted.
    """
    try:
        return _write_dump(content, root, watch)
    finally:
        if content.done is not None:
            content.done()


def _write_dump(content: DumpContent, root: str | os.PathLike | Location, watch: Watch | None) -> Location:
    if content.ready is not None:
        content.ready()
    manifest = dict(content.manifest)
    try:
        final = dump_path(root, manifest["run_id"], manifest["step"], manifest["rank"])
    except StorageError as exc:  # a URL that cannot be used (the Guard checks its dump_dir when it is built)
        raise CaptureError(f"no dump written: {exc}") from exc
    if isinstance(final, RemotePath):
        return _write_remote(content, manifest, final, watch)
    base = final.parents[2]  # root: <root>/<run>/step-<N>/rank-<R>
    _clean_once(base)
    _remove_own_leftovers(final)
    tmp = final.parent / temporary_name(final.name)
    _WRITING.add(tmp.name)
    try:
        _make_directory(tmp)
        target = _DumpDir(tmp)
        manifest = _fill(target, content, manifest)
        with open(tmp / spec.MANIFEST, "wb") as handle:
            handle.write(jsonio.dumps(manifest))
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():
            raise FileExistsError(errno.EEXIST, "a dump for this run, step and rank already exists", str(final))
        os.rename(tmp, final)
        fsync_dir(final.parent)
        return final
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_if_empty(final.parent, base)
        raise CaptureError(_explain(exc, final)) from exc
    finally:
        _WRITING.discard(tmp.name)


_WRITING: set[str] = set()
"""The temporary directories this process is filling now."""


def _remove_own_leftovers(final: Path) -> None:
    """Deletes a temporary of the same rank dump that carries this host's and this process's pid but that this
    process is not filling: a killed predecessor with the same pid (a restarted container's training process often
    has it), which the stale check takes for alive (forensics.format.stale). Others are left to that check."""
    prefix = temporary_name(final.name).rsplit("-", 1)[0] + "-"
    try:
        leftovers = [p for p in final.parent.iterdir() if p.name.startswith(prefix) and p.name not in _WRITING]
    except OSError:
        return
    for path in leftovers:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            log.warning("forensics: removed %s, an unfinished dump of this rank whose writer is gone", path)


def _write_remote(content: DumpContent, manifest: dict, final: RemotePath, watch: Watch | None) -> RemotePath:
    """Object storage has no rename: every file goes straight under the final prefix, the manifest last, so a
    reader takes the dump for whole only once everything is there. A write that fails deletes what it wrote; a
    writer killed mid-write leaves files without a manifest, which every reader calls incomplete, and which the
    next write under the same prefix deletes before it writes (else an old file the new dump does not list would
    stay beside it: `verify` and `pack` refuse an unlisted file)."""
    try:
        if (final / spec.MANIFEST).exists():
            raise FileExistsError(errno.EEXIST, "a dump for this run, step and rank already exists", str(final))
        _remove_leftovers(final)
        target = _DumpDir(final, watch)
        manifest = _fill(target, content, manifest)
        if watch is not None:
            watch.progress()  # an abandoned write never writes its manifest
        target.write_bytes(spec.MANIFEST, jsonio.dumps(manifest))
        return final
    except Exception as exc:
        if not isinstance(exc, FileExistsError):
            with contextlib.suppress(Exception):
                remove_tree(final)
        raise CaptureError(_explain(exc, final)) from exc


def _remove_leftovers(final: RemotePath) -> None:
    """Deletes what a killed writer left under `final` (files, no manifest): the writer of a rank dump is its rank's
    one process, so anything there before it starts is a dead write's."""
    if any(True for _ in final.iterdir()):
        log.warning("forensics: removing the files an unfinished write left at %s (its writer was killed)", final)
        remove_tree(final)


def _fill(target: _DumpDir, content: DumpContent, manifest: dict) -> dict:
    """Writes every file of the dump but the manifest into `target`; returns the manifest to write last."""
    unreplayable = _write_contents(target, content)
    for meta, leaves in zip(manifest.get("micro_batches", []), unreplayable):
        meta["unreplayable"] = leaves
    if content.layout is not None:
        manifest["layout"] = {
            "kind": spec.SHARDED,
            "tensors": content.layout,
            "shards": {file: target.shards[file] for file in content.layout if file in target.shards},
        }
        if content.copies:
            manifest["layout"]["copies"] = _write_copies(target, content.copies)
    manifest.update(
        {
            "format": spec.FORMAT_NAME,
            "format_version": spec.version_needed(
                sharded=content.layout is not None, chunked=any("chunks" in e for e in target.files.values())
            ),
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": target.files,
        }
    )
    return {"format": manifest.pop("format"), "format_version": manifest.pop("format_version"), **manifest}


def _make_directory(path: Path) -> None:
    """mkdir -p, again when another rank's failed write removed an empty parent between two of its steps."""
    for attempt in range(3):
        try:
            path.mkdir(parents=True)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


def _remove_if_empty(directory: Path, root: Path) -> None:
    """After a failed write: the step (and run) directory made for it, when nothing else is in it, so no empty
    `step-*` directory is left for `list` and `verify` to call "not a forensics dump". rmdir removes only an empty
    directory: another rank's dump or temporary beside it keeps it."""
    while directory != root and root in directory.parents:
        try:
            directory.rmdir()
        except OSError:
            return
        directory = directory.parent


def remove_rank_dump(path: Location) -> None:
    """Deletes the rank dump at `path` (and its packed archive next to it), then its step directory once no rank's
    dump is left in it (another rank still writing there keeps it).

    Raises:
        OSError: the dump could not be deleted.
    """
    path = as_location(path)
    if isinstance(path, RemotePath):
        remove_tree(path)  # an object store has no empty step directory to leave behind
        return
    if path.is_dir():
        shutil.rmtree(path)
    archive = path.with_name(path.name + spec.ARCHIVE_SUFFIX)
    if archive.is_file():
        archive.unlink()
    _remove_if_empty(path.parent, path.parent.parent)


_CLEANED: set[str] = set()


def _clean_once(root: Path) -> None:
    """At the first dump of a process under `root`: remove what killed writers left behind (forensics.format.stale)."""
    key = str(root)
    if key in _CLEANED:
        return
    _CLEANED.add(key)
    for path in remove_stale_temporaries(root):
        log.warning("forensics: removed %s, an unfinished dump whose writer is gone", path)


def _explain(exc: Exception, final: Location) -> str:
    if isinstance(exc, FileExistsError):
        return (
            f"no dump written: {final} already exists: a dump of this run, step and rank (a rerun with the "
            "same run_id?). Give the run a new GuardConfig.run_id or move the old dump away."
        )
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"no dump written to {final}: the disk is full ({exc}). Free space or set dump_dir elsewhere."
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST):
        return f"no dump written to {final}: the directory is not writable ({exc}). Set dump_dir to a writable path."
    if isinstance(exc, OSError):
        return f"no dump written to {final}: {exc}"
    return f"no dump written to {final}: {type(exc).__name__}: {exc}"
