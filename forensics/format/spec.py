"""Names and constants of the dump format (docs/DUMP_FORMAT.md); the one place they are spelled."""

from typing import NamedTuple

FORMAT_NAME = "forensics-dump"
FORMAT_VERSION = 3
"""The newest version this reader implements. A writer writes the lowest version that can say what the dump
holds (`version_needed`), so that every dump an older forensics can read keeps its older version."""
FULL_STATE_VERSION = 1
SHARDED_VERSION = 2
"""Adds the sharded layout (a version-1 reader would take a sharded rank dump for the full state)."""
CHUNK_DIGEST_VERSION = 3
"""A file with chunk digests has as `sha256` the sha256 of its chunk digests, not of its bytes
(forensics.format.digest): written and verified on many cores. Before it, `sha256` was of the bytes."""


def version_needed(sharded: bool, chunked: bool) -> int:
    """The format version a dump must declare: the sharded layout needs 2, a file with chunk digests 3."""
    return CHUNK_DIGEST_VERSION if chunked else SHARDED_VERSION if sharded else FULL_STATE_VERSION


MANIFEST = "manifest.json"
MODEL = "model.safetensors"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
SCHEDULER = "scheduler.json"
SCALER = "scaler.json"
RNG_TENSORS = "rng.safetensors"
RNG_JSON = "rng.json"
HISTORY = "history.json"
WINDOW_JSON = "window.json"
"""The flight recorder: per recorded step before this one, sample IDs, RNG meta and scalars (OPTIONAL)."""
WINDOW_RNG = "window-rng.safetensors"
"""The flight recorder's RNG tensors, keyed s<step>/mb<i>/... (OPTIONAL)."""
PRECURSORS = "precursors.json"
"""The precursor monitor's per-layer statistics of the recent steps, and what fired (OPTIONAL; GuardConfig.precursors)."""
SILENT = "silent.json"
"""A silent-corruption dump's evidence: the check that failed, both computations' digests per module and gradient, the
device's identity and the policy applied (OPTIONAL; trigger `silent_corruption`, GuardConfig.detection.silent)."""
MAIN_SCRIPT = "main_script.py"
"""The training script's source (UTF-8, at most MAX_MAIN_SCRIPT bytes) when the recipe's loss or factory is defined
in it (`__main__:name`) or the recipe names no factory; OPTIONAL, named by the manifest's `recipe.script`."""
MAX_MAIN_SCRIPT = 1 << 20
ARCHIVE_SUFFIX = ".tar.zst"
ZSTD_SUFFIX = ".zst"
JSON_ZSTD_SUFFIX = ".json.zst"
"""A micro-batch's JSON skeleton (batch_json_name): capped like any JSON file once decompressed."""


class StateFiles(NamedTuple):
    """The files holding one model + optimizer state."""

    model: str
    optimizer_tensors: str
    optimizer_json: str


PRE_STEP_STATE = StateFiles(MODEL, OPTIMIZER_TENSORS, OPTIMIZER_JSON)
"""The state the dumped step started from."""
SNAPSHOT_STATE = StateFiles("snapshot-model.safetensors", "snapshot-optimizer.safetensors", "snapshot-optimizer.json")
"""The Guard's host snapshot of an earlier step (GuardConfig.recording.snapshot_every; OPTIONAL): where a window replay
starts when the user has no checkpoint. Manifest `snapshot: {"step": N}`."""

SHARDED = "sharded"
"""`layout.kind` of a rank dump holding only its part of the state (format version 2, forensics.format.shards)."""
SHARDED_FILES = (MODEL, OPTIMIZER_TENSORS)
"""The files whose tensors a sharded dump splits across ranks (every other file is per rank)."""


def copy_file_name(of: str, source_rank: int) -> str:
    """Where a rank stores its copy of another rank's shards of `of` (a SHARDED_FILES name): manifest
    `layout.copies` (GuardConfig.dumping.shard_replicas). Readers take the names from the manifest, never from here."""
    return f"copy-{source_rank:05d}-{of}"


ITEM_SIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
}
"""Bytes per element of every dtype a sharded layout's table may name."""
DTYPES = tuple(ITEM_SIZE)

REQUIRED_MANIFEST_KEYS = (
    "format",
    "format_version",
    "created_at",
    "run_id",
    "trigger",
    "step",
    "rank",
    "world_size",
    "micro_batches",
    "files",
)
CHUNK_BYTES = 4 * 1024 * 1024
"""Files above this size carry per-chunk sha256s (manifest files[name].chunks; chunk_size says the size, so
dumps written with other sizes read the same): written and verified on many cores. 4 MiB makes a 4 MiB write
(a 1536 x 1536 bf16 weight) two pieces for two cores while a 70 GB file still lists only ~17,000 digests
(~1.2 MB of manifest). Dumps of versions 1 and 2 were written with 64 MiB chunks."""
# A safetensors header above this is refused: no legitimate dump needs it, a hostile one could.
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def batch_tensors_name(index: int) -> str:
    return f"batch-{index:03d}.safetensors.zst"


def batch_json_name(index: int) -> str:
    return f"batch-{index:03d}{JSON_ZSTD_SUFFIX}"


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def rank_of_dir_name(name: str) -> int | None:
    """The rank a directory name of the rank_dir_name form says (None for any other name)."""
    prefix, _, digits = name.partition("-")
    return int(digits) if prefix == "rank" and digits.isascii() and digits.isdigit() else None
