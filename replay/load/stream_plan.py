"""Load, streamed: a model whose state does not fit the replay device, its repeated blocks left in the dump.

`plan_streaming` decides, before anything is read, whether the step's state fits the budget (`--memory-budget`, or the
device's free memory on a GPU): it needs the weights and their gradients on the device at once, plus room for the
activations (STATE_FACTOR, ACTIVATION_SHARE). When it does not, the model's largest `nn.ModuleList` (a
transformer's layers) is streamed: `keep_blocks_at_rest` wraps the dump's tensor stream so that each block
parameter is read once (its shape and dtype checked by the session's `stream_weights`, its finiteness noted) and
replaced by a one-element placeholder expanded to its shape (`at_rest`): the Parameter object, its name, shape and
dtype stay, so hooks, optimizers and reports see the model they expect, and no memory is held. Everything outside
the blocks (embeddings, final norm, head, buffers) is resident as in a normal replay. replay/run/streamed_runner.py
materialises the blocks' weights again from the dump, a few at a time, while the step runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator, cast

import torch

from forensics.core.errors import ReplayError
from forensics.format.tensors import tensor_bytes
from forensics.core.sizes import words
from forensics.replay.load.fsdp_precision import FsdpUnit, parameter_units
from forensics.replay.load.host_cache import HostBlockCache

STATE_FACTOR = 2
"""A normal replay holds every weight and its gradient on the device at once (the 7B FSDP2 replay: 27 GB of
weights, 51.7 GiB peak): the state fits when STATE_FACTOR x its bytes and the activations fit the budget."""
ACTIVATION_SHARE = 0.25
"""Share of the budget left for activations, the saved block inputs and the allocator's slack."""
MIN_RESIDENT_BLOCKS = 1


@dataclass(frozen=True)
class Block:
    """One streamed block: a child of the model's largest nn.ModuleList."""

    name: str
    params: tuple[str, ...]
    """Its parameters' names (first names; parameters tied to something outside the block stay resident)."""
    nbytes: int


