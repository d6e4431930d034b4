"""A small regression job for the window-replay tests: model factory, dataset factory and loss, importable by
name (`--path tests/replay`), as a user's own training code would be.

`make_dataset(n, poison)`: sample i is (x, y) with x ~ N(0, 1); sample(s) `poison` have x = 1e3 everywhere, a record
whose gradient is large but finite. Under SGD its update wrecks the first layer, and a few steps later the
loss overflows.
"""

from __future__ import annotations

import torch

from forensics.capture import IndexedDataset

IN, HIDDEN, OUT = 8, 16, 4


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(IN, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def make_model(seed: int = 0) -> Regression:
    torch.manual_seed(seed)
    return Regression()


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int, poison: int | list[int] | None):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, IN, generator=g)
        self.y = torch.randn(n, OUT, generator=g)
        for index in [poison] if isinstance(poison, int) else poison or []:
            self.x[index] = 1e3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return {"x": self.x[index], "y": self.y[index]}


def make_dataset(n: int = 96, poison: int | list[int] | None = None) -> IndexedDataset:
    return IndexedDataset(Samples(n, poison))


def mse_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]).pow(2).mean()
