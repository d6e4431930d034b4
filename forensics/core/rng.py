"""Every RNG a training step draws from (python, numpy, torch CPU, each CUDA device): capture and restore."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from forensics.core import thirdparty

try:  # numpy is optional for the job; its RNG is captured when it is importable
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch wheels in practice
    np = None  # type: ignore[assignment]  # numpy is optional


MAX_CUDA_DEVICES = 1024  # CUDA RNG states a dump may claim per micro-batch


@dataclass
class RngState:
    python: Any
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] = field(default_factory=list)
    numpy: tuple | None = None

    def to_parts(self, prefix: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """Splits into a JSON-able dict and tensors keyed under `prefix` (docs/DUMP_FORMAT.md)."""
        version, internal, gauss = self.python
        meta: dict[str, Any] = {
            "python": [version, list(internal), gauss],
            "cuda_devices": len(self.cuda),
            "numpy": None,
        }
        tensors = {f"{prefix}/torch_cpu": self.torch_cpu}
        for device, state in enumerate(self.cuda):
            tensors[f"{prefix}/cuda/{device}"] = state
        if self.numpy is not None:
            name, keys, pos, has_gauss, cached = self.numpy
            meta["numpy"] = {
                "name": name,
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
            tensors[f"{prefix}/numpy_keys"] = torch.from_numpy(keys.astype("uint32").view("int32").copy())
        return meta, tensors

    @classmethod
    def from_parts(cls, meta: dict, tensors: dict[str, torch.Tensor], prefix: str) -> "RngState":
        version, internal, gauss = meta["python"]
        numpy_state = None
        if meta.get("numpy") and np is not None:
            n = meta["numpy"]
            keys = tensors[f"{prefix}/numpy_keys"].numpy().view("uint32")
            numpy_state = (n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"])
        devices = meta.get("cuda_devices", 0)
        if not isinstance(devices, int) or not 0 <= devices <= MAX_CUDA_DEVICES:
            raise ValueError(f"cuda_devices must be an integer in [0, {MAX_CUDA_DEVICES}], got {devices!r}")
        cuda = [tensors[f"{prefix}/cuda/{d}"] for d in range(devices)]
        state = cls(
            python=(version, tuple(internal), gauss),
            torch_cpu=tensors[f"{prefix}/torch_cpu"],
            cuda=cuda,
            numpy=numpy_state,
        )
        state.validate()
        return state

    def validate(self) -> None:
        """Raises TypeError / ValueError / RuntimeError unless every part would restore: each is tried on a
        throwaway generator (a state read from a dump is untrusted)."""
        random.Random().setstate(self.python)
        torch.Generator().set_state(self.torch_cpu)
        if self.numpy is not None and np is not None:
            np.random.RandomState().set_state(self.numpy)
        for state in self.cuda:
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
                raise ValueError("a CUDA RNG state must be a 1-D uint8 tensor")


def _numpy_state() -> tuple | None:
    """numpy's global legacy state, (name, keys, pos, has_gauss, cached_gaussian); None without numpy."""
    return cast(tuple, np.random.get_state()) if np is not None else None  # the stubs' overload says dict


def capture_rng() -> RngState:
    """Snapshot of every RNG; CUDA states only when CUDA is already initialised (never initialises it)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return RngState(
        python=random.getstate(),
        torch_cpu=torch.get_rng_state(),
        cuda=cuda,
        numpy=_numpy_state(),
    )


class RngCapture:
    """`capture_rng` for a hot path (the Guard's record_batch, once per micro-batch): the Python and numpy states,
    ~30 and ~150 us to copy on a CPU, are copied only when their generator drew since the last capture, told by a
    compare of its raw bytes (forensics/core/thirdparty.py: ~2 us); otherwise the last capture's are shared (they are
    never changed in place). Exact: a generator whose raw bytes cannot be read, or that holds a cached Gaussian
    (numpy's legacy `has_gauss`, which a draw can consume without touching the raw bytes), is copied every time;
    Python's `gauss_next` is compared as well. The torch states (a few bytes, ~2 us) are taken every time, straight
    from the generators: the CUDA ones (`torch.cuda.default_generators`, one per visible device, what
    `torch.cuda.get_rng_state_all` reads) are looked up once CUDA is initialised, not per device and call."""

    def __init__(self):
        self._last: RngState | None = None
        self._python_raw: tuple[bytes, Any] | None = None
        self._numpy_raw: bytes | None = None
        self._cuda_generators: tuple[torch.Generator, ...] | None = None  # set once CUDA is initialised

    def __call__(self) -> RngState:
        last = self._last
        generator = random.getstate.__self__  # type: ignore[attr-defined]  # the module's shared random.Random
        python_raw = thirdparty.python_random_raw(generator)
        python_key = None if python_raw is None else (python_raw, generator.gauss_next)
        if last is not None and python_key is not None and python_key == self._python_raw:
            python = last.python
        else:
            python = random.getstate()
        numpy_state = None
        numpy_raw = thirdparty.numpy_mt19937_raw(thirdparty.numpy_global_bit_generator()) if np is not None else None
        if (
            last is not None
            and last.numpy is not None
            and numpy_raw is not None
            and numpy_raw == self._numpy_raw
            and not last.numpy[3]
        ):  # has_gauss: a cached Gaussian may be gone with the same raw bytes
            numpy_state = last.numpy
        else:
            numpy_state = _numpy_state()
        generators = self._cuda_generators
        if generators is None and torch.cuda.is_initialized():  # (initialised implies available)
            generators = self._cuda_generators = tuple(torch.cuda.default_generators)  # CUDA never un-initialises
        cuda = [generator.get_state() for generator in generators] if generators else []
        self._last = RngState(
            python=python, torch_cpu=torch.default_generator.get_state(), cuda=cuda, numpy=numpy_state
        )
        self._python_raw, self._numpy_raw = python_key, numpy_raw
        return self._last


def restore_rng(state: RngState, source_device: int | None = None, target_device: int | None = None) -> None:
    """Puts every RNG back.

    Args:
        state: what `capture_rng` returned.
        source_device / target_device: replay on one GPU: put the captured state of CUDA device
            `source_device` (the job's local rank) onto `target_device`. Without them every captured
            CUDA state goes back onto the device of the same index that exists here.
    """
    random.setstate(state.python)
    torch.set_rng_state(state.torch_cpu)
    if state.numpy is not None and np is not None:
        np.random.set_state(state.numpy)
    if not state.cuda or not torch.cuda.is_available():
        return
    for captured, device in cuda_rng_targets(len(state.cuda), torch.cuda.device_count(), source_device, target_device):
        torch.cuda.set_rng_state(state.cuda[captured], device)


def cuda_rng_targets(
    captured: int, devices_here: int, source_device: int | None = None, target_device: int | None = None
) -> list[tuple[int, int]]:
    """Which captured CUDA state `restore_rng` puts onto which device here: (captured index, device) pairs.

    Args:
        captured: the CUDA states the dump holds (the job's visible devices).
        devices_here: the CUDA devices of this machine.
        source_device / target_device: as `restore_rng`'s; given both, only that one state moves (none when the
            job captured no state for `source_device`).

    Example: rank 3 of a 4-GPU node replayed on one GPU: `cuda_rng_targets(4, 1, 3, 0) == [(3, 0)]`.
    """
    if source_device is not None and target_device is not None:
        return [(source_device, target_device)] if 0 <= source_device < captured else []
    return [(device, device) for device in range(min(captured, devices_here))]