@dataclass
class StreamPlan:
    """How a replay streams a model that does not fit: printed before the replay (`describe`), kept in the report."""

    budget: int
    """Bytes the replay may use on its device (--memory-budget, or the GPU's free memory)."""
    reason: str
    blocks: list[Block]
    resident_bytes: int
    """Weights and buffers outside the blocks: on the device for the whole replay."""
    state_bytes: int
    """Weights and buffers of the whole model, as the factory builds them (the dump's dtypes once loaded)."""
    resident_blocks: int = 1
    """K: at most this many blocks' weights are materialised at once in the dtype the step computes in (read-ahead
    counts as one of them); they stay on the device from one pass to the next (replay/run/stream_blocks.py)."""
    room: int = 0
    """Bytes for materialised blocks: what the budget leaves beside the resident part, its gradients and the
    activations' share. One block's worth of it is kept for the gradients of the block whose backward runs."""
    compute_bytes: int | None = None
    """The largest block's bytes in the dtype the step computes in (FSDP2's param_dtype: bf16 blocks of fp32 master
    weights take half their bytes in the dump); None: as in the dump."""
    fp32_bytes: int = 0
    """The largest block's bytes with its floating-point weights in fp32."""
    fp32_blocks: int = 1
    """K of the fp32 re-run (its blocks take fp32 bytes)."""
    read_ahead: bool = False
    """The next block is read while this one computes (K >= 2)."""
    read_seconds: float | None = None
    """Time the load took to read the blocks once (measured): the estimate of one streamed pass's reads."""
    nonfinite: list[str] = field(default_factory=list)
    """Block parameters already holding NaN/Inf in the dump (seen while they were read)."""
    at_rest: dict[str, torch.dtype] = field(default_factory=dict)
    """Each streamed parameter's dtype in the dump."""
    allocator: str = ""
    """What the CUDA caching allocator was set to for the replay (replay/load/allocator.py), in words."""
    allocator_set: bool = False
    """The replay set the allocator's segments (its default is set back when the replay ends)."""
    cache: HostBlockCache | None = field(default=None, repr=False, compare=False)
    """The blocks' dump values kept in host memory (replay/load/host_cache.py): filled while the load reads them,
    so the passes copy them to the device instead of reading the dump again; None: every pass reads the dump."""

    @property
    def block_bytes(self) -> int:
        return max((b.nbytes for b in self.blocks), default=0)

    @property
    def materialised_bytes(self) -> int:
        """A block's bytes as the normal passes materialise it."""
        return self.compute_bytes if self.compute_bytes is not None else self.block_bytes

    def blocks_fitting(self, block_bytes: int) -> int:
        """How many blocks of `block_bytes` may be materialised at once (0: not one)."""
        count = int(self.room // max(block_bytes, 1)) - 1 if self.room > 0 else 0
        return max(0, min(count, len(self.blocks)))

    @property
    def streamed_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def as_dict(self) -> dict:
        """The report's `stream` block."""
        return {
            "budget_bytes": self.budget,
            "reason": self.reason,
            "state_bytes": self.state_bytes,
            "resident_bytes": self.resident_bytes,
            "blocks": len(self.blocks),
            "block_bytes": self.block_bytes,
            "blocks_resident": self.resident_blocks,
            "block_bytes_materialised": self.materialised_bytes,
            "blocks_resident_fp32": self.fp32_blocks,
            "read_ahead": self.read_ahead,
            "read_seconds": self.read_seconds,
        }

    def describe(self, expected_passes: int | None = None, micro_batches: int = 1, together: bool = False) -> list[str]:
        """The plan in words, one line each. `together`: a pass's micro-batches run together (the block-major
        schedule: two walks a pass, not two a micro-batch)."""
        materialised = (
            f" ({words(self.materialised_bytes)} each as the step computes)"
            if self.materialised_bytes != self.block_bytes
            else ""
        )
        lines = [
            f"streamed replay: {self.reason}",
            f"  state {words(self.state_bytes)}; budget {words(self.budget)}; resident outside the blocks "
            f"{words(self.resident_bytes)}",
            f"  {len(self.blocks)} blocks of up to {words(self.block_bytes)} in the dump{materialised}; at most "
            f"{self.resident_blocks} materialised at once, kept from pass to pass "
            f"({'the next one read ahead' if self.read_ahead else 'no read-ahead'}; fp32 re-run: "
            f"{self.fp32_blocks})",
        ]
        if self.cache is not None:
            lines.append(self.cache.describe(self.streamed_bytes))
        if self.allocator:
            lines.append(f"  {self.allocator}")
        if expected_passes is not None:
            reads = self.expected_reads(expected_passes, 1 if together else micro_batches)
            per = ""
            cached = self.cache is not None and all(n in self.cache for b in self.blocks for n in b.params)
            if cached:
                per = ", each copied from the host cache, none read from the dump again"
            elif self.read_seconds is not None and self.blocks:
                per = (
                    f", up to {reads * self.read_seconds / len(self.blocks):.0f} s of reads (the load read the "
                    f"blocks in {self.read_seconds:.1f} s)"
                )
            lines.append(
                f"  expected about {expected_passes} passes over the step, up to about {reads} block reads{per}"
            )
        return lines

    def expected_reads(self, passes: int, micro_batches: int = 1) -> int:
        """Block reads of `passes` forward+backward passes: the first reads every block; then each micro-batch's
        forward finds the first K blocks still materialised (the last backward's) and reads the others, and its
        backward finds the last K (the forward's) and reads the others again: 2 (n - K) each. The fp32 re-run of a
        step that computes in a lower precision reads every block once more."""
        n, k = len(self.blocks), self.resident_blocks
        fp32 = n if self.compute_bytes is not None else 0
        if k >= n:
            return n + fp32
        return n + fp32 + (passes * max(1, micro_batches) * 2 - 1) * (n - k)


def streamable_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The children of the model's nn.ModuleList holding the most parameters (a transformer's layers).

    Raises:
        ReplayError: the model has no list of at least two blocks with parameters.
    """
    best, best_count = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        count = sum(p.numel() for p in module.parameters())
        if count > best_count:
            best, best_count = name, count
    if best is None:
        raise ReplayError(
            "this model cannot be streamed: it has no nn.ModuleList of at least two blocks with "
            "parameters (streaming keeps the blocks in the dump). Replay it without --memory-budget, on "
            "a device it fits"
        )
    modules = cast(torch.nn.ModuleList, model.get_submodule(best))  # the nn.ModuleList found above
    return [
        (f"{best}.{i}" if best else str(i), child)
        for i, child in enumerate(modules)
        if any(True for _ in child.parameters())
    ]


def plan_streaming(model: torch.nn.Module, device: torch.device, budget: int | None) -> StreamPlan | None:
    """The plan for a model built with meta parameters, or None when its state fits `budget` (or, without one, the
    free memory of a CUDA device; the CPU without a budget is never streamed).

    Raises:
        ReplayError: the budget cannot hold the resident part and one block.
    """
    reason = None
    state = sum(tensor_bytes(p) for p in model.parameters()) + sum(tensor_bytes(b) for b in model.buffers())
    if budget is None:
        if device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free)
        reason = f"the state ({words(state)}) does not fit the free memory of {device} ({words(free)})"
    need = STATE_FACTOR * state / (1 - ACTIVATION_SHARE)
    if need <= budget:
        return None
    reason = (
        reason
        or f"the state ({words(state)}: about {words(need)} with gradients and activations) does not "
        f"fit the budget of {words(budget)}"
    )
    found = streamable_blocks(model)
    outside = {
        id(p)
        for name, p in model.named_parameters(remove_duplicate=False)
        if not any(name.startswith(b + ".") for b, _ in found)
    }
    blocks = []
    for name, module in found:
        params = tuple(f"{name}.{n}" for n, p in module.named_parameters() if id(p) not in outside)
        blocks.append(Block(name, params, sum(tensor_bytes(p) for p in module.parameters() if id(p) not in outside)))
    streamed = {id(model.get_parameter(n)) for b in blocks for n in b.params}
    resident = state - sum(tensor_bytes(p) for p in model.parameters() if id(p) in streamed)
    plan = StreamPlan(budget=budget, reason=reason, blocks=blocks, resident_bytes=resident, state_bytes=state)
    plan.fp32_bytes = max(
        _block_bytes(model, b, lambda p: torch.float32 if p.is_floating_point() else p.dtype) for b in blocks
    )
    fit_blocks(plan)
    return plan


def fit_blocks(plan: StreamPlan) -> None:
    """Sets the room for blocks, K (resident_blocks, from the blocks' bytes in the dtype the step computes in; again
    once the load measured the dump's own dtypes) and read-ahead.

    The budget holds: the resident part and its gradients (STATE_FACTOR x), the activations' share, and K blocks'
    weights plus one block's worth for the gradients of the block whose backward runs (they leave the device when it
    is over: replay/run/stream_blocks.GradStore). The budget must hold one block in fp32 (the fp32 re-run).

    Raises:
        ReplayError: the resident part and one block do not fit.
    """
    plan.room = int(plan.budget * (1 - ACTIVATION_SHARE) - STATE_FACTOR * plan.resident_bytes)
    fp32 = max(plan.block_bytes, plan.fp32_bytes)
    plan.fp32_blocks = plan.blocks_fitting(fp32)
    count = min(plan.blocks_fitting(plan.materialised_bytes), len(plan.blocks))
    if count < MIN_RESIDENT_BLOCKS or plan.fp32_blocks < MIN_RESIDENT_BLOCKS:
        least = (STATE_FACTOR * (plan.resident_bytes + fp32)) / (1 - ACTIVATION_SHARE)
        raise ReplayError(
            f"a budget of {words(plan.budget)} cannot replay this model even streamed: the part outside "
            f"its blocks needs {words(plan.resident_bytes)} and one block {words(fp32)}, "
            f"with their gradients and room for activations at least {words(least)}; give "
            f"--memory-budget {_rounded_up(least)} or more"
        )
    plan.resident_blocks = count
    plan.read_ahead = plan.resident_blocks >= 2


def _rounded_up(nbytes: float) -> str:
    """A size as --memory-budget takes it, rounded up: 17GiB, 166KiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{math.ceil(nbytes / size)}{unit}"
    return str(math.ceil(nbytes))


