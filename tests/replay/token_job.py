"""Token data for the device-side-assert test: `make_dataset(n, bad)` gives rows of 8 token ids below 64, and row
`bad` holds id 300 (past a 64-token vocabulary) — a corrupted record. Importable by name (`--path tests/replay`),
as a user's own data code would be, for the data recipe."""

from __future__ import annotations

import torch

from forensics.capture import IndexedDataset

VOCAB, LENGTH = 64, 8


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, bad: int | None):
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(3))
        if bad is not None:
            self.ids[bad, 5] = 300

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def make_dataset(n: int = 64, bad: int | None = None) -> IndexedDataset:
    return IndexedDataset(Tokens(n, bad))
