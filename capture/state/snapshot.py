"""Pre-step state of model, optimizer, scheduler and scaler as name-keyed, detachable host data."""

from __future__ import annotations

from typing import Any, Callable

import torch

from forensics.core.device_sync import DeviceFence, on_device_of
from forensics.format.jsonio import to_jsonable
from forensics.format.batch_tree import map_tensors


class HostCopy:
    """Detaches state from the training loop without stalling it, for dumps written in the background.

    CUDA tensors are cloned on the device (stream-ordered before the optimizer step, so the copies hold
    pre-step values; ~1 ms per GB) and the writer thread moves them to the host. When the device has no
    room for the clones, they go to pinned host buffers with non-blocking copies instead. `finish()` fences the
    current stream of every device a tensor came from (forensics.core.device_sync), so `wait()` holds for a model
    spread over several GPUs and for a writer on another thread.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._devices: dict[torch.device, None] = {}
        self._fence: DeviceFence | None = None
        self._device_room = True

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.is_cuda:
            self._devices.setdefault(tensor.device)
        if not self.enabled:
            return tensor  # written synchronously before the loop continues: no copy needed
        if tensor.is_cuda:
            if self._device_room:
                try:
                    return tensor.clone()
                except torch.cuda.OutOfMemoryError:
                    self._device_room = False
            with on_device_of(tensor):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
            return host
        return tensor.clone()

    def cover(self, tree: Any) -> None:
        """Notes the devices of the tensors in `tree` (state collected before, e.g. by the sync-free mode), so that
        finish() fences them too. LocalShard-like values are seen through their `tensor`."""
        if isinstance(tree, torch.Tensor):
            if tree.is_cuda:
                self._devices.setdefault(tree.device)
        elif isinstance(tree, dict):
            for value in tree.values():
                self.cover(value)
        elif isinstance(tree, (list, tuple)):
            for value in tree:
                self.cover(value)
        elif isinstance(getattr(tree, "tensor", None), torch.Tensor):
            self.cover(tree.tensor)

    def finish(self) -> None:
        """Fences every device seen: the writer reads the tensors (copies, or the live ones of a synchronous dump
        whose writer runs on other threads and streams) only after what the job queued before this point."""
        self._fence = DeviceFence(self._devices)

    def wait(self) -> None:
        if self._fence is not None:
            self._fence.wait()


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def model_state(model: torch.nn.Module, copy: Callable[[torch.Tensor], Any]) -> dict[str, torch.Tensor]:
    return {name: copy(t) for name, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}


def optimizer_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, copy: Callable[[torch.Tensor], Any]
) -> dict:
    """Optimizer hyper-parameters and state keyed by parameter name (docs/DUMP_FORMAT.md)."""
    names, state = parameter_names(model), {}
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            entries = optimizer.state.get(param)
            if entries:
                name = names.get(id(param), f"<unnamed group {group_index} param {param_index}>")
                state[name] = {
                    k: copy(v) if isinstance(v, torch.Tensor) else to_jsonable(v) for k, v in entries.items()
                }
    return {**optimizer_hyper(optimizer, model), "state": state}


def optimizer_hyper(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """The optimizer's class and param groups (hyper-parameters, parameter names) with no state: host values only,
    readable when the device is not."""
    names = parameter_names(model)
    groups = []
    for group_index, group in enumerate(optimizer.param_groups):
        params = [names.get(id(p), f"<unnamed group {group_index} param {i}>") for i, p in enumerate(group["params"])]
        hyper = {k: plain(v) for k, v in group.items() if k != "params" and not _on_device(v)}
        groups.append({**hyper, "params": params})
    cls = type(optimizer)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "param_groups": groups, "state": {}}


def _on_device(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


class DeviceOnly:
    """A batch tensor that lived on an unusable device: stored as an unreplayable leaf naming its shape."""

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype, self.device = list(tensor.shape), str(tensor.dtype), str(tensor.device)


def host_only(node: Any) -> Any:
    """A micro-batch with its device tensors replaced by DeviceOnly (nothing is read from the device)."""
    return map_tensors(node, lambda t: t.detach() if t.device.type == "cpu" else DeviceOnly(t))


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
