"""Digests of a step's computation for the silent-corruption checks, shared by the job and the replay.

A *digest* of a tensor is the sum, modulo 2**64, of its elements' bit patterns (read as integers) times odd weights
that depend on their position (1, 3, 5, ...; `tensor_digest`): computed on the tensor's device, exact in integer
arithmetic (the same number on any device and in any reduction order), order-sensitive, and changed by any single
flipped bit (an odd weight times a power of two is never 0 modulo a power of two). Beside it, the float64 sum of the values, which a replay on
another kind of device (a CPU replay of a GPU job) compares within a tolerance where bits cannot agree.

A *computation* (`Computation`) is one run of a step's forward and backward as the silent check saw it: per
micro-batch the loss, each module call's output in the order the forward made them, and each parameter's gradient
in the order the backward produced them. `first_difference` says where two computations part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from forensics.core.kinds import Phase

CHUNK = 1 << 22
"""Elements digested at once: the temporaries of a digest stay at 16 MiB per chunk, whatever the tensor."""
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (bit patterns), flattened; 8- and 16-bit ones widened to
    int32 (a product of them with an odd int32 weight still changes with any single bit)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    elif flat.is_floating_point():
        flat = flat.view(_INT_VIEW[flat.element_size()])
    return flat if flat.dtype in (torch.int32, torch.int64) else flat.to(torch.int32)


def _odd_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """1, 3, 5, ... (CHUNK of them) on `device`, made once per device and dtype."""
    key = (device, dtype)
    if key not in _weights:
        _weights[key] = torch.arange(1, 2 * CHUNK, 2, dtype=dtype, device=device)
    return _weights[key]


def tensor_digest(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(digest, float64 sum) of `tensor`, as 0-dim tensors on its device (nothing read on the host).

    Within a chunk each element's bit pattern is multiplied by its odd weight in the pattern's own width (int32 or
    int64, wrapping), the products summed in int64; chunk c's sum is weighted by 2c + 1. A single flipped bit b of an
    element changes its product by an odd multiple of 2**b, never 0 in that width: the digest changes."""
    bits = _bits(tensor)
    digest = torch.zeros((), dtype=torch.int64, device=bits.device)
    total = torch.zeros((), dtype=torch.float64, device=bits.device)
    flat = tensor.detach().reshape(-1)
    weights = _odd_weights(bits.device, bits.dtype)
    for chunk, start in enumerate(range(0, bits.numel(), CHUNK)):
        part = bits[start : start + CHUNK]
        digest = digest + (part * weights[: part.numel()]).sum(dtype=torch.int64) * (2 * chunk + 1)
        values = flat[start : start + CHUNK]
        if not values.is_complex():
            total = total + values.sum(dtype=torch.float64)
    return digest, total


def tree_digest(node: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The digest of every tensor in a module's output (a tensor, tuple, list, dict or dataclass-like object with
    tensors), folded in their order; None when it holds no tensor."""
    tensors = list(_tensors(node))
    if not tensors:
        return None
    digest, total = tensor_digest(tensors[0])
    for position, tensor in enumerate(tensors[1:], start=1):
        d, s = tensor_digest(tensor)
        digest, total = digest * 1000003 + d * (2 * position + 1), total + s
    return digest, total


def _tensors(node: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        yield node
    elif depth > 4:
        return
    elif isinstance(node, dict):
        for value in node.values():
            yield from _tensors(value, depth + 1)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _tensors(value, depth + 1)


@dataclass
class Computation:
    """One run of a step's forward and backward, as digests: what the job's run, its recompute and the replay each
    yield. Entries are `[name, digest, float64 sum]`; digests stay device tensors until `to_host()`."""

    losses: list[Any] = field(default_factory=list)
    """Per micro-batch: the loss's [digest, sum]."""
    outputs: list[list[list[Any]]] = field(default_factory=list)
    """Per micro-batch: [module name, digest, sum] for each module call, in the order the forward made them."""
    grads: list[list[list[Any]]] = field(default_factory=list)
    """Per micro-batch: [parameter name, digest, sum] for each gradient, in the order the backward made them."""

    def start_micro_batch(self) -> None:
        self.outputs.append([])
        self.grads.append([])

    def to_host(self) -> "Computation":
        """The same computation with every digest read to the host (one transfer per list)."""

        def read(rows: list[list[Any]]) -> list[list[Any]]:
            if not rows:
                return []
            stacked = torch.stack([r[1] for r in rows]).cpu().tolist(), torch.stack([r[2] for r in rows]).cpu()
            return [[r[0], int(d), float(s)] for r, d, s in zip(rows, stacked[0], stacked[1].tolist())]

        losses = read([["loss", d, s] for d, s in self.losses])
        return Computation(
            losses=[[d, s] for _, d, s in losses],
            outputs=[read(rows) for rows in self.outputs],
            grads=[read(rows) for rows in self.grads],
        )

    def as_dict(self) -> dict:
        return {"losses": self.losses, "outputs": self.outputs, "grads": self.grads}

    @classmethod
    def from_dict(cls, data: Any) -> "Computation":
        """A stored computation (a dump's `silent.json`), checked: entries that are not [str, int, float] rows are
        refused with ValueError."""
        if not isinstance(data, dict):
            raise ValueError("a computation must be an object")
        losses = [_pair(p) for p in _list(data.get("losses"))]
        outputs = [[_row(r) for r in _list(rows)] for rows in _list(data.get("outputs"))]
        grads = [[_row(r) for r in _list(rows)] for rows in _list(data.get("grads"))]
        return cls(losses=losses, outputs=outputs, grads=grads)


