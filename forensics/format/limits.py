"""Hard limits on what a reader allocates for an untrusted dump (docs/DUMP_FORMAT.md "Limits").

Every size a dump claims is checked against these BEFORE anything is read or allocated; each is far
above what a real dump needs. The archive limits can be raised on the command line
(`--max-unpacked-gb`, `--max-unpack-ratio`, `--max-members`) for a legitimately huge archive.
"""

from __future__ import annotations

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
MAX_DECOMPRESSED = 4 * GiB
"""What one zstd-compressed micro-batch file may decompress to, whatever its frame header declares."""
BATCH_FREE = 256 * MiB
"""A micro-batch file may decompress to this much whatever its compressed size (an all-zero image batch of
256 MiB compresses to a few KB); beyond it, at most MAX_BATCH_RATIO x its compressed size."""
MAX_BATCH_RATIO = 1024
"""Decompressed bytes per compressed byte of a micro-batch file beyond BATCH_FREE: real data (tokens, pixels,
features) compresses a few times, padding and masks some hundreds; a frame of zeros (a zstd bomb) ~30,000. With
it, a file under 100 KB never makes a reader allocate more than BATCH_FREE."""
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
