"""Reads dumps lazily and safely: manifest first, each file checked (size, sha256) before it is parsed."""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import zstandard

from forensics.errors import (DumpCorruptError, DumpNotFoundError, NotADumpError,
                              UnsupportedVersionError)
from forensics.format import jsonio, spec
from forensics.format.archive import unpack_archive
from forensics.format.tensors import load_safetensors_bytes
from forensics.format.tree import decode_tree
from forensics.rng import RngState

# zstd frames in a dump are small; this caps what one decompression may produce (1 GiB) so a
# hostile frame header cannot make the reader allocate without bound.
MAX_DECOMPRESSED = 1 << 30


def read_manifest(directory: Path) -> dict:
    """Parses and validates manifest.json of a rank dump directory."""
    path = directory / spec.MANIFEST
    if not path.is_file():
        raise NotADumpError(f"{directory} is not a complete dump: it has no {spec.MANIFEST} "
                            "(the writer may have died before finishing; nothing there can be trusted)")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DumpCorruptError(f"{path} is truncated or not valid JSON ({exc})", spec.MANIFEST) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != spec.FORMAT_NAME:
        raise DumpCorruptError(f"{path} is not a forensics manifest (format != {spec.FORMAT_NAME!r})",
                               spec.MANIFEST)
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise DumpCorruptError(f"{path}: format_version must be an integer, got {version!r}", spec.MANIFEST)
    if version > spec.FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"{directory} is dump format version {version}, but this forensics reads up to version "
            f"{spec.FORMAT_VERSION}. Upgrade forensics (pip install -U forensics) to read it.")
    if version < 1:
        raise DumpCorruptError(f"{path}: format_version {version} does not exist", spec.MANIFEST)
    missing = [key for key in spec.REQUIRED_MANIFEST_KEYS if key not in manifest]
    if missing:
        raise DumpCorruptError(f"{path} lacks required keys {missing}", spec.MANIFEST)
    _check_manifest_types(manifest, path)
    try:
        return jsonio.from_jsonable(manifest)
    except ValueError as exc:
        raise DumpCorruptError(f"{path}: {exc}", spec.MANIFEST) from exc


def _check_manifest_types(manifest: dict, path: Path) -> None:
    """Refuses fields that loaders rely on with the wrong JSON type, and file names that leave the dump."""
    def corrupt(what: str) -> DumpCorruptError:
        return DumpCorruptError(f"{path}: {what}; the manifest was edited or damaged", spec.MANIFEST)

    for key in ("step", "rank", "world_size"):
        value = manifest[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise corrupt(f"'{key}' must be a non-negative integer, got {str(value)[:40]!r}")
    if not isinstance(manifest["trigger"], dict):
        raise corrupt("'trigger' must be an object")
    batches = manifest["micro_batches"]
    if not isinstance(batches, list) or not all(isinstance(b, dict) for b in batches):
        raise corrupt("'micro_batches' must be a list of objects")
    if not isinstance(manifest["files"], dict):
        raise corrupt("'files' must be an object")
    for name, entry in manifest["files"].items():
        if name in ("", ".", "..", spec.MANIFEST) or "/" in name or "\\" in name:
            raise corrupt(f"'files' lists {name[:80]!r}, which is not a plain file name inside the dump")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str)):
            raise corrupt(f"'files' entry for {name} must be {{\"size\": int, \"sha256\": str}}")


def is_rank_dump(path: Path) -> bool:
    return (path / spec.MANIFEST).is_file()


def rank_dirs(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.glob("rank-*") if p.is_dir())


