"""CUDA discipline for code that copies device tensors to the host, on any thread: which device and stream a
copy runs on, when it has landed, and what must never be freed once a CUDA error has poisoned the context.

Three rules, each a function here so that no caller re-derives them:
- A Python thread starts on device 0 whatever the main thread chose. A copy of a tensor on cuda:1 runs on
  cuda:1's current stream of *that thread*, so its completion event must be recorded there: `DeviceFence`
  records one event on the current stream of each device it is given, never on "the current device".
- A copy is finished only once its event completed. `DeviceFence.wait()` blocks on every event;
  `DeviceFence.settled` says, without touching the device, whether an earlier `poll()` / `wait()` saw them done
  (after a device-side assert every CUDA call raises, so only what was known before the fault can be used).
- Pinned host memory that served a non-blocking copy records a CUDA event when it is freed; after a CUDA error
  that record throws inside a destructor and the process aborts ("terminate called after throwing an instance
  of 'c10::AcceleratorError'"). `quarantine()` keeps such buffers alive until the process ends.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterable, Iterator

import torch


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct CUDA devices among `tensors`, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            seen.setdefault(tensor.device)
    return list(seen)


@contextlib.contextmanager
def on_device_of(tensor: torch.Tensor) -> Iterator[None]:
    """Makes `tensor`'s CUDA device the current one of this thread (a no-op for a CPU tensor): pinned buffers,
    events and copies made inside then belong to that device, not to device 0."""
    if tensor.is_cuda:
        with torch.cuda.device(tensor.device):
            yield
    else:
        yield


class DeviceFence:
    """One CUDA event on the current stream of each given device, recorded at construction: once the fence is
    passed, every copy or kernel queued on those streams before it has finished.

    Args:
        devices: the CUDA devices whose current streams are fenced (none: a fence that is passed at once).
    Example:
        >>> host.copy_(device_tensor, non_blocking=True)   # doctest: +SKIP
        >>> fence = DeviceFence([device_tensor.device])    # doctest: +SKIP
        >>> fence.wait()                                   # host now holds the bytes
    """

    def __init__(self, devices: Iterable[torch.device] = ()):
        self._events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)
        self.settled = not self._events
        """True once poll() or wait() saw every event complete; read without touching the device."""

    def poll(self) -> bool:
        """Whether every event has completed (a non-blocking query); remembered in `settled`."""
        if not self.settled and all(event.query() for event in self._events):
            self.settled = True
        return self.settled

    def wait(self) -> None:
        """Blocks until every event has completed (no blocking call when they have: one query each first)."""
        if not self.poll():
            for event in self._events:
                event.synchronize()
            self.settled = True


_QUARANTINED: list = []
_KEPT = False


def quarantine(objects: Iterable[object]) -> None:
    """Keeps `objects` (pinned buffers that served non-blocking copies, or containers of them) alive until the
    process ends, so that none is freed into a CUDA context a device-side assert has poisoned.

    Freeing pinned memory records an event on the streams it was copied on; after a CUDA error that raises in
    a destructor and the C++ runtime aborts the process, hiding the user's own exception. The list holding them
    gets one extra reference that is never dropped: interpreter shutdown does not free it either.
    """
    global _KEPT
    _QUARANTINED.extend(objects)
    if not _KEPT:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_QUARANTINED))
        _KEPT = True
