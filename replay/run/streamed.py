"""Run, streamed: the step of a model whose blocks stay in the dump, at most K blocks' weights materialised at once.

replay/load/streamed.py left each block parameter as a one-element placeholder. Here:

* `BlockStreamer` materialises a block's weights from the dump (the session's `pre_step_weights`: pread, or the
  rank dumps of a sharded one) when the block runs, into the same Parameter objects (`param.data` swapped), and
  keeps the last K blocks materialised (least recently used out first): the backward, which runs the blocks in
  reverse, finds the last ones still there. With K >= 2 the next block is read on a background thread while this
  one computes (replay/run/read_ahead.py).
* Each block's forward runs through `_StreamedBlock`, an autograd Function that keeps the block's inputs and
  recomputes the block for its backward (torch.utils.checkpoint's reentrant form, with the weights materialised for
  the recomputation, the forward's RNG and autocast state restored, and a point after the block's backward where
  its gradients are taken away): activations of one block at a time, weights of K.
* A block's gradients leave the device as soon as its backward is done: accumulated on the host across
  micro-batches (files in a temporary directory, mapped: page cache, not the process's own memory), measured (norm,
  finite) once the step's last micro-batch is through, and kept only when the caller wants to step the optimizer.
* `StreamedStepRunner` is the StepRunner over such a model: every stage of the engine runs through it unchanged,
  except where it reads gradients or weights itself (`gradients`, `own_grad_norms`, `clip_gradients`,
  `per_sample_rows`), which it answers block by block.

Why not FSDP2 on a world of one with CPUOffloadPolicy: it keeps the whole sharded model (and its gradients) in
pinned host memory, a second host copy of the model, which the dump already is; torch.utils.checkpoint alone cannot
materialise weights inside its recomputation nor say when a block's backward is over.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from forensics.errors import DumpCorruptError, ReplayError
from forensics.grad_norm import total_grad_norm
from replay.load.fsdp_precision import fsdp_compute, parameter_units
from replay.load.samples import SampleRef
from replay.load.session import ReplaySession
from replay.load.streamed import StreamPlan, at_rest
from replay.run.execute import StepRunner, any_nonfinite
from replay.run.read_ahead import BlockReader

logger = logging.getLogger(__name__)

_FORWARD = torch.nn.Linear.forward.__name__  # the method nn.Module.__call__ runs, overridden per block instance
STREAMED_PER_SAMPLE = 8
"""Streamed, each per-sample row is a pass over the whole model: culprits and at most this many rows."""


class BlockStreamer:
    """Materialises the streamed blocks' weights from the dump on demand, at most `plan.resident_blocks` at once."""

    def __init__(self, model: torch.nn.Module, plan: StreamPlan, read: Callable[..., Iterator[tuple[str, torch.Tensor]]],
                 device: torch.device):
        self.model, self.plan, self.device = model, plan, device
        self.modules = [model.get_submodule(b.name) for b in plan.blocks]
        self.params = {n: model.get_parameter(n) for b in plan.blocks for n in b.params}
        self.block_of = {n: i for i, b in enumerate(plan.blocks) for n in b.params}
        self.rest = {n: at_rest(p) for n, p in self.params.items()}
        self.capacity = plan.resident_blocks
        self.cache: OrderedDict[int, tuple[tuple, dict[str, torch.Tensor]]] = OrderedDict()
        self.reader = BlockReader(read, device, plan.read_ahead)
        self.peak = 0
        """Most blocks materialised at once (cached + being read ahead): never above `capacity`."""
        self.fp32 = False
        self.unit_dtype: dict[str, torch.dtype] = {}
        """FSDP2 mixed precision (StreamedStepRunner.job_precision): the dtype each parameter computes in."""
        self.reduce_dtype: dict[str, torch.dtype | None] = {}
        self.direction = 1
        self.scan_only = False
        """The pass runs no backward (runner): blocks are evicted most recently used first."""
        self.grads = GradStore()
        self.keep = False
        self.final = True
        self.inv_scale: torch.Tensor | None = None
        self.norms: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """This pass: each streamed parameter's gradient norm (in its dtype, as clip_grad_norm_ takes it; in fp32)."""
        self.nonfinite: set[str] = set()
        self.grad_factor = 1.0
        self.anchor = torch.empty(0, device=device, requires_grad=True)
        self.recompute_context: Callable[[int], ContextManager] | None = None
        """Set by a stage that watches the backward (replay/localize/forward_backward.localize_backward): entered
        around each block's recomputation, given the block's index."""
        self.after_recompute: Callable[[list[torch.Tensor]], None] | None = None
        """Called with a block's recomputed outputs before their backward runs."""
        self._forwards: list[tuple[torch.nn.Module, Any]] = []

    # -- hooks -----------------------------------------------------------------------------------
    def install(self) -> None:
        """Each block's forward goes through `_BlockCall` (an instance attribute: the module's hooks stay around it)."""
        for index, module in enumerate(self.modules):
            self._forwards.append((module, vars(module).get(_FORWARD)))
            module.forward = _BlockCall(self, index, module.forward)

    def remove(self) -> None:
        for module, own in self._forwards:
            if own is None:
                vars(module).pop(_FORWARD, None)
            else:
                module.forward = own
        self._forwards.clear()
        self.release_all()
        self.reader.close()
        self.grads.close()

    # -- materialising ---------------------------------------------------------------------------
    def _dtypes(self, index: int) -> tuple:
        """The dtype each parameter of block `index` computes in now."""
        return tuple(self.compute_dtype(n) for n in self.plan.blocks[index].params)

    def compute_dtype(self, name: str) -> torch.dtype:
        rest = self.rest[name].dtype
        if self.fp32 and rest.is_floating_point:
            return torch.float32
        return self.unit_dtype.get(name, rest)

    def acquire(self, index: int) -> None:
        """Block `index`'s weights materialised in its parameters (read from the dump unless still cached)."""
        key = self._dtypes(index)
        hit = self.cache.get(index)
        if hit is not None and hit[0] == key:
            if not self.scan_only:  # a scan keeps the order blocks came in: the first ones stay (_make_room)
                self.cache.move_to_end(index)
        else:
            if hit is not None:
                self._evict(index)
            tensors = self.reader.take(index, key)  # read ahead already, or None
            if tensors is None:
                self.reader.cancel()
                self._make_room(1, keep=None)
                tensors = self.reader.read(index, self._names(index, key))
                self._count(1)
            self._check(index, tensors)
            self.cache[index] = (key, tensors)
            for name, tensor in tensors.items():
                self.params[name].data = tensor
        self._read_ahead(index)

    def _names(self, index: int, key: tuple) -> dict[str, torch.dtype]:
        return dict(zip(self.plan.blocks[index].params, key))

    def _check(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.plan.blocks[index].params:
            tensor = tensors.get(name)
            if tensor is None or tuple(tensor.shape) != tuple(self.rest[name].shape):
                raise DumpCorruptError(f"the dump's weight {name!r} changed while it was replayed (missing or another "
                                       "shape on a second read)", "model.safetensors")

    def _read_ahead(self, index: int) -> None:
        if not self.plan.read_ahead:
            return
        nxt = index + self.direction
        if not 0 <= nxt < len(self.modules) or nxt in self.cache or self.reader.pending is not None:
            return
        self._make_room(1, keep=index)
        key = self._dtypes(nxt)
        self.reader.start(nxt, key, self._names(nxt, key))
        self._count(0)

    def _count(self, extra: int) -> None:
        self.peak = max(self.peak, len(self.cache) + extra + (1 if self.reader.pending is not None else 0))

    def _make_room(self, slots: int, keep: int | None) -> None:
        """Evicts blocks (never `keep`) until `slots` more fit beside the cache and the read-ahead: the least recently
        used when a backward follows (it runs the blocks in reverse: the forward's last ones are its first), else the
        most recently used (a forward-only pass scans the blocks in order, again for the next micro-batch and pass:
        the first ones stay)."""
        while self.cache and len(self.cache) + slots + (1 if self.reader.pending is not None else 0) > self.capacity:
            order = reversed(self.cache) if self.scan_only else iter(self.cache)
            victim = next((i for i in order if i != keep), None)
            if victim is None:
                break
            self._evict(victim)

    def _evict(self, index: int) -> None:
        self.cache.pop(index, None)
        for name in self.plan.blocks[index].params:
            param = self.params[name]
            param.grad = None
            param.data = self.rest[name]

    def release_all(self) -> None:
        for index in list(self.cache):
            self._evict(index)
        self.reader.cancel()

    # -- gradients -------------------------------------------------------------------------------
    def new_pass(self, keep: bool) -> None:
        self.grads.clear()
        self.norms.clear()
        self.nonfinite.clear()
        self.keep, self.grad_factor = keep, 1.0

    def block_backward_done(self, index: int) -> None:
        """Block `index`'s backward of one micro-batch is over: its gradients off the device (accumulated across
        micro-batches), measured once the pass's last micro-batch is through."""
        for name in self.plan.blocks[index].params:
            param = self.params[name]
            grad, param.grad = param.grad, None
            if grad is None:
                continue
            held = self.grads.pop(name)
            if held is not None:
                grad = held.to(grad.device) + grad  # the accumulation autograd does into .grad, in its dtype
            if self.final:
                self._finish(name, grad)
            else:
                self.grads.put(name, grad)

    def finish_pass(self) -> None:
        """Gradients still accumulating when the pass stopped early (an exception, anomaly mode's error)."""
        for name in list(self.grads.names()):
            if name not in self.norms:
                grad = self.grads.pop(name)
                self._finish(name, grad.to(self.device))

    def _finish(self, name: str, grad: torch.Tensor) -> None:
        rest = self.rest[name].dtype
        if name in self.reduce_dtype and grad.dtype != rest:  # FSDP2: reduced in reduce_dtype onto the fp32 weights
            grad = grad.to(self.reduce_dtype[name] or rest).to(rest)
        if self.inv_scale is not None:  # GradScaler.unscale_: times 1/scale in fp32
            grad = grad * self.inv_scale.to(grad.device)
        norm = torch._foreach_norm([grad], 2.0)[0] if hasattr(torch, "_foreach_norm") \
            else torch.linalg.vector_norm(grad, 2.0)
        self.norms[name] = (norm, torch.linalg.vector_norm(grad.float()))
        if any_nonfinite([grad])[0]:
            self.nonfinite.add(name)
        if self.keep:
            self.grads.put(name, grad, kept=True)


class GradStore:
    """Gradients off the device: accumulating across micro-batches, or kept for the optimizer check. Large ones
    live in files of a temporary directory mapped into memory (the page cache holds them, the kernel may write them
    out), small ones in ordinary memory."""

    FILE_MIN = 1 << 20

    def __init__(self, directory: str | None = None):
        self._directory = directory
        self._dir: str | None = None
        self._held: dict[str, torch.Tensor] = {}
        self.kept: set[str] = set()
        self._count = 0

    def _host(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if nbytes < self.FILE_MIN:
            return torch.empty(like.shape, dtype=like.dtype)
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="forensics-grads-", dir=self._directory)
            weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._count += 1
        path = os.path.join(self._dir, f"{self._count}.bin")
        tensor = torch.from_file(path, shared=True, size=like.numel(), dtype=like.dtype).view(like.shape)
        os.unlink(path)  # the mapping stays; the file goes with it
        return tensor

    def put(self, name: str, grad: torch.Tensor, kept: bool = False) -> None:
        host = self._host(grad)
        host.copy_(grad)
        self._held[name] = host
        if kept:
            self.kept.add(name)

    def pop(self, name: str) -> torch.Tensor | None:
        self.kept.discard(name)
        return self._held.pop(name, None)

    def get(self, name: str) -> torch.Tensor | None:
        return self._held.get(name)

    def names(self) -> list[str]:
        return list(self._held)

    def clear(self) -> None:
        self._held.clear()
        self.kept.clear()

    def close(self) -> None:
        self.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, True)
            self._dir = None


