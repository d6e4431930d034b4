"""Names and constants of dump format v1 (docs/DUMP_FORMAT.md); the one place they are spelled."""

FORMAT_NAME = "forensics-dump"
FORMAT_VERSION = 2
"""The newest version this reader implements; writers use it only for what version 1 cannot say (the
sharded layout), so that every dump an older forensics can read keeps version 1."""
FULL_STATE_VERSION = 1

MANIFEST = "manifest.json"
MODEL = "model.safetensors"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
SCHEDULER = "scheduler.json"
SCALER = "scaler.json"
RNG_TENSORS = "rng.safetensors"
RNG_JSON = "rng.json"
HISTORY = "history.json"
ARCHIVE_SUFFIX = ".tar.zst"

REQUIRED_MANIFEST_KEYS = (
    "format", "format_version", "created_at", "run_id", "trigger", "step", "rank", "world_size",
    "micro_batches", "files",
)
# Files above this size also carry per-chunk sha256s (manifest files[name].chunks), verified in parallel.
CHUNK_BYTES = 64 * 1024 * 1024
# A safetensors header above this is refused: no legitimate dump needs it, a hostile one could.
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def batch_tensors_name(index: int) -> str:
    return f"batch-{index:03d}.safetensors.zst"


def batch_json_name(index: int) -> str:
    return f"batch-{index:03d}.json.zst"


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"
