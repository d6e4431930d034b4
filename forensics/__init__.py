"""forensics: capture the failing step of a PyTorch training run, replay it on one GPU, name the cause.

Public API (everything else is internal):
    Guard, GuardConfig, SpikeConfig, PrecursorConfig, IndexedDataset -- in-job capture (package `capture`)
    open_dump, verify_dump, pack_dump                 -- reading dumps (never unpickles)
    replay_dump                                       -- offline replay -> report dict (package `replay`)
    ForensicsError and subclasses                     -- one error hierarchy
"""

from __future__ import annotations

from forensics.errors import (CaptureError, DumpCorruptError, DumpError, DumpNotFoundError, ForensicsError,
                              NotADumpError, RecipeError, ReplayError, TrainingFaultError,
                              UnsupportedVersionError)

__all__ = [
    "CaptureError", "DumpCorruptError", "DumpError", "DumpNotFoundError", "ForensicsError", "Guard",
    "GuardConfig", "IndexedDataset", "NotADumpError", "PrecursorConfig", "RecipeError", "ReplayError", "SpikeConfig",
    "TrainingFaultError", "UnsupportedVersionError", "open_dump", "pack_dump", "replay_dump", "verify_dump",
]

_CAPTURE = {"Guard", "GuardConfig", "SpikeConfig", "PrecursorConfig", "IndexedDataset"}
_FORMAT = {"open_dump", "pack_dump", "verify_dump"}


def __getattr__(name: str):
    # Lazy so that `import forensics` in a job does not import replay, and the CLI starts fast.
    if name in _FORMAT:
        import forensics.format

        return getattr(forensics.format, name)
    if name in _CAPTURE:
        import capture

        return getattr(capture, name)
    if name == "replay_dump":
        from replay.engine import run_replay

        return run_replay
    raise AttributeError(f"module 'forensics' has no attribute {name!r}")