class _BlockCall:
    """A streamed block's forward: through `_StreamedBlock` when autograd records, straight otherwise."""

    def __init__(self, streamer: BlockStreamer, index: int, forward: Callable):
        self.streamer, self.index, self.forward = streamer, index, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            self.streamer.direction = 1
            self.streamer.acquire(self.index)
            return self.forward(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        box: dict[str, Any] = {}
        outputs = _StreamedBlock.apply(self, box, (leaves, spec, positions), self.streamer.anchor,
                                       *[leaves[i] for i in positions])
        out_leaves = list(box["leaves"])
        for position, tensor in zip(box["positions"], outputs):
            out_leaves[position] = tensor
        return tree_unflatten(out_leaves, box["spec"])

    def run(self, layout: tuple, tensors: tuple) -> Any:
        leaves, spec, positions = layout
        leaves = list(leaves)
        for position, tensor in zip(positions, tensors):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, spec)
        self.streamer.acquire(self.index)
        return self.forward(*args, **kwargs)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    """Whether autocast is on for `device_type`, and its dtype (what the recomputation enters again)."""
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # torch before the device_type arguments
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()


class _StreamedBlock(torch.autograd.Function):
    """One block: forward without saving its activations, recomputed (weights materialised again) for backward."""

    @staticmethod
    def forward(ctx, call: _BlockCall, box: dict, layout: tuple, anchor: torch.Tensor, *tensors: torch.Tensor):
        streamer = call.streamer
        ctx.call, ctx.layout = call, layout
        ctx.save_for_backward(*tensors)  # the block's inputs, kept where they are
        ctx.device_type = streamer.device.type
        ctx.autocast = _autocast_state(ctx.device_type)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(streamer.device) if streamer.device.type == "cuda" else None
        streamer.direction = 1
        out = call.run(layout, tensors)
        leaves, spec = tree_flatten(out)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        box.update(leaves=leaves, spec=spec, positions=positions)
        outputs = tuple(leaves[i] for i in positions)
        ctx.mark_non_differentiable(*[t for t in outputs if not (t.is_floating_point() or t.is_complex())])
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        call, streamer = ctx.call, ctx.call.streamer
        needs = ctx.needs_input_grad[4:]
        inputs = [t.detach().requires_grad_(need) if need else t.detach()
                  for t, need in zip(ctx.saved_tensors, needs)]
        devices = [streamer.device.index or 0] if ctx.cuda_rng is not None else []
        enabled, dtype = ctx.autocast
        streamer.direction = -1
        autocast = torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled) if dtype is not None \
            else contextlib.nullcontext()
        watch = streamer.recompute_context(call.index) if streamer.recompute_context is not None \
            else contextlib.nullcontext()
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), autocast, watch:
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, streamer.device)
            out = call.run(ctx.layout, tuple(inputs))
        leaves, _ = tree_flatten(out)
        outputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if streamer.after_recompute is not None:
            streamer.after_recompute(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        streamer.block_backward_done(call.index)
        return (None, None, None, None, *[t.grad if need else None for t, need in zip(inputs, needs)])


class StreamedStepRunner(StepRunner):
    """The StepRunner of a streamed session (ReplaySession.stream): the same passes, the blocks materialised a few at
    a time; the stages' own reads of gradients go through `gradients` / `own_grad_norms` / `clip_gradients`."""

    def __init__(self, session: ReplaySession):
        if session.stream is None or session.pre_step_weights is None:
            raise ReplayError("a streamed replay needs a session loaded from a dump with a stream plan")
        self.session, self.model, self.plan = session, session.model, session.stream
        for module in self.model.modules():  # a KV cache (Hugging Face) would grow again in each recomputation
            config = getattr(module, "config", None)
            if getattr(config, "use_cache", False):
                config.use_cache = False
        self.streamer = BlockStreamer(self.model, self.plan, session.pre_step_weights, session.device)
        self.streamer.install()
        self._streamed = set(self.streamer.params)
        self._reload = session.pre_step_weights
        self._initial = None
        self.param_names = [n for n, _ in self.model.named_parameters()]
        self._dtypes = {n: t.dtype for n, t in self._live_tensors()}
        resident = [(n, p) for n, p in self.model.named_parameters() if n not in self._streamed]
        flags = dict(zip([n for n, _ in resident], any_nonfinite(p.detach() for _, p in resident)))
        bad = set(self.plan.nonfinite) | {n for n, f in flags.items() if f}
        self.nonfinite_params = [n for n in self.param_names if n in bad]
        self.passes = 0
        self._untouched = session.loaded_weights
        self._warned_autocast = False
        self._warned_unrunnable = False
        self.last_grad_norm: float | None = None
        self._last = 0
        self._keep_next = False
        self._wanted = False
        weakref.finalize(self, self.streamer.remove)

    def close(self) -> None:
        """Puts the blocks' own forwards back and frees what the streamer holds."""
        self.streamer.remove()

    # -- the base runner's state, without the streamed parameters --------------------------------
    def _live_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in super()._live_tensors() if n not in self._streamed]

    def _stale(self, live: dict[str, torch.Tensor]) -> set[str]:
        return super()._stale({k: v for k, v in live.items() if k not in self._streamed})

    def reset(self) -> None:
        self.streamer.fp32 = False
        super().reset()
        self.streamer.new_pass(keep=self._keep_next)

    def _start_pass(self, fp32: bool) -> None:
        super()._start_pass(fp32)
        self.streamer.fp32 = fp32

    def job_precision(self, fp32: bool = False) -> ContextManager:
        if fp32 or not self.session.fsdp_units:
            return contextlib.nullcontext()
        return self._streamed_fsdp()

    @contextlib.contextmanager
    def _streamed_fsdp(self) -> Iterator[None]:
        """FSDP2's mixed precision with the blocks cast as they are materialised (replay/load/fsdp_precision.py)."""
        units = parameter_units(self.model, self.session.fsdp_units)
        streamer = self.streamer
        for name, param in streamer.params.items():
            unit = units.get(id(param))
            if unit is not None and unit.param_dtype is not None and param.is_floating_point():
                streamer.unit_dtype[name] = unit.param_dtype
                streamer.reduce_dtype[name] = unit.reduce_dtype
        try:
            with fsdp_compute(self.model, self.session.fsdp_units, skip={id(p) for p in streamer.params.values()}):
                yield
        finally:
            streamer.unit_dtype.clear()
            streamer.reduce_dtype.clear()

    # -- a pass ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def keeping_gradients(self) -> Iterator[None]:
        self._wanted = True
        try:
            yield
        finally:
            self._wanted = False

    def run(self, samples: list[SampleRef] | None = None, **kwargs: Any):
        # kept gradients (a pass's worth of bytes written to the host) only for a caller that steps the optimizer
        self._keep_next = bool(kwargs.get("keep_grads")) and self._wanted  # the base run() resets first
        try:
            result = super().run(samples, **kwargs)
        finally:
            self._keep_next = False
        self.last_grad_norm = result.grad_norm
        return result

    def _run_micro_batches(self, selected, scale, options):
        self._last = max(selected) if selected else len(self.session.micro_batches) - 1
        self.streamer.inv_scale = None if scale is None else scale.double().reciprocal().float()
        self.streamer.scan_only = not options.backward
        return super()._run_micro_batches(selected, scale, options)

    def _run_micro_batch(self, i, indices, scale, options, done) -> bool:
        self.streamer.final = i == self._last
        return super()._run_micro_batch(i, indices, scale, options, done)

    def _measured_grads(self, scale, backward):
        streamer = self.streamer
        streamer.finish_pass()
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None and n not in self._streamed}
        if scale is not None:
            inv = scale.double().reciprocal().float()
            with torch.no_grad():
                for g in grads.values():
                    g.mul_(inv.to(g.device))
        if not (backward and (grads or streamer.norms)):
            return None, []
        resident = dict(zip(grads, torch._foreach_norm(list(grads.values()), 2.0))) if grads else {}
        flags = dict(zip(grads, any_nonfinite(grads.values())))
        norms, bad = [], []
        for name in self.param_names:
            if name in streamer.norms:
                norms.append(streamer.norms[name][0])
                if name in streamer.nonfinite:
                    bad.append(name)
            elif name in resident:
                norms.append(resident[name])
                if flags[name]:
                    bad.append(name)
        norm = total_grad_norm(norms)
        return (float(norm) if norm is not None else None), bad

    # -- what the stages read themselves ---------------------------------------------------------
    def own_grad_norms(self, module: torch.nn.Module) -> list[torch.Tensor]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = []
        for param in module.parameters(recurse=False):
            name = names.get(id(param))
            if name in self.streamer.norms:
                out.append(self.streamer.norms[name][1])
            elif param.grad is not None:
                out.append(torch.linalg.vector_norm(param.grad.float()))
        return out

    def gradient_names(self) -> list[str]:
        kept = self.streamer.grads.kept
        return [n for n, p in self.model.named_parameters()
                if ((n in kept) if n in self._streamed else p.grad is not None)]

    def gradients(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Each parameter holding a gradient, its block materialised and its kept gradient on the device while the
        caller holds it (until the next one)."""
        streamer = self.streamer
        for name, param in list(self.model.named_parameters()):
            if name not in self._streamed:
                if param.grad is not None:
                    yield name, param
                continue
            held = streamer.grads.get(name) if name in streamer.grads.kept else None
            if held is None:
                continue
            streamer.direction = 1
            streamer.acquire(streamer.block_of[name])
            grad = held.to(param.device, dtype=param.dtype)
            if streamer.grad_factor != 1.0:
                grad.mul_(streamer.grad_factor)
            param.grad = grad
            try:
                yield name, param
            finally:
                param.grad = None

    def clip_gradients(self, max_norm: float) -> None:
        """clip_grad_norm_ over the whole model: the resident gradients scaled now, the streamed ones as they are
        handed out (`gradients`)."""
        total = self.last_grad_norm
        if total is None:
            return
        coef = min(1.0, float(max_norm) / (total + 1e-6))
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name not in self._streamed and param.grad is not None:
                    param.grad.mul_(coef)
        self.streamer.grad_factor = coef

    def per_sample_rows(self, refs: list[SampleRef]) -> list[dict]:
        """Each sample's loss and gradient norm alone, one streamed pass each (the sample's own loss, not divided)."""
        rows = []
        for ref in refs:
            result = self.run([ref])
            loss = result.losses[ref.micro_batch] if ref.micro_batch < len(result.losses) else None
            norm = None if result.grad_norm is None else result.grad_norm * self.session.loss_divisor
            if result.raised is not None:
                rows.append({"sample_id": ref.sample_id, "micro_batch": ref.micro_batch, "index": ref.index,
                             "loss": None, "grad_norm": None, "finite": False,
                             "error": f"{result.raised['type']}: {result.raised['message']}"})
                continue
            finite = loss is not None and math.isfinite(loss) and (norm is None or math.isfinite(norm))
            rows.append({"sample_id": ref.sample_id, "micro_batch": ref.micro_batch, "index": ref.index,
                         "loss": loss, "grad_norm": norm, "finite": finite})
        self.reset()
        return rows

    def stream_report(self) -> dict:
        """The report's `stream` block: the plan and what the replay did with it."""
        return {**self.plan.as_dict(), "peak_blocks_materialised": self.streamer.peak,
                "block_reads": self.streamer.reader.reads, "read_ahead_used": self.streamer.reader.hits}


def runner_for(session: ReplaySession) -> StepRunner:
    """The runner a session needs: streamed when its state did not fit the device (`session.stream`)."""
    return StreamedStepRunner(session) if session.stream is not None else StepRunner(session)


def expected_passes(session: ReplaySession, *, bisect: bool = True, rng_check: bool = True, fp32_check: bool = True,
                    remedies: bool = True) -> int:
    """About how many passes a replay of this session takes: reproduce, localise and per-layer statistics (3), other
    seeds (3), bisection (about 2 log2(samples) + 2), the fp32 re-run, the per-sample rows, the remedies (about 7).
    The plan's estimate: a step that does not reproduce stops earlier, one whose samples fail only together bisects
    longer."""
    samples = max(1, len(session.sample_refs))
    return (3 + 3 * rng_check + (2 * samples.bit_length() + 2) * bisect + fp32_check
            + min(samples, STREAMED_PER_SAMPLE) + 7 * remedies)


__all__ = ["BlockStreamer", "StreamedStepRunner", "GradStore", "expected_passes", "runner_for", "STREAMED_PER_SAMPLE"]
