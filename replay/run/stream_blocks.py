"""Run, streamed: the blocks of a streamed model, materialised from the dump a few at a time, recomputed for backward.

`BlockStreamer` materialises a block's weights from the dump (the session's `pre_step_weights`: pread, or the rank
dumps of a sharded one) when the block runs, into the same Parameter objects (`param.data` swapped), and keeps at
most K blocks materialised (replay/load/stream_plan.py decides K): least recently used out first when a backward
follows (it runs the blocks in reverse and finds the forward's last ones still there), most recently used out first
in a forward-only pass (a scan in order: the first blocks stay for the next one). With K >= 2 the next block is read
on a background thread while this one computes (replay/run/read_ahead.py).

Each block's forward runs through `_StreamedBlock`, an autograd Function that keeps the block's inputs and recomputes
the block for its backward: torch.utils.checkpoint's reentrant form, with the weights materialised for the
recomputation, the forward's RNG and autocast state restored, and a point after the block's backward where its
gradients are taken off the device (`GradStore`: summed across micro-batches in mapped temporary files, measured once
the step's last micro-batch is through, kept only for a caller that steps the optimizer). Passes with a backward run
together (replay/run/lockstep.py) each record their pass in the blocks' forwards (`pass_number`), and each block's
backward runs as that pass (`as_pass`: its own gradients here, its own leaves outside the blocks). The micro-batches of
one pass run together the same way (`fold`: MicroBatchFold sums each block's gradients on the device in the micro-batch
order once all of them are in, and hands them to the GradStore or the measurement once, not once a micro-batch). `walks`
counts the runs of materialisations in one direction, the stage log's walks over the blocks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, ContextManager, Iterator

import torch

from forensics.core.errors import DumpCorruptError
from forensics.core.thirdparty import foreach_norm, tree_flatten, tree_unflatten
from forensics.replay.load.allocator import restore_default_segments
from forensics.replay.load.host_cache import pinned_slab, unregister
from forensics.replay.load.stream_plan import ACTIVATION_SHARE, StreamPlan, at_rest
from forensics.replay.run.execute import NonfiniteNames, nonfinite_flag
from forensics.replay.run.lockstep import Lockstep
from forensics.replay.run.read_ahead import BlockReader

_FORWARD = torch.nn.Linear.forward.__name__  # the method nn.Module.__call__ runs, overridden per block instance


class BlockStreamer:
    """Materialises the streamed blocks' weights from the dump on demand, at most `plan.resident_blocks` at once."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: StreamPlan,
        read: Callable[..., Iterator[tuple[str, torch.Tensor]]],
        device: torch.device,
    ):
        self.model, self.plan, self.device = model, plan, device
        self.modules = [model.get_submodule(b.name) for b in plan.blocks]
        self.params = {n: model.get_parameter(n) for b in plan.blocks for n in b.params}
        self.block_of = {n: i for i, b in enumerate(plan.blocks) for n in b.params}
        self.rest = {n: at_rest(p) for n, p in self.params.items()}
        self.capacity = plan.resident_blocks
        """K for the dtypes of the pass that runs (the plan's K; fewer in the fp32 re-run, whose blocks are larger)."""
        self.cache: OrderedDict[int, tuple[tuple, dict[str, torch.Tensor]]] = OrderedDict()
        self._sizes: dict[tuple, int] = {}
        self._incoming = plan.materialised_bytes
        self.casts = 0
        """Blocks cast on the device from their materialised dump values instead of read again (`_derive`)."""
        self.memory_evictions = 0
        """Blocks evicted because the device's allocated bytes came near the budget (CUDA; the plan's estimate
        was short)."""
        self.reader = BlockReader(read, device, plan.read_ahead, plan.cache)
        self.peak = 0
        """Most blocks materialised at once (cached + being read ahead): never above `capacity`."""
        self.fp32 = False
        self.unit_dtype: dict[str, torch.dtype] = {}
        """FSDP2 mixed precision (StreamedStepRunner.job_precision): the dtype each parameter computes in."""
        self.reduce_dtype: dict[str, torch.dtype | None] = {}
        self.direction = 1
        self.scan_only = False
        """The pass runs no backward (runner): blocks are evicted most recently used first."""
        self.store = GradStore()
        self.grads: GradStore | PassGradStore = self.store
        """The gradients of the pass that runs: `store`, or a pass's own while passes run together."""
        self.keep = False
        self.final = True
        self.inv_scale: torch.Tensor | None = None
        self.norms: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """This pass: each streamed parameter's gradient norm (in its dtype, as clip_grad_norm_ takes it; in fp32)."""
        self.nonfinite = NonfiniteNames()
        """This pass: the streamed parameters whose gradient holds a NaN/Inf (their flags read once, when asked)."""
        self.grad_factor = 1.0
        self.anchor = torch.empty(0, device=device, requires_grad=True)
        self.recompute_context: Callable[[int], ContextManager] | None = None
        """Set by a stage that watches the backward (replay/localize/forward_backward.localize_backward): entered
        around each block's recomputation, given the block's index."""
        self.after_recompute: Callable[[list[torch.Tensor]], None] | None = None
        """Called with a block's recomputed outputs before their backward runs."""
        self._forwards: list[tuple[torch.nn.Module, Any]] = []
        self.lockstep: Lockstep | None = None
        """Set while several passes run block-major (replay/run/lockstep.py): asked before a block is materialised."""
        self.pass_number: int | None = None
        """While passes with a backward run together: the pass whose state is in place (its gradients here, its
        parameters outside the blocks in the model); a block's forward records it for its backward."""
        self.as_pass: Callable[[int], ContextManager] | None = None
        """Set with `pass_number`: a block's backward runs within as_pass(the pass that ran its forward)."""
        self.fold: MicroBatchFold | None = None
        """Set while micro-batches of one pass run together (StreamedStepRunner): their gradients summed in order."""
        self.walks = 0
        """Walks over the blocks: runs of materialisations in one direction (a forward's, a backward's, the optimizer
        check's); passes run block-major share one."""
        self._walk_at: int | None = None
        self._walk_way = 0

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
        self.store.close()
        if self.plan.cache is not None:
            self.plan.cache.close()
        if self.plan.allocator_set:
            self.plan.allocator_set = False
            restore_default_segments()

    # -- materialising ---------------------------------------------------------------------------
    def _dtypes(self, index: int) -> tuple:
        """The dtype each parameter of block `index` computes in now."""
        return tuple(self.compute_dtype(n) for n in self.plan.blocks[index].params)

    def compute_dtype(self, name: str) -> torch.dtype:
        rest = self.rest[name].dtype
        if self.fp32 and rest.is_floating_point:
            return torch.float32
        return self.unit_dtype.get(name, rest)

    def _fit(self, index: int, key: tuple) -> None:
        """K from the bytes block `index` takes in the dtypes `key` (the dtypes change between passes: fp32 re-run)."""
        size = self._sizes.get(key)
        if size is None:
            size = sum(
                self.rest[n].numel() * torch.empty((), dtype=d).element_size()
                for n, d in zip(self.plan.blocks[index].params, key)
            )
            self._sizes[key] = size
        capacity = self.plan.blocks_fitting(size) if self.plan.room > 0 else self.plan.resident_blocks
        self.capacity = max(1, capacity)
        self._incoming = size

    def holds(self, index: int) -> bool:
        """Block `index` is materialised in the dtypes the pass computes in."""
        hit = self.cache.get(index)
        return hit is not None and hit[0] == self._dtypes(index)

    def acquire(self, index: int) -> None:
        """Block `index`'s weights materialised in its parameters (read from the dump unless still cached, in the
        dtypes the pass computes in: blocks stay materialised from one pass to the next, up to K)."""
        if self.lockstep is not None:  # a pass of several run block-major waits until all of them need the block
            self.lockstep.need(index)
        self._count_walk(index)
        key = self._dtypes(index)
        self._fit(index, key)
        hit = self.cache.get(index)
        if hit is not None and hit[0] == key:
            if not self.scan_only:  # a scan keeps the order blocks came in: the first ones stay (_make_room)
                self.cache.move_to_end(index)
        else:
            derived = self._derive(index, hit[1], key) if hit is not None else None
            if hit is not None:
                self._evict(index)
            if derived is not None and self.reader.pending is not None and self.reader.pending[0] == index:
                self.reader.cancel()
            tensors = derived if derived is not None else self.reader.take(index, key)  # read ahead, or None
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

    def _count_walk(self, index: int) -> None:
        """A new walk starts where the blocks stop coming in the walk's direction."""
        at, way = self._walk_at, self._walk_way
        if at is None or way != self.direction or (index - at) * way < 0:
            self.walks += 1
            self._walk_way = self.direction
        self._walk_at = index

    def _derive(self, index: int, held: dict[str, torch.Tensor], key: tuple) -> dict[str, torch.Tensor] | None:
        """Block `index` in the dtypes `key`, cast on the device from its materialised tensors when they hold the
        dump's values exactly (the dump's own dtypes: the fp32 re-run's blocks of an fp32 dump serve the bf16 passes
        after it without a read); None otherwise."""
        names = self.plan.blocks[index].params
        if any(held[n].dtype != self.rest[n].dtype for n in names):
            return None
        self.casts += 1
        return {n: held[n] if held[n].dtype == d else held[n].to(d) for n, d in zip(names, key)}

    def _names(self, index: int, key: tuple) -> dict[str, torch.dtype]:
        return dict(zip(self.plan.blocks[index].params, key))

    def _check(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.plan.blocks[index].params:
            tensor = tensors.get(name)
            if tensor is None or tuple(tensor.shape) != tuple(self.rest[name].shape):
                raise DumpCorruptError(
                    f"the dump's weight {name!r} changed while it was replayed (missing or another "
                    "shape on a second read)",
                    "model.safetensors",
                )

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
        the first ones stay). On a GPU also while the allocated bytes, the incoming block and its gradients would
        pass the budget less half the activations' share (the plan's estimate was short: evicted for memory)."""
        freed = 0
        while self.cache:
            over = len(self.cache) + slots + (1 if self.reader.pending is not None else 0) > self.capacity
            short = not over and self._short_of_memory(slots, freed)
            if not (over or short):
                break
            order = reversed(self.cache) if self.scan_only else iter(self.cache)
            victim = next((i for i in order if i != keep), None)
            if victim is None:
                break
            freed += sum(t.numel() * t.element_size() for t in self.cache[victim][1].values())
            self.memory_evictions += int(short)
            self._evict(victim)

    def _short_of_memory(self, slots: int, freed: int) -> bool:
        """The allocator's bytes less those just evicted (a block used on two streams is freed only once its
        last use is done: the allocator's count lags), the incoming block and its gradients pass the limit."""
        if self.device.type != "cuda" or self.plan.room <= 0:
            return False
        limit = self.plan.budget * (1 - ACTIVATION_SHARE / 2)
        return torch.cuda.memory_allocated(self.device) - freed + (slots + 1) * self._incoming > limit

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
    def grad_state(self) -> tuple:
        """What one pass's backward leaves here (its gradients, norms, flags): handed to `set_grad_state` to give
        the streamer another pass's (passes with a backward run together: StreamedStepRunner.run_with_backwards)."""
        return (self.grads, self.norms, self.nonfinite, self.keep, self.final, self.inv_scale, self.grad_factor)

    def set_grad_state(self, state: tuple) -> None:
        self.grads, self.norms, self.nonfinite, self.keep, self.final, self.inv_scale, self.grad_factor = state

    def new_pass(self, keep: bool) -> None:
        self.grads.clear()
        self.norms.clear()
        self.nonfinite.clear()
        self.keep, self.grad_factor = keep, 1.0

    def block_backward_done(self, index: int) -> None:
        """Block `index`'s backward of one micro-batch is over: its gradients off the device (accumulated across
        micro-batches), measured once the pass's last micro-batch is through. Micro-batches of one pass run together
        (`fold`): summed on the device in the micro-batch order, taken off (or measured) once the block's backward is
        over for all of them."""
        fold = self.fold
        if fold is not None and self.pass_number is not None:
            grads = {}
            for name in self.plan.blocks[index].params:
                param = self.params[name]
                grad, param.grad = param.grad, None
                if grad is not None:
                    grads[name] = grad
            summed = fold.block_done(index, self.pass_number, grads, self._held_on_device)
            for name, grad in (summed or {}).items():
                if fold.final:
                    self._finish(name, grad)
                else:
                    self.grads.put(name, grad)
            return
        for name in self.plan.blocks[index].params:
            param = self.params[name]
            grad, param.grad = param.grad, None
            if grad is None:
                continue
            held = self.grads.pop(name)
            if held is not None:
                grad = held.to(grad.device) + grad  # the accumulation autograd does into .grad, in its dtype
                self.grads.recycle(held)  # the copy above is synchronous (non_blocking=False)
            if self.final:
                self._finish(name, grad)
            else:
                self.grads.put(name, grad)

    def _held_on_device(self, name: str) -> torch.Tensor | None:
        """The gradient held off the device for `name` (earlier micro-batches of the pass), back on it."""
        held = self.grads.pop(name)
        if held is None:
            return None
        grad = held.to(self.device)
        self.grads.recycle(held)  # the copy above is synchronous (non_blocking=False)
        return grad

    def finish_pass(self) -> None:
        """Gradients still accumulating when the pass stopped early (an exception, anomaly mode's error)."""
        for name in list(self.grads.names()):
            if name not in self.norms:
                held = self.grads.pop(name)
                if held is None:  # names() lists only what it holds
                    continue
                grad = held.to(self.device, copy=True)
                self.grads.recycle(held)
                self._finish(name, grad)

    def _finish(self, name: str, grad: torch.Tensor) -> None:
        rest = self.rest[name].dtype
        accumulated = grad
        if name in self.reduce_dtype and grad.dtype != rest:  # FSDP2: reduced in reduce_dtype onto the fp32 weights
            via = self.reduce_dtype[name] or rest
            grad = grad.to(via).to(rest)
            exact = widens_exactly(accumulated.dtype, via) and widens_exactly(via, rest)
        else:
            exact = True
        if self.inv_scale is not None:  # GradScaler.unscale_: times 1/scale in fp32
            grad = grad * self.inv_scale.to(grad.device)
            exact = False
        norm = foreach_norm([grad], 2.0)[0]
        self.norms[name] = (norm, torch.linalg.vector_norm(grad.float()))
        self.nonfinite.add_flag(name, nonfinite_flag(grad))  # no sync per gradient: one per pass, when asked
        if self.keep:  # in the accumulated dtype when widening it gives the same values: half the bytes off the device
            self.grads.put(name, accumulated if exact else grad, kept=True)


