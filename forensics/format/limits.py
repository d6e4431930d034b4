"""Hard limits on what a reader allocates for an untrusted dump (docs/DUMP_FORMAT.md "Limits").

Every size a dump claims is checked against these BEFORE anything is read or allocated; each is far
above what a real dump needs. The archive limits can be raised on the command line
(`--max-unpacked-gb`, `--max-unpack-ratio`, `--max-members`) for a legitimately huge archive.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20

MAX_JSON_FILE = 64 * MiB
"""manifest.json, history.json, rng.json, optimizer.json, scheduler.json, scaler.json: a 4,096-micro-batch
manifest with long sample ids is a few MB."""
MAX_JSON_DEPTH = 64
"""Nesting of any JSON document (a batch tree or a recipe's config is a handful of levels)."""
MAX_JSON_NUMBER_DIGITS = 400
"""Digits of one JSON number (a float64 needs ~25; an int64 20)."""
MAX_DECOMPRESSED = 1 << 40
"""What one zstd-compressed micro-batch tensor file may decompress to, whatever its frame header declares: 1 TiB, more
than any host holds as one micro-batch (a size field beyond it is nonsense). What a reader allocates is bounded by the
size the file's headers declare (checked to agree) and by what the host can hold now (`memory_room`), never by a ratio
to the compressed size: an all-zero tensor (a padding mask) compresses ~30,000x and is a legitimate batch."""
MAX_WORLD_SIZE = 1 << 20
"""Ranks a manifest may claim (no structure is ever sized by it beyond this)."""
MAX_MICRO_BATCHES = 4096
"""Micro-batches of one step (the Guard records at most this many)."""
MAX_NAME_CHARS = 128
"""A run id or a file name in the manifest."""
HASH_CHUNK = 8 * MiB
"""Files are hashed while streamed in chunks of this size, never read whole to be checked."""


@dataclass(frozen=True)
class ArchiveLimits:
    """What unpacking a `.tar.zst` may produce before it is refused (all checked while streaming)."""

    max_bytes: int = 256 * GiB
    """Total bytes of all members (a 70B-parameter state with Adam is ~850 GB: raise it for those)."""
    max_ratio: float = 32.0
    """Unpacked bytes per archive byte, beyond the first GiB: weights barely compress and batch files are
    compressed already, so a genuine dump archive unpacks to a few times its size; a zstd bomb to 1000s."""
    max_members: int = 50_000
    """Files and directories (a step of 64 ranks with 16 micro-batches has ~2,700)."""
    max_path_chars: int = 1024
    """Characters of one member path."""
    max_depth: int = 8
    """Path components of one member (run/step/rank/file is 4)."""

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_ratio, self.max_members, self.max_path_chars, self.max_depth) <= 0:
            raise ValueError("ArchiveLimits must all be positive")


def memory_room() -> int | None:
    """Bytes this process can still allocate now (None: unknown): the least of the host's available memory
    (/proc/meminfo MemAvailable), its cgroup's limit less its usage, and its address-space limit (RLIMIT_AS, as
    `ulimit -v`) less what it maps. A reader checks a size a dump declares against it before allocating it."""
    room = [_meminfo("MemAvailable:"), _cgroup_room()]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = _status("VmSize:")
    if soft != resource.RLIM_INFINITY and mapped is not None:
        room.append(max(0, soft - mapped))
    known = [r for r in room if r is not None]
    return min(known) if known else None


def _kib_field(path: str, key: str) -> int | None:
    try:
        with open(path) as handle:
            line = next((line for line in handle if line.startswith(key)), None)
        return int(line.split()[1]) * 1024 if line else None
    except (OSError, ValueError, IndexError):
        return None


def _meminfo(key: str) -> int | None:
    return _kib_field("/proc/meminfo", key)


def _status(key: str) -> int | None:
    return _kib_field("/proc/self/status", key)


def _cgroup_room() -> int | None:
    """The memory cgroup's limit less its usage (v2 or v1 files at the usual mount; None: no limit or unknown)."""
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit) as a, open(usage) as b:
                cap, used = a.read().strip(), int(b.read().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < (1 << 60):  # "max" or v1's near-2**63: no limit
            return max(0, int(cap) - used)
        return None
    return None
