"""In-job capture: the Guard watches a training loop and writes a replayable dump when a step goes wrong.

Imports nothing heavy beyond torch; framework adapters live in capture.integrations and load lazily.
"""

from capture.config import GuardConfig, SpikeConfig
from capture.datasets import IndexedDataset
from capture.guard import Guard
from capture.precursors import PrecursorConfig

__all__ = ["Guard", "GuardConfig", "IndexedDataset", "PrecursorConfig", "SpikeConfig"]
