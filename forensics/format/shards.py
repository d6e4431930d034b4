"""The sharded state layout (dump format version 2): each rank writes only the state it owns; a reader
assembles any tensor from the rank dumps of one step, one tensor at a time.

Writer side: a state value may be a `LocalShard` (this rank's box of a larger tensor); the writer stores its
data under the tensor's name and lists it in the manifest's `layout.shards`. Every rank's manifest also
carries `layout.tensors`, the table of every tensor of the complete state (name, global shape, dtype), so
any one rank dump says what the whole state is and which parts are missing. `ShardCopies` are another
rank's shards a rank also stores (`layout.copies`, GuardConfig.dumping.shard_replicas): used only to fill gaps.

Reader side: `ShardIndex` joins the `layout` sections of a step's rank dumps (the step-level index) and
checks, before anything is allocated, that the boxes of each tensor tile it exactly (in bounds, no
overlap, nothing missing; identical boxes written by two ranks are replicas). `ShardedState` then reads a
tensor's boxes read with pread from the files of their ranks into one tensor on the replay device.
See docs/DUMP_FORMAT.md, "Sharded layout".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from forensics.core.errors import DumpCorruptError, DumpIncompleteError
from forensics.format import spec

if TYPE_CHECKING:
    import torch

Dump = Any  # forensics.format.reader.Dump (which imports this module): a rank dump with .manifest, .path, .rank


@dataclass(frozen=True)
class LocalShard:
    """This rank's part of a tensor: `tensor` is the box starting at `offsets` of a tensor of `global_shape`.

    With `flat`, offsets and the box are those of the flattened tensor (a ZeRO partition: a contiguous
    range of elements), and `offsets` has one entry. `holders`: how many ranks write this same box (HSDP
    replica groups); a box only one rank holds is what a buddy copy protects (capture/state/buddy.py).
    """

    tensor: Any  # torch.Tensor (contiguous)
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    flat: bool = False
    holders: int = 1


@dataclass
class ShardCopies:
    """Another rank's sole shards, received to be written beside this rank's own (GuardConfig.dumping.shard_replicas):
    `files` maps a SHARDED_FILES name to `{stored name: LocalShard}`."""

    source_rank: int
    files: dict[str, dict[str, LocalShard]]


def dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).removeprefix("torch.")


def table_entry(shape, dtype: "torch.dtype") -> dict:
    """One row of `layout.tensors`: a tensor of the complete state."""
    return {"shape": [int(n) for n in shape], "dtype": dtype_name(dtype)}


def shard_entry(value: Any) -> tuple[Any, dict]:
    """(the tensor to store, its `layout.shards` entry) for a state value (a tensor, or a LocalShard)."""
    if isinstance(value, LocalShard):
        return value.tensor, {
            "offsets": [int(o) for o in value.offsets],
            "shape": [int(n) for n in value.tensor.shape],
            "flat": value.flat,
        }
    return value, {"offsets": [0] * value.dim(), "shape": [int(n) for n in value.shape], "flat": False}


# -- reader side ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """One stored box of a tensor: which rank dump holds it, where it sits in the global tensor."""

    dump: Dump
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat: bool
    stored: str
    """The file of `dump` holding it: the state file itself, or a copy of another rank's shards."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        return self.offsets, self.shape, self.flat


def _overlap(a: Piece, b: Piece) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.shape, b.offsets, b.shape))