def _list(value: Any) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {type(value).__name__}")
    return value


def _pair(value: Any) -> list:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], int)):
        raise ValueError("a loss entry must be [digest, sum]")
    return [int(value[0]), _float(value[1])]


def _row(value: Any) -> list:
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str) and isinstance(value[1], int)):
        raise ValueError("a module or gradient entry must be [name, digest, sum]")
    return [value[0][:300], int(value[1]), _float(value[2])]


def _float(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    raise ValueError("a sum must be a number")


@dataclass(frozen=True)
class Difference:
    """Where two computations part: the first differing module output (forward order), else gradient (backward
    order), else loss, of the first micro-batch that differs."""

    micro_batch: int
    where: str
    """Phase.FORWARD (a module's output), Phase.BACKWARD (a gradient), 'loss', or 'shape' (the runs made different calls)."""
    name: str
    """The module or parameter name ('' for the loss)."""
    index: int
    """Position of the entry in its list (the module call, the gradient)."""


def first_difference(a: Computation, b: Computation, exact: bool = True, rtol: float = 0.0) -> Difference | None:
    """Where `a` and `b` part; None when they agree. `exact`: digests compared; else float64 sums within `rtol`
    (relative to the sum's magnitude), for computations on different kinds of devices."""

    def same(x: list, y: list) -> bool:
        if exact:
            return x[1] == y[1]
        return abs(x[2] - y[2]) <= rtol * max(abs(x[2]), abs(y[2]), 1e-30) or x[2] == y[2]

    for mb in range(max(len(a.outputs), len(b.outputs))):
        if mb >= len(a.outputs) or mb >= len(b.outputs):
            return Difference(mb, "shape", "", 0)
        for index, (x, y) in enumerate(zip(a.outputs[mb], b.outputs[mb])):
            if x[0] != y[0]:
                return Difference(mb, "shape", x[0], index)
            if not same(x, y):
                return Difference(mb, Phase.FORWARD, x[0], index)
        if len(a.outputs[mb]) != len(b.outputs[mb]):
            return Difference(mb, "shape", "", min(len(a.outputs[mb]), len(b.outputs[mb])))
        if mb < len(a.losses) and mb < len(b.losses) and not same(["", *a.losses[mb]], ["", *b.losses[mb]]):
            return Difference(mb, "loss", "", 0)
        by_name = {row[0]: row for row in (b.grads[mb] if mb < len(b.grads) else [])}
        for index, x in enumerate(a.grads[mb] if mb < len(a.grads) else []):
            other = by_name.get(x[0])
            if other is None:
                return Difference(mb, "shape", x[0], index)
            if not same(x, other):
                return Difference(mb, Phase.BACKWARD, x[0], index)
    return None


class Recorder:
    """Fills a Computation while a forward and backward run: a forward hook on every module (its output, in call
    order) and, with `grads`, a hook on every trainable parameter (its gradient for the micro-batch, before it is
    accumulated or reduced). `attach()` returns nothing to keep: `detach()` removes every hook."""

    def __init__(self, model: torch.nn.Module, grads: bool):
        self.model, self.grads = model, grads
        self.computation = Computation()
        self._handles: list[Any] = []
        self._hooked: list[torch.Tensor] = []

    def attach(self) -> Computation:
        self.detach()
        computation = self.computation = Computation()
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(_output_hook(computation, name or "(model)")))
        if self.grads:
            for name, param in self.model.named_parameters():
                if param.requires_grad:
                    self._handles.append(param.register_hook(_grad_hook(computation, name)))
                    self._hooked.append(param)
        return computation

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for param in self._hooked:  # an emptied hook dict stays wired into autograd and is called at every
            if not param._backward_hooks:  # backward (a Python call per parameter): unwire it, as before the step
                param._backward_hooks = None
        self._hooked.clear()