def at_rest(tensor: torch.Tensor) -> torch.Tensor:
    """A placeholder of `tensor`'s shape, dtype and device holding one element (stride 0): what a streamed parameter
    holds while its block is not materialised."""
    return torch.zeros((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


def keep_blocks_at_rest(
    tensors: Iterator[tuple[str, torch.Tensor]], plan: StreamPlan, model: torch.nn.Module
) -> Iterator[tuple[str, torch.Tensor]]:
    """The dump's tensor stream with every block parameter replaced by its placeholder once read (its dtype, bytes
    and finiteness noted in `plan`, its value kept in `plan.cache` while it has room); the time the blocks' reads
    took goes to `plan.read_seconds`.

    Nothing here waits for the device: each tensor's finiteness is a flag computed where it lies, all of them read
    once the stream is through, and the cache's copy runs on its own stream (replay/load/host_cache.py); the reads of
    the next tensors go on meanwhile."""
    first_name: dict[int, str] = {}
    aliases = {name: first_name.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}
    streamed = {n for b in plan.blocks for n in b.params}
    sizes: dict[str, int] = {}
    flags: list[tuple[str, torch.Tensor]] = []
    spent, mark = 0.0, time.perf_counter()
    for key, tensor in tensors:
        first = aliases.get(key, key)
        now = time.perf_counter()
        if first in streamed:
            spent += now - mark
            plan.at_rest[first] = tensor.dtype
            sizes[first] = tensor_bytes(tensor)
            if tensor.is_floating_point():
                flags.append((first, torch.isfinite(tensor).all()))
            if plan.cache is not None:
                plan.cache.offer(first, tensor)
            tensor = at_rest(tensor)
        yield key, tensor
        mark = time.perf_counter()
    if flags:  # one wait for all of them, in the order they were read
        finite = torch.stack([flag for _, flag in flags]).cpu().tolist()
        plan.nonfinite.extend(name for (name, _), ok in zip(flags, finite) if not ok)
    if plan.cache is not None:
        plan.cache.settle()
    if sizes:  # the dump's own dtypes: bf16 weights of a model the factory builds in fp32 take half
        plan.blocks = [Block(b.name, b.params, sum(sizes.get(n, 0) for n in b.params)) for b in plan.blocks]
        plan.read_seconds = spent


def _block_bytes(model: torch.nn.Module, block: Block, dtype_of) -> int:
    total = 0
    for name in block.params:
        param = model.get_parameter(name)
        total += param.numel() * torch.empty((), dtype=dtype_of(param)).element_size()
    return total


def compute_dtypes(model: torch.nn.Module, plan: StreamPlan, units: list[FsdpUnit] | None) -> dict[str, torch.dtype]:
    """{streamed parameter: the dtype the job's passes compute it in} where that is not its own: FSDP2's param_dtype
    of the innermost unit holding it (`units`), for floating-point parameters (as StreamedStepRunner casts them)."""
    owner = parameter_units(model, units or [])
    out = {}
    for name in (n for b in plan.blocks for n in b.params):
        param = model.get_parameter(name)
        unit = owner.get(id(param))
        if unit is not None and unit.param_dtype is not None and param.is_floating_point():
            out[name] = unit.param_dtype
    return out


def cache_bytes(
    model: torch.nn.Module, plan: StreamPlan, keep: dict[str, torch.dtype], only: set[str] | None = None
) -> int:
    """The streamed parameters' bytes (those in `only`, when given) in `keep`'s dtypes (their own elsewhere): what a
    host cache of them takes."""
    total = 0
    for name in (n for b in plan.blocks for n in b.params if only is None or n in only):
        param = model.get_parameter(name)
        total += param.numel() * torch.empty((), dtype=keep.get(name, param.dtype)).element_size()
    return total


def settle(plan: StreamPlan, model: torch.nn.Module, units: list[FsdpUnit] | None = None) -> None:
    """Once the model is loaded: the plan's bytes as the dump's dtypes make them and as the step computes in them
    (the job's FSDP2 param_dtype, `units`), K fitted to them again.

    Raises:
        ReplayError: the resident part and one block do not fit the budget.
    """
    streamed = {n for b in plan.blocks for n in b.params}
    seen: set[int] = set()
    resident = 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in streamed and id(tensor) not in seen:
            seen.add(id(tensor))
            resident += tensor_bytes(tensor)
    plan.resident_bytes, plan.state_bytes = resident, resident + plan.streamed_bytes
    dtypes = compute_dtypes(model, plan, units)
    names = {id(p): n for n, p in model.named_parameters()}

    def computes_in(param: torch.Tensor) -> torch.dtype:
        return dtypes.get(names.get(id(param), ""), param.dtype)

    if plan.blocks:
        plan.fp32_bytes = max(
            _block_bytes(model, b, lambda p: torch.float32 if p.is_floating_point() else p.dtype) for b in plan.blocks
        )
        computed = max(_block_bytes(model, b, computes_in) for b in plan.blocks)
        plan.compute_bytes = computed if computed != plan.block_bytes else None
    fit_blocks(plan)


__all__ = [
    "StreamPlan",
    "Block",
    "plan_streaming",
    "keep_blocks_at_rest",
    "streamable_blocks",
    "fit_blocks",
    "at_rest",
    "settle",
    "compute_dtypes",
    "cache_bytes",
    "STATE_FACTOR",
    "ACTIVATION_SHARE",
]
