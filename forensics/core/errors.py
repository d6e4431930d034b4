"""One error hierarchy for the whole toolkit; the CLI maps these to exit codes."""

from typing import Any


class ForensicsError(Exception):
    """Base of every error forensics raises on purpose. Messages say what to do instead."""


class DumpError(ForensicsError):
    """A dump is missing, incomplete, tampered with, or of an unknown version (bad input)."""


class DumpNotFoundError(DumpError):
    """The path given does not exist."""


class NotADumpError(DumpError):
    """The path exists but is not a complete dump (no manifest.json, not a step directory)."""


class DumpCorruptError(DumpError):
    """A file of the dump is truncated, has the wrong checksum, or cannot be parsed."""

    def __init__(self, message: str, file: str | None = None):
        super().__init__(message)
        self.file = file


class DumpIncompleteError(DumpError):
    """A sharded dump lacks part of its state: a rank dump holding some shards is missing.

    Attributes:
        missing_tensors: names of the tensors with parts no rank dump holds.
        missing_ranks: ranks whose dump is absent.
    """

    def __init__(self, message: str, missing_tensors: list[str], missing_ranks: list[int]):
        super().__init__(message)
        self.missing_tensors = missing_tensors
        self.missing_ranks = missing_ranks


class StorageError(DumpError):
    """A dump location in object storage cannot be used: its filesystem package is missing, the URL carries a
    secret, or the store refused (no credentials, an unreachable endpoint)."""


class UnsupportedVersionError(DumpError):
    """The dump was written by a newer format version than this reader implements."""


class RecipeError(ForensicsError):
    """The model / loss recipe cannot be used: not trusted yet, or cannot be imported (bad input)."""


class ReplayError(ForensicsError):
    """Replay cannot proceed (e.g. the requested device is not available)."""


class CaptureError(ForensicsError):
    """Capture could not write a dump. Never raised into a healthy training job."""


class TrainingFaultError(ForensicsError, FloatingPointError):
    """Raised in the training job under the `raise` policy when a step goes non-finite.

    Attributes:
        fired: what fired, typed (forensics.core.trigger.Trigger: kind, value, threshold, micro_batch, detail, local).
        trigger: the same as a dict (kind, value, threshold, micro_batch, detail, local), as the dump stores it.
        dump_path: where the dump was written, or None.
        dump_error: why no dump was written, or None.
    """

    def __init__(self, message: str, trigger: Any, dump_path=None, dump_error: str | None = None):
        super().__init__(message)
        self.fired = trigger
        self.trigger: dict = trigger.as_dict()
        self.dump_path = dump_path
        self.dump_error = dump_error


class UserCodeError(ForensicsError):
    """The user's model, loss or data code raised while forensics ran it on the dump (bad input, exit 2).

    Attributes:
        user_traceback: the traceback of their code, formatted, for the user to read.
    """

    def __init__(self, message: str, user_traceback: str):
        super().__init__(message)
        self.user_traceback = user_traceback


OUT_OF_MEMORY_TYPES = ("OutOfMemoryError", "MemoryError")
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "Cannot allocate memory")
"""CUDA's caching allocator says the first; the CPU allocator (DefaultCPUAllocator) the others."""


def is_out_of_memory(type_name: str | None, message: str | None) -> bool:
    """Whether a job's exception (by type name and message) is running out of memory, on a GPU or on the host."""
    return type_name in OUT_OF_MEMORY_TYPES or any(word in (message or "") for word in OUT_OF_MEMORY_WORDS)


def cut_text(text: object, limit: int = 200) -> str:
    """`str(text)` cut to `limit` characters ("..." at the end) for an error message."""
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