def _output_hook(computation: Computation, name: str) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        digest = tree_digest(output)
        if digest is not None and computation.outputs:
            computation.outputs[-1].append([name, *digest])

    return hook


def _grad_hook(computation: Computation, name: str) -> Any:
    def hook(grad: torch.Tensor) -> None:
        if computation.grads:
            computation.grads[-1].append([name, *tensor_digest(grad)])

    return hook


def run_computation(
    model: torch.nn.Module,
    loss_fn: Any,
    batches: list[Any],
    seeds: list[Any],
    autocast: dict | None,
    restore_rng: Any,
    backward: bool = True,
) -> Computation:
    """Runs each micro-batch's forward (`loss_fn(model, batch)`) and backward again, recording its digests, and
    returns the Computation. The backward is `torch.autograd.grad` seeded with `seeds[i]` (the gradient the job's
    own backward sent into micro-batch i's loss: its division and loss scale), so no parameter's `.grad` is
    touched. `restore_rng(i)` puts micro-batch i's RNG in place before its forward. `backward` False: the forward only,
    without autograd (a sharded model, whose gradients this check does not compare)."""
    recorder = Recorder(model, grads=False)
    computation = recorder.attach()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    settings = autocast or {}
    try:
        for index, batch in enumerate(batches):
            restore_rng(index)
            computation.start_micro_batch()
            with (
                torch.autocast(
                    settings.get("device_type") or "cpu",
                    dtype=getattr(torch, str(settings.get("dtype") or "bfloat16")),
                    enabled=bool(settings.get("enabled")),
                ),
                torch.set_grad_enabled(backward),
            ):
                loss = loss_fn(model, batch)
            computation.losses.append(tensor_digest(loss))
            if not backward:
                continue
            seed = seeds[index] if index < len(seeds) else None
            seed = torch.as_tensor(1.0 if seed is None else seed, dtype=loss.dtype, device=loss.device)
            grads = torch.autograd.grad(loss, [p for _, p in params], grad_outputs=seed, allow_unused=True)
            for (name, _), grad in zip(params, grads):
                if grad is not None:
                    computation.grads[-1].append([name, *tensor_digest(grad)])
    finally:
        recorder.detach()
    return computation


def device_identity(device: torch.device | str | None) -> dict:
    """The device a computation ran on, as a drain list needs it: kind, name, UUID and PCI bus id (CUDA), host."""
    import socket

    device = torch.device(device if device is not None else "cpu")
    identity: dict[str, Any] = {"type": device.type, "index": device.index, "host": socket.gethostname()}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        identity.update(
            index=index,
            name=props.name,
            uuid=str(getattr(props, "uuid", "")) or None,
            pci_bus_id=_pci_bus_id(props),
        )
    else:  # a CPU's reductions split by thread: the same bits need the same thread count
        identity.update(name="cpu", threads=torch.get_num_threads())
    return identity


def _pci_bus_id(props: Any) -> str | None:
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


__all__ = [
    "CHUNK",
    "Computation",
    "Difference",
    "Recorder",
    "run_computation",
    "device_identity",
    "first_difference",
    "tensor_digest",
    "tree_digest",
]
