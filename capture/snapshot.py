"""Pre-step state of model, optimizer, scheduler and scaler as name-keyed, detachable host data."""

from __future__ import annotations

from typing import Any

import torch

from forensics.format.jsonio import to_jsonable


class HostCopy:
    """Detaches state from the training loop without stalling it, for dumps written in the background.

    CUDA tensors are cloned on the device (stream-ordered before the optimizer step, so the copies hold
    pre-step values; ~1 ms per GB) and the writer thread moves them to the host. When the device has no
    room for the clones, they go to pinned host buffers with non-blocking copies instead.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._event = None
        self._device_room = True

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if not self.enabled:
            return tensor  # written synchronously before the loop continues: no copy needed
        if tensor.is_cuda:
            if self._device_room:
                try:
                    return tensor.clone()
                except torch.cuda.OutOfMemoryError:
                    self._device_room = False
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            return host
        return tensor.clone()

    def finish(self) -> None:
        if self.enabled and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def model_state(model: torch.nn.Module, copy: HostCopy) -> dict[str, torch.Tensor]:
    return {name: copy(t) for name, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}


def optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module, copy: HostCopy) -> dict:
    """Optimizer hyper-parameters and state keyed by parameter name (docs/DUMP_FORMAT.md)."""
    names = parameter_names(model)
    groups, state = [], {}
    for group_index, group in enumerate(optimizer.param_groups):
        group_names = []
        for param_index, param in enumerate(group["params"]):
            name = names.get(id(param), f"<unnamed group {group_index} param {param_index}>")
            group_names.append(name)
            entries = optimizer.state.get(param)
            if entries:
                state[name] = {k: copy(v) if isinstance(v, torch.Tensor) else to_jsonable(v)
                               for k, v in entries.items()}
        hyper = {k: plain(v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": group_names})
    cls = type(optimizer)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "param_groups": groups, "state": state}


def plain(value: Any) -> Any:
    """A state value as JSON: one-element tensors as numbers, tuples and lists as lists."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return to_jsonable(value)


def scheduler_state(scheduler: Any) -> dict | None:
    if scheduler is None:
        return None
    state = {k: plain(v) for k, v in scheduler.state_dict().items()}
    cls = type(scheduler)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "state": state}


def scaler_state(scaler: Any) -> dict | None:
    if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
        return None
    return {k: plain(v) for k, v in scaler.state_dict().items()}


def current_lr(optimizer: torch.optim.Optimizer) -> float | None:
    if not optimizer.param_groups:
        return None
    lr = optimizer.param_groups[0].get("lr")
    return float(lr) if isinstance(lr, (int, float)) else None
