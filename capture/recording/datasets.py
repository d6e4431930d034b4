"""A dataset wrapper that attaches each sample's dataset index as its ID, so dumps name samples."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset


class IndexedDataset(Dataset):
    """Wraps a map-style dataset of dict samples and adds `key: index` to each sample.

    The default collate function then yields `batch[key]` as a tensor of dataset indices, which the
    Guard reads as the micro-batch's sample IDs.

    Example:
        >>> loader = DataLoader(IndexedDataset(my_dataset), batch_size=8)  # doctest: +SKIP
    """

    def __init__(self, dataset: Any, key: str = "sample_ids"):
        self.dataset, self.key = dataset, key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        sample = self.dataset[index]
        if not isinstance(sample, dict):
            raise TypeError(
                f"IndexedDataset needs dict samples to attach '{self.key}'; got {type(sample).__name__}. "
                "Pass sample_ids= to Guard.record_batch instead."
            )
        return {**sample, self.key: index}
