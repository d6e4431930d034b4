"""The model as a one-GPU replay names its parameters: DDP, DataParallel and torch.compile wrappers stripped."""

from __future__ import annotations

import torch

from forensics.core.thirdparty import compiled_original


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameter names a one-GPU replay will see: strips DDP / DataParallel / torch.compile."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif (inner := compiled_original(model)) is not None:
            model = inner
        else:
            return model


__all__ = ["unwrap_model"]
