"""forensics: capture the failing step of a PyTorch training run, replay it on one GPU, name the cause.

Public API (everything else is internal):
    Guard, GuardConfig (DetectionConfig, DumpConfig, RecordConfig, PrecursorConfig, SpikeConfig, SilentConfig),
    FaultSpec                                         -- fault injection that proves the silent checks
    IndexedDataset                                    -- in-job capture (forensics.capture)
    open_dump, verify_dump, pack_dump                 -- reading dumps (never unpickles)
    replay_dump                                       -- offline replay -> report dict (forensics.replay)
    ForensicsError and subclasses                     -- one error hierarchy

The top of this package (this API, cli, demo/, summary and catalog for `inspect` / `list`) calls into the core that
capture and replay share (format/, report/, kinds, errors, trigger, rng, recipes, ...): docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from forensics.core.errors import (
    CaptureError,
    DumpCorruptError,
    DumpError,
    DumpNotFoundError,
    ForensicsError,
    NotADumpError,
    RecipeError,
    ReplayError,
    TrainingFaultError,
    UnsupportedVersionError,
)
from forensics.core.lazy import lazy_exports
from forensics.core.moved import install as _keep_moved_names

__all__ = [
    "CaptureError",
    "DetectionConfig",
    "DumpConfig",
    "DumpCorruptError",
    "DumpError",
    "DumpNotFoundError",
    "FaultSpec",
    "ForensicsError",
    "Guard",
    "GuardConfig",
    "IndexedDataset",
    "NotADumpError",
    "PrecursorConfig",
    "RecipeError",
    "RecordConfig",
    "ReplayError",
    "SilentConfig",
    "SpikeConfig",
    "TrainingFaultError",
    "UnsupportedVersionError",
    "open_dump",
    "pack_dump",
    "replay_dump",
    "verify_dump",
]

_keep_moved_names()  # module paths that moved import for one more release, with a DeprecationWarning (core/moved.py)

# Lazy so that `import forensics` in a job does not import forensics.replay, and the CLI starts fast.
__getattr__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            (
                "Guard",
                "GuardConfig",
                "DetectionConfig",
                "DumpConfig",
                "RecordConfig",
                "SpikeConfig",
                "PrecursorConfig",
                "SilentConfig",
                "FaultSpec",
                "IndexedDataset",
            ),
            "forensics.capture",
        ),
        **dict.fromkeys(("open_dump", "pack_dump", "verify_dump"), "forensics.format"),
        "replay_dump": "forensics.replay.engine:run_replay",
    },
)