def widens_exactly(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Every value of `narrow` is a value of `wide` (a cast there and back is the identity)."""
    halves, singles = (torch.float16, torch.bfloat16), (torch.float32, torch.float64)
    return narrow == wide or (narrow in halves and wide in singles) or (narrow, wide) == (torch.float32, torch.float64)


class GradStore:
    """Gradients off the device: accumulating across micro-batches, or kept for the optimizer check. Those of a
    CUDA device go to pinned host memory up to `pinned_limit` (copies at the bus's speed: a 7B model's bf16 gradients,
    12.4 GB, cross twice in each pass of two micro-batches), carved from slabs of `SLAB` bytes (the caching host
    allocator rounds each allocation up to a power of two and pins page by page: one allocation per gradient pinned
    a third more than the gradients and took most of the first pass), then, like large ones of the CPU, to files of a
    temporary directory mapped into memory (the page cache holds them, the kernel may write them out); small ones
    live in ordinary memory. Buffers are reused from one micro-batch and pass to the next."""

    FILE_MIN = 1 << 20
    PINNED_MAX = 16 << 30
    """Pinned bytes at most (and at most an eighth of the host's memory)."""
    SLAB = 1 << 30
    """Bytes of one pinned allocation (a power of two: nothing rounded away); larger gradients get their own."""
    ALIGN = 512

    def __init__(self, directory: str | None = None):
        self._directory = directory
        self._dir: str | None = None
        self._held: dict[str, torch.Tensor] = {}
        self.kept: set[str] = set()
        self._count = 0
        self._free: dict[tuple, list[torch.Tensor]] = {}
        """Host buffers no longer held, by shape and dtype, for the next micro-batch or pass (at most what one pass
        held at once): faulting a pass's worth of fresh mapped pages in costs more than the copies."""
        self._slabs: list[list] = []
        """[pinned uint8 tensor, bytes used] of each slab."""
        self._registered: list[torch.Tensor] = []
        """Slabs registered with the driver (cudaHostRegister): unregistered before their memory is freed."""
        self.pinned_bytes = 0
        self.host_bytes = 0
        """Bytes of host buffers made (pinned, mapped or ordinary): at most what one pass held at once."""
        self.alloc_seconds = 0.0
        """Time spent making host buffers (pinning pages costs more than the copies into them)."""
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            host = 0
        self.pinned_limit = min(self.PINNED_MAX, host // 8)

    def _host(self, like: torch.Tensor) -> torch.Tensor:
        for pinned in (True, False) if like.device.type == "cuda" else (False,):
            free = self._free.get((tuple(like.shape), like.dtype, pinned))
            if free:  # its pages are mapped (or pinned) already: a pass after the first maps no new ones
                return free.pop()
        started = time.perf_counter()
        try:
            tensor = self._new_host(like)
        finally:
            self.alloc_seconds += time.perf_counter() - started
        self.host_bytes += like.numel() * like.element_size()
        return tensor

    def _new_host(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if like.device.type == "cuda":
            pinned = self._pinned(like, nbytes)
            if pinned is not None:
                return pinned
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

    def _pinned(self, like: torch.Tensor, nbytes: int) -> torch.Tensor | None:
        """A pinned buffer shaped like `like`, carved from a slab with room (a new slab while under the limit)."""
        span = -(-nbytes // self.ALIGN) * self.ALIGN
        slab = next((s for s in self._slabs if s[0].numel() - s[1] >= span), None)
        if slab is None:
            size = max(self.SLAB, span)
            if self.pinned_bytes + size > self.pinned_limit:
                return None
            with torch.cuda.device(like.device):  # pinned for the gradient's device, not a context made on cuda:0
                slab = [self._pinned_slab(size), 0]
            self._slabs.append(slab)
            self.pinned_bytes += size
        start = slab[1]
        slab[1] += span
        return slab[0][start : start + nbytes].view(like.dtype).view(like.shape)

    def _pinned_slab(self, size: int) -> torch.Tensor:
        """`size` bytes of page-locked memory (replay/load/host_cache.pinned_slab)."""
        return pinned_slab(size, self._registered)

    def _unregister(self) -> None:
        """The registered slabs unlocked, once every copy that may still touch them is done."""
        unregister(self._registered)

    def put(self, name: str, grad: torch.Tensor, kept: bool = False) -> None:
        host = self._host(grad)
        host.copy_(grad)
        self._held[name] = host
        if kept:
            self.kept.add(name)

    def pop(self, name: str) -> torch.Tensor | None:
        """The gradient held for `name` (the caller hands it back with `recycle` once copied)."""
        self.kept.discard(name)
        return self._held.pop(name, None)

    def recycle(self, host: torch.Tensor) -> None:
        """A buffer `pop` returned, its contents used: for the next `put` of its shape and dtype."""
        self._free.setdefault((tuple(host.shape), host.dtype, host.is_pinned()), []).append(host)

    def get(self, name: str) -> torch.Tensor | None:
        return self._held.get(name)

    def names(self) -> list[str]:
        return list(self._held)

    def clear(self) -> None:
        for host in self._held.values():
            self.recycle(host)
        self._held.clear()
        self.kept.clear()

    def close(self) -> None:
        self.clear()
        self._free.clear()
        self._unregister()
        self._slabs.clear()
        self.pinned_bytes = 0
        if self._dir is not None:
            shutil.rmtree(self._dir, True)
            self._dir = None


class PassGradStore:
    """The GradStore of a pass run together with others (StreamedStepRunner.run_with_backwards): such passes run one
    micro-batch each and keep no gradients, so nothing is held here; a pass that would hold one fails its engine
    call, and the caller runs the passes again alone."""

    def __init__(self) -> None:
        self.kept: set[str] = set()
        self.host_bytes = self.pinned_bytes = 0

    def put(self, name: str, grad: torch.Tensor, kept: bool = False) -> None:
        raise RuntimeError("a pass run together with others holds no gradient across micro-batches")

    def pop(self, name: str) -> torch.Tensor | None:
        return None

    def get(self, name: str) -> torch.Tensor | None:
        return None

    def names(self) -> list[str]:
        return []

    def recycle(self, host: torch.Tensor) -> None:
        return None

    def clear(self) -> None:
        return None


class MicroBatchFold:
    """The gradients of several micro-batches of one pass run together (StreamedStepRunner's block-major
    micro-batches), summed on the device in the order the micro-batches run one after another: (((held + g0) + g1) +
    g2), `held` what earlier micro-batches of the pass left, whatever order the autograd engine hands them in (it
    runs the nodes of different graphs that carry the same sequence number in no fixed order). A block's sum is
    complete once each micro-batch that ran the block's forward has run its backward; the gradients of the
    parameters outside the blocks (`add`) are summed as they come while the ones before them are in, the rest at
    the end (`rest`). A block run more than once in one micro-batch's forward makes the sum another one than the
    sequential schedule's: `unsure`, and the pass runs again one micro-batch after another."""

    def __init__(self, count: int, final: bool):
        self.count, self.final = count, final
        """Micro-batches run together; whether the pass's last is among them (the sums are then measured)."""
        self.calls: dict[int, list[int]] = {}
        """Block -> how many times each micro-batch ran its forward."""
        self.unsure = False
        self._pending: dict[Any, dict[int, dict[str, torch.Tensor]]] = {}
        self._next: dict[Any, int] = {}
        self._sums: dict[Any, dict[str, torch.Tensor]] = {}

    def ran(self, index: int, number: int) -> None:
        calls = self.calls.setdefault(index, [0] * self.count)
        calls[number] += 1
        if calls[number] > 1:
            self.unsure = True

    def block_done(
        self,
        index: int,
        number: int,
        grads: dict[str, torch.Tensor],
        held: Callable[[str], torch.Tensor | None],
    ) -> dict[str, torch.Tensor] | None:
        """Micro-batch `number`'s gradients of block `index`: the block's sums once every micro-batch that ran it
        is in, else None."""
        calls = self.calls.get(index, [1] * self.count)
        key = ("block", index)
        self._add(key, number, grads, held, lambda at: calls[at] == 0)
        if self._next.get(key, 0) < self.count:
            return None
        self._next.pop(key)
        return self._sums.pop(key, {})

    def add(self, number: int, name: str, grad: torch.Tensor, held: Callable[[str], torch.Tensor | None]) -> None:
        """Micro-batch `number`'s gradient of `name`, a parameter outside the blocks."""
        self._add(("param", name), number, {name: grad}, held, lambda at: False)

    def rest(self, held: Callable[[str], torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Every sum still open (the parameters outside the blocks; a block some micro-batch did not run back
        through), what came summed in the micro-batch order."""
        out: dict[str, torch.Tensor] = {}
        for key in list(self._pending):
            pending = self._pending.pop(key)
            sums = self._sums.setdefault(key, {})
            for number in sorted(pending):
                self._fold(sums, pending[number], held)
            out.update(self._sums.pop(key))
        for key in list(self._sums):
            out.update(self._sums.pop(key))
        self._next.clear()
        return out

    def _add(self, key: Any, number: int, grads: dict[str, torch.Tensor], held: Callable, skip: Callable) -> None:
        pending = self._pending.setdefault(key, {})
        pending[number] = grads
        sums = self._sums.setdefault(key, {})
        at = self._next.get(key, 0)
        while at < self.count and (at in pending or skip(at)):
            self._fold(sums, pending.pop(at, {}), held)
            at += 1
        self._next[key] = at
        if not pending:
            self._pending.pop(key, None)

    @staticmethod
    def _fold(sums: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], held: Callable) -> None:
        for name, grad in grads.items():
            if name in sums:  # the accumulation autograd (or block_backward_done) does, in order: in place (the sum
                total = sums[name]  # is ours alone) where that is the same op, the same dtype
                sums[name] = total.add_(grad) if total.dtype == grad.dtype else total + grad
            else:
                before = held(name)
                sums[name] = grad if before is None else before + grad


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
        outputs = _StreamedBlock.apply(
            self, box, (leaves, spec, positions), self.streamer.anchor, *[leaves[i] for i in positions]
        )
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
        ctx.pass_number = streamer.pass_number
        if streamer.fold is not None and ctx.pass_number is not None:
            streamer.fold.ran(call.index, ctx.pass_number)
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
        streamer = ctx.call.streamer
        if ctx.pass_number is None or streamer.as_pass is None:
            return _StreamedBlock._backward(ctx, *grads)
        with streamer.as_pass(ctx.pass_number):  # passes run together: as the pass that ran this forward
            return _StreamedBlock._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads: torch.Tensor):
        call, streamer = ctx.call, ctx.call.streamer
        needs = ctx.needs_input_grad[4:]
        inputs = [t.detach().requires_grad_(need) if need else t.detach() for t, need in zip(ctx.saved_tensors, needs)]
        devices = [streamer.device.index or 0] if ctx.cuda_rng is not None else []
        enabled, dtype = ctx.autocast
        streamer.direction = -1
        autocast = (
            torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled)
            if dtype is not None
            else contextlib.nullcontext()
        )
        watch = (
            streamer.recompute_context(call.index)
            if streamer.recompute_context is not None
            else contextlib.nullcontext()
        )
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


__all__ = ["BlockStreamer", "GradStore", "MicroBatchFold", "PassGradStore"]