class Dump:
    """One rank dump. Cheap to open: only the manifest is read until a loader is called."""

    def __init__(self, directory: Path, archive_tmp: Any = None):
        self.path = Path(directory)
        self.manifest = read_manifest(self.path)
        self._archive_tmp = archive_tmp  # keeps an unpacked archive's temp dir alive
        self._verified: set[str] = set()

    # -- plain fields ------------------------------------------------------------------------
    step = property(lambda self: int(self.manifest["step"]))
    rank = property(lambda self: int(self.manifest["rank"]))
    world_size = property(lambda self: int(self.manifest["world_size"]))
    trigger = property(lambda self: self.manifest["trigger"])
    recipe = property(lambda self: self.manifest.get("recipe") or {})
    precision = property(lambda self: self.manifest.get("precision") or {})
    micro_batches_meta = property(lambda self: self.manifest["micro_batches"])
    num_micro_batches = property(lambda self: len(self.manifest["micro_batches"]))

    def sample_ids(self, index: int) -> list:
        return list(self.micro_batches_meta[index].get("sample_ids") or [])

    # -- checked file access -----------------------------------------------------------------
    def read_file(self, name: str) -> bytes:
        """Returns the bytes of a listed file after checking its size and sha256."""
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise DumpCorruptError(f"{name} is not listed in {self.path / spec.MANIFEST}", name)
        path = self.path / name
        if not path.is_file():
            raise DumpCorruptError(f"{path} is missing (listed in the manifest)", name)
        data = path.read_bytes()
        _check_entry(name, data, entry, path)
        self._verified.add(name)
        return data

    def has_file(self, name: str) -> bool:
        return name in self.manifest["files"]

    def _json(self, name: str) -> Any:
        try:
            return jsonio.loads(self.read_file(name))
        except ValueError as exc:  # also UnicodeDecodeError, JSONDecodeError, a malformed float tag
            raise DumpCorruptError(f"{self.path / name} is not valid JSON ({exc})", name) from exc

    def _tensors(self, name: str) -> dict[str, torch.Tensor]:
        return load_safetensors_bytes(self.read_file(name), name)

    def _zstd(self, name: str) -> bytes:
        try:
            return zstandard.ZstdDecompressor().decompress(self.read_file(name), max_output_size=MAX_DECOMPRESSED)
        except zstandard.ZstdError as exc:
            raise DumpCorruptError(f"{self.path / name} is not a valid zstd frame ({exc})", name) from exc

    # -- loaders -----------------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        return self._tensors(spec.MODEL)

    def optimizer_state(self) -> dict | None:
        if not self.has_file(spec.OPTIMIZER_JSON):
            return None
        meta = self._json(spec.OPTIMIZER_JSON)
        state: dict[str, dict] = {name: dict(values) for name, values in meta.get("state", {}).items()}
        for key, tensor in self._tensors(spec.OPTIMIZER_TENSORS).items():
            _, name_and_key = key.split("/", 1)
            name, entry = name_and_key.rsplit("/", 1)
            state.setdefault(name, {})[entry] = tensor
        return {"class": meta["class"], "param_groups": meta["param_groups"], "state": state}

    def scheduler_state(self) -> dict | None:
        return self._json(spec.SCHEDULER) if self.has_file(spec.SCHEDULER) else None

    def scaler_state(self) -> dict | None:
        return self._json(spec.SCALER) if self.has_file(spec.SCALER) else None

    @cached_property
    def _rng(self) -> tuple[list, dict[str, torch.Tensor]]:
        return self._json(spec.RNG_JSON)["micro_batches"], self._tensors(spec.RNG_TENSORS)

    def rng_state(self, index: int) -> RngState:
        meta, tensors = self._rng
        return RngState.from_parts(meta[index], tensors, f"mb{index}")

    def micro_batch(self, index: int) -> Any:
        if not 0 <= index < self.num_micro_batches:
            raise IndexError(f"micro-batch {index} does not exist; this dump has {self.num_micro_batches}")
        tensors = load_safetensors_bytes(self._zstd(spec.batch_tensors_name(index)), spec.batch_tensors_name(index))
        try:
            skeleton = jsonio.loads(self._zstd(spec.batch_json_name(index)))
        except ValueError as exc:
            raise DumpCorruptError(f"{spec.batch_json_name(index)} is not valid JSON", spec.batch_json_name(index)) from exc
        return decode_tree(skeleton, tensors)

    def history(self) -> dict:
        return self._json(spec.HISTORY)

    def total_size(self) -> int:
        return sum(int(entry.get("size", 0)) for entry in self.manifest["files"].values())


