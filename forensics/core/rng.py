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


@dataclass(slots=True)  # (no per-instance dict: one is made per micro-batch on the hot path)
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
    """`capture_rng` for a hot path (the Guard's record_batch, once per micro-batch, right after a backward: cold
    caches). Each part of the last capture is shared when its generator did not change since, told without copying
    its state:
    - Python and numpy (~30 and ~150 us to copy on a CPU): their raw state (2,500 bytes each) compared in place with
      the bytes kept at the last copy (forensics/core/thirdparty.py `raw_view` / `same_raw`: one memcmp over the
      generator's memory, no 2,500-byte copy per call; Python's index comes first, so a draw since is told at the
      first word). Exact: a generator whose raw bytes cannot be read, or that holds a cached Gaussian (numpy's
      legacy `has_gauss`, which a draw can consume without touching the raw bytes), is copied every time; Python's
      `gauss_next` is compared as well. numpy's generator is read from its global RandomState (one attribute, where
      `np.random.get_bit_generator()` is a call).
    - CUDA, one state per visible device (`torch.cuda.default_generators`, what `torch.cuda.get_rng_state_all`
      reads; looked up once CUDA is initialised): its (seed, offset) read as two integers (`thirdparty.cuda_rng_key`,
      checked once per process to be all that get_state() holds); the last state tensor is shared while they are
      unchanged, so no tensor is made for a device nothing drew from.
    The torch CPU state (a 5,056-byte tensor, no cheaper exact test) is taken every time."""

    def __init__(self) -> None:
        self._last: RngState | None = None
        self._python: tuple[random.Random | None, Any] = (None, None)  # (generator, raw view) of the last look
        self._python_raw: bytes | None = None  # the raw bytes at the last copy (None: copy next time)
        self._python_gauss: Any = None
        self._numpy_global: Any = thirdparty.numpy_global_random_state() if np is not None else None
        self._numpy: tuple[Any, Any] = (None, None)  # (bit generator, raw view) of the last look
        self._numpy_raw: bytes | None = None
        self._cuda_generators: tuple[torch.Generator, ...] | None = None  # set once CUDA is initialised
        self._cuda_keys: list[tuple[int, int] | None] = []  # each device's (seed, offset) at the last capture

    def __call__(self) -> RngState:
        # one flat function: right after a backward every further Python call is a few microseconds of cold code
        last = self._last
        generator = random.getstate.__self__  # type: ignore[attr-defined]  # the module's shared random.Random
        if self._python[0] is not generator:
            self._python, self._python_raw = (generator, thirdparty.raw_view(generator)), None
        gauss, held = generator.gauss_next, self._python_raw  # held: bytes of this view (the same length)
        if last is not None and held is not None and gauss == self._python_gauss and held.startswith(self._python[1]):
            python = last.python  # (thirdparty.same_raw, inline)
        else:
            view = self._python[1]
            self._python_raw, self._python_gauss = (bytes(view) if view is not None else None), gauss
            python = random.getstate()
        numpy_state = None
        if self._numpy_global is not None:
            bit_generator = self._numpy_global._bit_generator
            if self._numpy[0] is not bit_generator:
                self._numpy, self._numpy_raw = (bit_generator, thirdparty.raw_view(bit_generator)), None
            view, held = self._numpy[1], self._numpy_raw
            if (
                last is not None
                and held is not None
                and last.numpy is not None
                and held.startswith(view)
                and not last.numpy[3]  # has_gauss: a cached Gaussian may be gone with the same raw bytes
            ):
                numpy_state = last.numpy
            else:  # (no view: not an MT19937, whose get_state() is not the legacy tuple: copied every time)
                self._numpy_raw = bytes(view) if view is not None else None
                numpy_state = _numpy_state()
        generators = self._cuda_generators
        if generators is None and torch.cuda.is_initialized():  # (initialised implies available)
            generators = self._cuda_generators = tuple(torch.cuda.default_generators)  # CUDA never un-initialises
        cuda = self._cuda_states(generators, last) if generators else []
        self._last = RngState(python, torch.default_generator.get_state(), cuda, numpy_state)
        return self._last

    def _cuda_states(self, generators: tuple[torch.Generator, ...], last: RngState | None) -> list[torch.Tensor]:
        keys = [thirdparty.cuda_rng_key(generator) for generator in generators]
        previous = last.cuda if last is not None and len(last.cuda) == len(generators) else None
        known = self._cuda_keys
        self._cuda_keys = keys
        if previous is None or len(known) != len(keys):
            return [generator.get_state() for generator in generators]
        return [
            previous[index] if key is not None and key == known[index] else generator.get_state()
            for index, (generator, key) in enumerate(zip(generators, keys))
        ]


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
