"""In-job capture: the Guard watches a training loop and writes a replayable dump when a step goes wrong.

Imports nothing heavy beyond torch; framework adapters live in forensics.capture.integrations and load lazily. The
sub-packages are the stages of a step's way through the Guard (docs/ARCHITECTURE.md, "Capture"); a module is
imported by its full path (`forensics.capture.detection.detectors`).
"""

from forensics.capture.config import (
    DetectionConfig,
    DumpConfig,
    GuardConfig,
    PrecursorConfig,
    RecordConfig,
    SilentConfig,
    SpikeConfig,
)
from forensics.capture.guard import Guard
from forensics.capture.recording.datasets import IndexedDataset
from forensics.capture.silent.inject import FaultSpec

__all__ = [
    "DetectionConfig",
    "DumpConfig",
    "FaultSpec",
    "Guard",
    "GuardConfig",
    "IndexedDataset",
    "PrecursorConfig",
    "RecordConfig",
    "SilentConfig",
    "SpikeConfig",
]
