"""In-job capture: the Guard watches a training loop and writes a replayable dump when a step goes wrong.

Imports nothing heavy beyond torch; framework adapters live in capture.integrations and load lazily. The
sub-packages are the stages of a step's way through the Guard (docs/ARCHITECTURE.md, "Capture"); a module is
imported by its full path (`capture.detection.detectors`).
"""

from capture.config import DetectionConfig, DumpConfig, GuardConfig, PrecursorConfig, RecordConfig, SpikeConfig
from capture.guard import Guard
from capture.recording.datasets import IndexedDataset

__all__ = [
    "DetectionConfig",
    "DumpConfig",
    "Guard",
    "GuardConfig",
    "IndexedDataset",
    "PrecursorConfig",
    "RecordConfig",
    "SpikeConfig",
]
