"""The Guard's own host snapshots of the training state every K steps (GuardConfig.recording.snapshot_every), so that a
window replay (`forensics replay DUMP`) needs no checkpoint of the user's.

At the check() of a healthy step S with S % every == 0, the pre-step model + optimizer state is copied into
host buffers allocated once and reused. CUDA tensors go to pinned buffers with non-blocking copies, ordered on
the stream before the optimizer step: the loop does not wait for them. CPU tensors are copied in place (the
stall is one memcpy of the state). `count` slots rotate, so the oldest snapshot is up to count x every steps
old; a dump carries the oldest one the flight recorder still covers (spec.SNAPSHOT_STATE). Host memory:
count x this rank's state, checked against the machine's available memory before anything is allocated.
A slot written into a dump in the background is lent to the writer and skipped until the write is done.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from forensics.capture.state.sharding import state_bytes
from forensics.core.device_sync import DeviceFence, on_device_of, quarantine
from forensics.format.tensors import tensor_bytes

log = logging.getLogger(__name__)

MAX_SHARE_OF_AVAILABLE = 0.5
"""Snapshots may take at most this share of the host memory available when the first one is taken."""


@dataclass(eq=False)  # slots are told apart by identity (their fields hold tensors)
class _Slot:
    step: int | None = None
    state: dict | None = None  # {"model": {name: host tensor}, "optimizer": {...}}, host buffers
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    landed: DeviceFence = field(default_factory=DeviceFence)  # passed once the copies into this slot are done
    lent: threading.Event = field(default_factory=threading.Event)  # set while a dump writer reads this slot

    def wait(self) -> None:
        self.landed.wait()


class HostSnapshots:
    def __init__(self, every: int, count: int):
        self.every, self.count = every, count
        self._slots = [_Slot() for _ in range(count)] if every > 0 else []
        self._next = 0
        self.off_because: str | None = None
        """Why snapshots were turned off in this job (logged once), or None."""
        self.bytes_held = 0

    def due(self, step: int) -> bool:
        return bool(self._slots) and self.off_because is None and step % self.every == 0

    def turn_off(self, why: str) -> None:
        if self.off_because is None:
            self.off_because = why
            log.warning("forensics: host snapshots (GuardConfig.recording.snapshot_every) are off: %s", why)

    def take(self, step: int, state: dict) -> None:
        """Copies `state` (full layout, tensors as references) into the next free slot."""
        slot = self._free_slot()
        if slot is None:
            log.info("forensics: step %d: no host snapshot (every slot is being written into a dump)", step)
            return
        if not self.bytes_held and not self._fits(state):
            return
        slot.wait()
        slot.step = None  # until every copy is made: a copy that fails leaves no half-written snapshot behind
        copies: dict[str, torch.Tensor] = {}
        devices: dict[torch.device, None] = {}

        def copy(key: str, tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.detach()
            buffer = slot.buffers.get(key)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = _host_buffer(tensor)
                slot.buffers[key] = buffer
            buffer.copy_(tensor, non_blocking=tensor.is_cuda and buffer.is_pinned())
            if tensor.is_cuda:
                devices.setdefault(tensor.device)
            copies[key] = buffer
            return buffer

        model = {name: copy(f"model/{name}", t) for name, t in state["model"].items()}
        optimizer = state.get("optimizer")
        if optimizer is not None:
            optimizer = {
                **optimizer,
                "state": {
                    param: {
                        k: copy(f"optimizer/{param}/{k}", v) if isinstance(v, torch.Tensor) else v
                        for k, v in values.items()
                    }
                    for param, values in optimizer["state"].items()
                },
            }
        for key in set(slot.buffers) - set(copies):
            del slot.buffers[key]  # a tensor that no longer exists (a parameter group removed)
        slot.landed = DeviceFence(devices)
        slot.step, slot.state = step, {"model": model, "optimizer": optimizer}
        self.bytes_held = sum(tensor_bytes(t) for s in self._slots for t in s.buffers.values())
        self._next = (self._slots.index(slot) + 1) % self.count

    def settle(self) -> None:
        """Notes which slots' copies have landed (a non-blocking query; called at each healthy check): after a
        CUDA error only those can be read, since nothing on the device can be asked any more."""
        for slot in self._slots:
            if not slot.landed.settled:
                slot.landed.poll()

    def lend_oldest(self, first_step: int, device_usable: bool = True) -> tuple[dict | None, Callable[[], None]]:
        """The oldest snapshot taken at or after `first_step` as `{"step", "model", "optimizer"}` (None: none),
        and the function that gives its slot back once the dump holding it is written.

        With `device_usable=False` (a CUDA error poisoned the context) only a slot whose copies were seen complete
        before the fault is lent, nothing on the device is touched, and every pinned buffer is quarantined
        (forensics.core.device_sync.quarantine: freeing one would abort the process)."""
        if not device_usable:
            quarantine(slot.buffers for slot in self._slots)
        held = [
            s
            for s in self._slots
            if s.step is not None
            and s.step >= first_step
            and not s.lent.is_set()
            and (device_usable or s.landed.settled)
        ]
        if not held:
            return None, lambda: None
        slot = min(held, key=lambda s: s.step or 0)  # every held slot has a step
        if device_usable:
            slot.wait()
        slot.lent.set()
        return {"step": slot.step, **(slot.state or {})}, slot.lent.clear

    def _free_slot(self) -> _Slot | None:
        for offset in range(self.count):
            slot = self._slots[(self._next + offset) % self.count]
            if not slot.lent.is_set():
                return slot
        return None

    def _fits(self, state: dict) -> bool:
        need = self.count * state_bytes(state)
        available = available_host_memory()
        if available is not None and need > MAX_SHARE_OF_AVAILABLE * available:
            self.turn_off(
                f"{self.count} snapshots of this rank's state need {need / 2**20:,.1f} MiB of host memory, "
                f"more than half of the {available / 2**20:,.1f} MiB available; lower "
                "RecordConfig.snapshot_count or pass a checkpoint of your own to `forensics replay --from`"
            )
            return False
        log.info(
            "forensics: host snapshots every %d steps hold %.1f MiB (%d x the state)",
            self.every,
            need / 2**20,
            self.count,
        )
        return True


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_cuda:
        try:
            with on_device_of(tensor):
                return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        except RuntimeError:  # no pinnable memory left: a pageable buffer (the copy then waits)
            pass
    return torch.empty(tensor.shape, dtype=tensor.dtype)


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none: not Linux)."""
    return proc_bytes("/proc/meminfo", "MemAvailable:")


def proc_bytes(path: str, key: str) -> int | None:
    """A `key: <n> kB` line of a /proc file, in bytes (None where the file or the line is missing)."""
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