class ShardIndex:
    """The step-level index of a sharded dump: for each tensor of the complete state, the boxes that hold it.

    Built from the manifests alone (no data file is read), so `verify` and replay know what is missing
    before anything is allocated.
    """

    def __init__(self, dumps: list[Dump]):
        first = dumps[0]
        self.layout = first.manifest["layout"]
        self.dumps = dumps
        for dump in dumps[1:]:
            for field in ("run_id", "step", "world_size"):
                if dump.manifest[field] != first.manifest[field]:
                    raise DumpCorruptError(
                        f"{dump.path} is not a shard of the same dump as {first.path}: its {field} is "
                        f"{dump.manifest[field]!r}, not {first.manifest[field]!r}",
                        spec.MANIFEST,
                    )
            if (dump.manifest.get("layout") or {}).get("tensors") != self.layout["tensors"]:
                raise DumpCorruptError(
                    f"{dump.path} describes a different state (layout.tensors) than "
                    f"{first.path}: they are not ranks of one dump",
                    spec.MANIFEST,
                )
        self.pieces: dict[tuple[str, str], list[Piece]] = {}
        for dump in dumps:  # every rank's own shards first: a copy serves only where they leave a gap
            for file, shards in (dump.manifest["layout"].get("shards") or {}).items():
                self._add(dump, file, file, shards)
        for dump in dumps:
            for stored, copy in (dump.manifest["layout"].get("copies") or {}).items():
                if stored not in dump.set_aside:  # a damaged copy covers nothing
                    self._add(dump, copy["of"], stored, copy["shards"])

    def _add(self, dump: Dump, file: str, stored: str, shards: dict) -> None:
        """The boxes of `file`'s tensors that `dump` stores in its file `stored`."""
        declared = 0
        for name, entry in shards.items():
            row = self.layout["tensors"].get(file, {}).get(name)
            if row is None:
                raise DumpCorruptError(
                    f"{dump.path / spec.MANIFEST}: shard {_quoted(name)} of {file} is not in layout.tensors",
                    spec.MANIFEST,
                )
            piece = Piece(dump, tuple(entry["offsets"]), tuple(entry["shape"]), bool(entry["flat"]), stored)
            declared += piece.numel * spec.ITEM_SIZE[row["dtype"]]
            self.pieces.setdefault((file, name), []).append(piece)
        files = dump.manifest["files"]
        if shards and (stored not in files or declared > files[stored]["size"]):
            raise DumpCorruptError(
                f"{dump.path / spec.MANIFEST}: the shards listed for {_quoted(stored)} do not fit that file",
                spec.MANIFEST,
            )

    def names(self, file: str) -> list[str]:
        return list(self.layout["tensors"].get(file, {}))

    def row(self, file: str, name: str) -> dict:
        return self.layout["tensors"][file][name]

    def tiling(self, file: str, name: str) -> tuple[list[Piece], int]:
        """The distinct boxes of a tensor (replicas dropped) and how many of its elements no box holds.

        Raises:
            DumpCorruptError: a box lies outside the tensor or overlaps another one.
        """
        shape = tuple(self.row(file, name)["shape"])
        numel = math.prod(shape)
        chosen: dict[tuple, Piece] = {}
        for piece in self.pieces.get((file, name), []):
            chosen.setdefault(piece.box, piece)  # the same box from another rank is a replica
        pieces = sorted(chosen.values(), key=lambda p: p.offsets)
        if len({p.flat for p in pieces}) > 1:
            raise DumpCorruptError(f"the shards of {_quoted(name)} mix flat and box layouts", spec.MANIFEST)
        bounds = (numel,) if pieces and pieces[0].flat else shape
        for piece in pieces:
            if (
                len(piece.offsets) != len(bounds)
                or len(piece.shape) != len(bounds)
                or any(o < 0 or o + s > n for o, s, n in zip(piece.offsets, piece.shape, bounds))
            ):
                raise DumpCorruptError(
                    f"{piece.dump.path}: a shard of {_quoted(name)} lies outside its tensor of shape {list(shape)}",
                    spec.MANIFEST,
                )
        for i, piece in enumerate(pieces):  # sweep along the first dimension: near-linear for real shardings
            for other in pieces[i + 1 :]:
                if bounds and other.offsets[0] >= piece.offsets[0] + piece.shape[0]:
                    break
                if piece.numel and other.numel and _overlap(piece, other):
                    raise DumpCorruptError(
                        f"{piece.dump.path} and {other.dump.path} hold overlapping, different "
                        f"shards of {_quoted(name)}",
                        spec.MANIFEST,
                    )
        return pieces, numel - sum(p.numel for p in pieces)

    def missing(self) -> dict[str, list[str]]:
        """`{file: [tensor names with elements no rank dump holds]}` (empty when the state is complete)."""
        gaps: dict[str, list[str]] = {}
        for file, rows in self.layout["tensors"].items():
            for name in rows:
                if self.tiling(file, name)[1]:
                    gaps.setdefault(file, []).append(name)
        return gaps

    def require_complete(self, world_size: int) -> None:
        """Raises DumpIncompleteError naming the missing ranks and tensors when the state has gaps."""
        gaps = self.missing()
        if not gaps:
            return
        present = sorted({d.rank for d in self.dumps})
        absent = sorted(set(range(world_size)) - set(present))
        names = [name for rows in gaps.values() for name in rows]
        shown = ", ".join(_quoted(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise DumpIncompleteError(
            f"this sharded dump is incomplete: {len(names)} tensors of the state have parts no rank dump holds "
            f"({shown}). Rank dumps found: {present}; missing: {absent or 'none'}. Each rank wrote only its own "
            "shards: copy the missing rank-* directories (from the other nodes' dump_dir) next to these, or "
            "name their directories with --shards DIR. If those ranks died while writing, the state cannot be "
            "rebuilt from this dump (DumpConfig(shard_replicas=2) writes every part on two ranks).",
            names,
            absent,
        )


class ShardedState:
    """Reads tensors of a sharded dump's complete state, one at a time, from the rank dumps that hold them."""

    def __init__(self, index: ShardIndex):
        self.index = index

    def tensor(self, file: str, name: str, device: str = "cpu") -> "torch.Tensor":
        """The whole tensor `name` of `file`, assembled on `device` from its shards."""
        import torch

        row = self.index.row(file, name)
        pieces, gap = self.index.tiling(file, name)
        if gap:
            raise DumpIncompleteError(
                f"{_quoted(name)} of {file} is missing {gap} elements (a rank dump is missing)", [name], []
            )
        out = torch.empty(row["shape"], dtype=getattr(torch, row["dtype"]), device=device)
        flat_out = out.view(-1) if pieces and pieces[0].flat else None
        for piece in pieces:
            if not piece.numel:
                continue
            data = piece.dump.tensor_file(piece.stored).read(name, device)
            if tuple(data.shape) != piece.shape or data.dtype != out.dtype:
                raise DumpCorruptError(
                    f"{piece.dump.path / piece.stored}: shard {_quoted(name)} is "
                    f"{list(data.shape)} {data.dtype}, the manifest says {list(piece.shape)} "
                    f"{out.dtype}",
                    piece.stored,
                )
            if flat_out is not None:
                flat_out[piece.offsets[0] : piece.offsets[0] + piece.numel].copy_(data.reshape(-1))
            else:
                out[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.shape))].copy_(data)
        return out

    def iter_tensors(
        self, file: str, device: str = "cpu", names: "set[str] | None" = None
    ) -> Iterator[tuple[str, "torch.Tensor"]]:
        for name in self.index.names(file):
            if names is None or name in names:
                yield name, self.tensor(file, name, device)


def _quoted(name: object, limit: int = 120) -> str:
    """A name from a dump, safe to print: repr-quoted (no escape sequences reach the terminal) and cut."""
    text = repr(str(name))
    return text if len(text) <= limit else text[: limit - 4] + "...'"