def _check_entry(name: str, data: bytes, entry: dict, path: Path) -> None:
    if len(data) != entry.get("size"):
        raise DumpCorruptError(f"{path} is {len(data)} bytes but the manifest says {entry.get('size')}: "
                               "the file is truncated or was changed", name)
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise DumpCorruptError(f"{path} does not match its sha256 in the manifest: the file was changed "
                               "or corrupted", name)


def resolve(path: str | Path) -> tuple[Path, Any]:
    """Returns a directory for `path` (unpacking a .tar.zst into a temp dir) and the temp dir holder."""

    path = Path(path)
    if path.name == spec.MANIFEST and path.is_file():
        path = path.parent  # the user pointed at the manifest itself
    if not path.exists():
        raise DumpNotFoundError(f"{path} does not exist. Pass a dump directory or a {spec.ARCHIVE_SUFFIX} file.")
    if path.is_file():
        return unpack_archive(path)
    return path, None


def open_dump(path: str | Path, rank: int | None = None) -> Dump:
    """Opens a rank dump, a step directory (choose `rank`), or a packed `.tar.zst` of either.

    Args:
        path: the dump. Nothing is imported, unpickled or executed.
        rank: for a step directory holding several ranks: which one. Default: the rank that saw the
            fault first-hand (manifest trigger.local), else the lowest rank present.
    Returns:
        Dump, whose manifest is read and validated; weights are read only when asked.
    Example:
        >>> dump = open_dump("crash_dumps/run/step-000000042")  # doctest: +SKIP
        >>> dump.trigger["kind"]  # doctest: +SKIP
        'nonfinite_loss'
    """
    directory, holder = resolve(path)
    if is_rank_dump(directory):
        if rank is not None and int(read_manifest(directory)["rank"]) != rank:
            raise NotADumpError(f"{directory} is the dump of another rank; pass its step directory to pick rank {rank}")
        return Dump(directory, holder)
    ranks = rank_dirs(directory)
    complete = [r for r in ranks if is_rank_dump(r)]
    if not complete:
        steps = sorted(p.name for p in directory.glob("step-*"))
        if steps:
            raise NotADumpError(f"{directory} is a run directory holding dumps for {', '.join(steps)}; pass one of them")
        if ranks:
            raise NotADumpError(f"{directory} holds no complete rank dump ({len(ranks)} without a manifest: "
                                "the writer died before finishing)")
        raise NotADumpError(f"{directory} is not a forensics dump (no {spec.MANIFEST}, no rank-* directories)")
    dumps = [Dump(r, holder) for r in complete]
    if rank is not None:
        for dump in dumps:
            if dump.rank == rank:
                return dump
        raise NotADumpError(f"{directory} has no dump for rank {rank}; present: {[d.rank for d in dumps]}")
    local = [d for d in dumps if d.trigger.get("local", True)]
    return (local or dumps)[0]


def open_step(path: str | Path) -> tuple[list[Dump], list[int]]:
    """All rank dumps of a step directory (or the one of a rank directory) and the ranks missing."""
    directory, holder = resolve(path)
    if is_rank_dump(directory):
        dumps = [Dump(directory, holder)]
    else:
        dumps = [Dump(r, holder) for r in rank_dirs(directory) if is_rank_dump(r)]
        if not dumps:
            open_dump(directory)  # raises the precise error
    world = max(d.world_size for d in dumps)
    present = {d.rank for d in dumps}
    missing = [] if is_rank_dump(directory) else sorted(set(range(world)) - present)
    return dumps, missing
