"""The precursor monitor's device side: per-block statistics of a sampled step, batched into one row tensor.

Only every `PrecursorConfig.every`-th step is measured. On the other steps every hook returns after one flag check
and nothing runs on the device. On a sampled step the forward statistics come from its first micro-batch, and the
work is batched so that its cost does not grow with the number of parameters in Python calls (on a GPU each call
is a kernel launch and host time; a step that is launch-bound pays both):

* block outputs are only referenced by the block hooks (they stay alive for backward anyway); at the last block
  one `_foreach_norm` gives every block's RMS and one more (ord=inf) their abs-max on CUDA — on a CPU one `aminmax`
  per block, as an L-inf norm of bf16 is 20x slower there — in the output's dtype (no float copy);
* the attention-logit bound needs the largest per-head row norm of the query and key projections' outputs: one
  `vector_norm(dim=-1)` per projection (both halves of a fused q|k|v projection at once), kept (one value per
  token and head) until the last block, where one `stack` and one `amax` give every projection's maximum;
* the output-logit abs-max is one `aminmax` pass over the logits;
* after check()'s transfer, the Adam update m^ / (sqrt(v^) + eps) and the second-moment floor of all blocks' weight
  matrices (`block_weights`) are a short chain of `_foreach` ops per param group (in parts of PART_ELEMENTS); their
  gradient and weight norms are one `_foreach_norm`, stacked once with the update norms and summed per block by one
  `index_add_` — never a Python loop of tensor ops per parameter;
* with sharded parameters (DTensor: FSDP2, tensor parallel) the gradient and weight norms, the update and the Adam
  floor are of this rank's local shards — no collective is added, and each rank judges its own view, as it does its
  own micro-batches' forward statistics;
* everything ends in one row tensor, queued after check()'s transfer (its device work overlaps the optimizer step
  and the next forward) and read with the next check()'s transfer (capture/precursors/monitor.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from typing import Any, Iterator, cast, overload

import torch

from forensics.capture.state.sharding import is_dtensor
from forensics.core import thirdparty
from forensics.core.kinds import PrecursorStatistic

log = logging.getLogger(__name__)

# (query name, key name, fused): the projections whose outputs bound the attention logits, as children of one
# attention module: Hugging Face Llama / Mistral / Qwen / OPT (q_proj), BERT (query), DeBERTa (query_proj), DistilBERT
# (q_lin), T5 (q), torchtitan and Meta's Llama (wq); fused: one q|k|v projection whose first two thirds are the
# queries and keys (GPT-2's and nanoGPT's c_attn).
QK_PROJECTIONS = (
    ("q_proj", "k_proj", False),
    ("query", "key", False),
    ("query_proj", "key_proj", False),
    ("q_lin", "k_lin", False),
    ("wq", "wk", False),
    ("q", "k", False),
    ("c_attn", "c_attn", True),
)
HEAD_SIZE_ATTRIBUTES = ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size")
"""An attention module's own attribute for its head size (Llama, GPT-2, torchtitan: head_dim; BERT:
attention_head_size; T5: key_value_proj_dim)."""
OUTPUT_NAMES = ("lm_head", "output", "head")
"""A model without `get_output_embeddings` (not a Hugging Face one): its output projection, a direct child of one of
these names (torchtitan: output)."""
BLOCK_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's repeated blocks, by qualified name: the children of its largest (by parameter count) ModuleList,
    ModuleDict or Sequential whose children are all of one class (`transformer.h`, `model.layers`, `encoder.layer`,
    torchtitan's `layers` dict, a ViT's `blocks` ...); [] when it has none."""
    best: tuple[int, str, torch.nn.Module] | None = None
    for name, module in model.named_modules():
        if isinstance(module, BLOCK_CONTAINERS) and len(module) and len({type(c) for c in module.children()}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size and (best is None or size > best[0]):
                best = (size, name, module)
    if best is None:
        return []
    _, name, blocks = best
    return [(f"{name}.{child}" if name else child, block) for child, block in blocks.named_children()]


def block_weights(block: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a block's gradient norm, update/weight ratio and Adam floor are taken over: its trainable
    weight matrices (>= 2 dimensions; all its trainable parameters when it has none). Biases and norm gains move
    the norms little and would triple the tensors each sampled step walks (GPT-2: 4 of 12 per block are matrices):
    on a GPU each tensor of a `_foreach` call or a `stack` costs host time on the step's critical path."""
    params = [p for p in block.parameters() if p.requires_grad]
    return [p for p in params if p.dim() >= 2] or params


def head_dim(model: torch.nn.Module) -> int | None:
    """The attention head size a Hugging Face config states (head_dim, else hidden / heads), else None."""
    config = getattr(model, "config", None)
    value = getattr(config, "head_dim", None)
    if isinstance(value, int) and value > 0:
        return value
    hidden = next((getattr(config, k) for k in ("hidden_size", "n_embd", "d_model") if hasattr(config, k)), None)
    heads = next(
        (getattr(config, k) for k in ("num_attention_heads", "n_head", "num_heads") if hasattr(config, k)), None
    )
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def attention_projections(
    block: torch.nn.Module,
) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, bool] | None:
    """(attention module, query projection, key projection, fused) of a block: the first module in it with a
    QK_PROJECTIONS pair as its direct children; None when it has none."""
    for module in block.modules():
        children = dict(module.named_children())
        for q_name, k_name, fused in QK_PROJECTIONS:
            if q_name in children and k_name in children:
                return module, children[q_name], children[k_name], fused
    return None


def head_size(attention: torch.nn.Module) -> int | None:
    """The head size an attention module states itself (HEAD_SIZE_ATTRIBUTES), else None."""
    value = next((getattr(attention, a) for a in HEAD_SIZE_ATTRIBUTES if hasattr(attention, a)), None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def output_projection(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """(name, module) of the model's output projection, whose output is the logits: `get_output_embeddings()` of a
    Hugging Face model, else a direct child named in OUTPUT_NAMES; None when there is neither."""
    getter = getattr(model, "get_output_embeddings", None)  # a Hugging Face model's
    output = getter() if callable(getter) else None
    if isinstance(output, torch.nn.Module):
        return next((name for name, m in model.named_modules() if m is output), "output"), output
    children = dict(model.named_children())
    return next(
        ((name, children[name]) for name in OUTPUT_NAMES if isinstance(children.get(name), torch.nn.Module)), None
    )


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, (tuple, list)):
        output = output[0] if output else None
    elif not isinstance(output, torch.Tensor):
        output = getattr(output, "logits", None)
    if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel():
        return output.detach()
    return None


def _absmax(t: torch.Tensor) -> torch.Tensor:
    """max |t| from one `aminmax` pass (one read, like an L-inf norm, which is 20x slower on a CPU for bf16)."""
    low, high = torch.aminmax(t)
    return torch.maximum(high, low.neg())


@overload
def _local(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _local(t: torch.Tensor | None) -> torch.Tensor | None: ...


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a DTensor (FSDP2, tensor parallel: its local shard), else the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def _on_host(value: Any) -> Any:
    """A Python number as a float, a CPU tensor as its value (read on the host: no device involved); a device
    tensor stays as it is (reading it would wait for the device)."""
    if isinstance(value, torch.Tensor):
        # tolist(), not item(): a 0-d tensor's number without the scalar read a dispatch mode counts as a sync
        return float(cast(float, value.tolist())) if value.device.type == "cpu" else value
    return float(value)


class StepStatistics:
    """The hooks and the per-step device values of one monitor; `row()` closes a sampled step."""

    def __init__(
        self, model: torch.nn.Module, optimizer: Any, attention: bool, with_optimizer: bool, scaler: Any = None
    ):
        self.optimizer = optimizer
        self.scaler = scaler
        """The job's GradScaler (or None): gradients still multiplied by its scale are divided by it."""
        self.blocks = find_blocks(model)
        self.active = False
        """Whether the step in progress is sampled: the only thing a hook looks at on the other steps."""
        self.failed = False
        """A hook raised (a block output its reductions do not support): logged, and the monitor turns off."""
        self.handles: list[Any] = []
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        n = len(self.blocks)
        self.columns: list[tuple[str, PrecursorStatistic]] = []
        """What each value of a row is: (layer, statistic), statistic-major."""
        self.columns += [(name, PrecursorStatistic.BLOCK_RMS) for name, _ in self.blocks]
        self.columns += [(name, PrecursorStatistic.BLOCK_ABSMAX) for name, _ in self.blocks]
        for index, (_, block) in enumerate(self.blocks):
            self.handles.append(block.register_forward_hook(self._block_hook(index)))
        self._head_dim: int | None = None
        """The head size of the watched attention modules (one per model; a block whose differs is not watched)."""
        self._attention_blocks = self._add_attention(head_dim(model)) if attention else []
        self.columns += [(self.blocks[i][0], PrecursorStatistic.ATTENTION_LOGIT) for i in self._attention_blocks]
        output = output_projection(model)
        self._has_output = output is not None
        self._output_name = output[0] if output is not None else ""
        if output is None:
            log.warning(
                "forensics: precursors: the output-logit abs-max is not measured on this model: it has no "
                "get_output_embeddings() and no direct child named %s",
                " / ".join(OUTPUT_NAMES),
            )
        if output is not None:
            self.columns.append((output[0], PrecursorStatistic.OUTPUT_LOGIT))
            self.handles.append(output[1].register_forward_hook(self._output_hook))
        self.columns += [(name, PrecursorStatistic.GRAD_NORM) for name, _ in self.blocks]
        self.with_optimizer = with_optimizer and n > 0
        if self.with_optimizer:
            self.columns += [(name, PrecursorStatistic.UPDATE_RATIO) for name, _ in self.blocks]
            self.columns += [(name, PrecursorStatistic.ADAM_V_FLOOR) for name, _ in self.blocks]
        # the blocks' trainable weight matrices in one fixed order, and the block each belongs to (a device index,
        # built once here: an index built at a step would be a host->device copy, which waits like a sync)
        self._params: list[torch.nn.Parameter] = []
        owners: list[int] = []
        for index, (_, block) in enumerate(self.blocks):
            self._params += (params := block_weights(block))
            owners += [index] * len(params)
        self._owner = torch.tensor(owners, dtype=torch.long, device=self.device)
        self._owners = owners
        self._unmeasured: dict[frozenset[int], torch.Tensor] = {}
        """Per set of blocks without any gradient (frozen, unused, or a ZeRO optimizer keeping gradients in its
        own buffers), the device mask that turns their gradient norm into -inf (not measured) rather than 0: built
        once per set, as the set rarely changes (a mask built at each step would be a host->device copy)."""
        self._neg_inf = torch.full((max(len(self.columns), 1),), -math.inf, device=self.device)
        self._zero = torch.zeros((), device=self.device)
        self._empty: dict[torch.dtype, torch.Tensor] = {}
        self._warned_optimizer = False
        self._outputs: list[torch.Tensor | None] = [None] * n
        self.dtypes: dict[tuple[str, PrecursorStatistic], torch.dtype] = {}
        """The dtype each forward statistic was measured in (block output, query projection output under autocast,
        logits), as the sampled steps' hooks saw it: what forensics/core/headroom.py judges its limit by."""
        self._qk: list[torch.Tensor | None] = [None] * (2 * len(self._attention_blocks))
        # the forward statistics of a sampled step come from its first micro-batch with gradients (the others are
        # not measured: on a GPU each measurement is launches on the step's critical path, and one micro-batch in
        # every `every` steps samples the trend as well as all of them would)
        self._blocks_done = self._qk_done = False
        """Every block's output (every q/k projection's) was seen by one flush: those hooks are done for the step.
        Separate, because under reentrant activation checkpointing the blocks' outputs are seen in the forward
        while the projections run without gradients there and only in the recomputation inside backward (last
        block first)."""
        self._rms: list[torch.Tensor] = []  # (blocks,) per flush: one, or several when blocks came over several
        self._absmax: list[torch.Tensor] = []
        self._qk_parts: list[torch.Tensor] = []  # (attention blocks, 2): max |q|, max |k|
        self._logits: list[torch.Tensor] = []  # the measured micro-batch's output-logit abs-max

    # -- hooks (one flag check unless the step is sampled) ------------------------------------------------
    def _block_hook(self, index: int):
        last = index == len(self.blocks) - 1

        def hook(module, args, output):
            if not self.active or not torch.is_grad_enabled():
                return
            with self._never_raising():
                if not self._blocks_done:
                    self._outputs[index] = _first_tensor(output)
                if last:
                    self._flush_micro_batch()

        return hook

    def _output_hook(self, module, args, output):
        if not self.active or self._logits or not torch.is_grad_enabled():
            return
        with self._never_raising():
            t = _first_tensor(output)
            if t is not None:
                self._logits.append(_absmax(t))
                self.dtypes[(self._output_name, PrecursorStatistic.OUTPUT_LOGIT)] = t.dtype

    def _qk_hook(self, slot: int, fused: bool, layer: str, size: int):
        key = (layer, PrecursorStatistic.ATTENTION_LOGIT)

        def hook(module, args, output):
            if not self.active or self._qk_done or not torch.is_grad_enabled():
                return
            with self._never_raising():
                measure(_first_tensor(output))

        def measure(t: torch.Tensor | None) -> None:
            if t is None:
                return
            self.dtypes[key] = t.dtype  # fp16 under fp16 autocast: its limit is judged by it
            # norms accumulated and kept in fp32: an fp16 norm overflows (inf) before any element of q does
            if fused:
                if t.shape[-1] % (3 * size):
                    return
                width = t.shape[-1] // 3
                norms = torch.linalg.vector_norm(
                    t[..., : 2 * width].unflatten(-1, (2, -1, size)), dim=-1, dtype=torch.float32
                )
                self._qk[slot], self._qk[slot + 1] = norms.unbind(-2)  # per token and head; maxed at the flush
            elif not t.shape[-1] % size:
                self._qk[slot] = torch.linalg.vector_norm(t.unflatten(-1, (-1, size)), dim=-1, dtype=torch.float32)

        return hook

    @contextlib.contextmanager
    def _never_raising(self) -> Iterator[None]:
        """A hook runs inside the user's forward: what fails in it is logged once and ends the sampling (the
        monitor then removes its hooks at check()), never raised into the training step."""
        try:
            yield
        except Exception:  # capture must never stop a healthy job
            log.exception("forensics: precursors: the statistics failed; the monitor is off for this run")
            self.failed, self.active = True, False

    def _add_attention(self, model_head_size: int | None) -> list[int]:
        """Hooks on the query / key projections of each block that has recognisable ones (and a known head size: the
        attention module's own, else the model config's); the blocks' indices. Says once, in plain words, when the
        bound cannot be measured on this model (no projections found, or no head size)."""
        found: list[int] = []
        unsized: list[str] = []
        for index, (name, block) in enumerate(self.blocks):
            projections = attention_projections(block)
            if projections is None:
                continue
            attention, q, k, fused = projections
            size = head_size(attention) or model_head_size
            if size is None:
                unsized.append(name)
                continue
            if size != (self._head_dim or size):  # one head size per model: another block's is not watched
                continue
            self._head_dim = size
            slot = 2 * len(found)
            found.append(index)
            self.handles.append(q.register_forward_hook(self._qk_hook(slot, fused, name, size)))
            if not fused:
                self.handles.append(k.register_forward_hook(self._qk_hook(slot + 1, False, name, size)))
        if unsized:
            log.warning(
                "forensics: precursors: the attention-logit bound is not measured for %s: no head size found "
                "(an attribute %s on the attention module, or head_dim / hidden_size and num_attention_heads "
                "in model.config); set one of them to watch it",
                ", ".join(unsized[:3]) + (f" and {len(unsized) - 3} more" if len(unsized) > 3 else ""),
                " / ".join(HEAD_SIZE_ATTRIBUTES),
            )
        elif not found and self.blocks:
            log.warning(
                "forensics: precursors: the attention-logit bound is not measured on this model: its blocks "
                "have no query / key projections under a known name (%s)",
                ", ".join(f"{q}/{k}" for q, k, _ in QK_PROJECTIONS[:-1]) + ", fused c_attn",
            )
        return found

    @property
    def measured_head_dim(self) -> int | None:
        """The head size the attention-logit bound is divided by (None: not measured)."""
        return self._head_dim

    def _flush_micro_batch(self) -> None:
        """The block and q/k values the hooks referenced since the last flush, as one vector each. Blocks (q/k
        projections) count as measured once one flush saw all of them: a recomputation under reentrant activation
        checkpointing runs the blocks backwards from the last one, so its first flush holds one block only."""
        self._blocks_done = self._blocks_done or all(t is not None for t in self._outputs)
        self._qk_done = self._qk_done or all(t is not None for t in self._qk)
        present = [(i, t) for i, t in enumerate(self._outputs) if t is not None]
        for i, t in present:
            self.dtypes[(self.blocks[i][0], PrecursorStatistic.BLOCK_ABSMAX)] = t.dtype
        if present:
            tensors = [t for _, t in present]
            l2 = thirdparty.foreach_norm(tensors)
            thirdparty.foreach_mul_(l2, [1 / math.sqrt(t.numel()) for t in tensors])
            if tensors[0].is_cuda:  # one fused launch for every block
                absmax = thirdparty.foreach_norm(tensors, math.inf)
            else:  # an L-inf norm of bf16 is 20x slower than aminmax on a CPU
                lows, highs = zip(*(torch.aminmax(t) for t in tensors))
                absmax = list(torch.maximum(torch.stack(highs), torch.stack(lows).neg()).unbind())
            for values, into in ((l2, self._rms), (absmax, self._absmax)):
                full = [self._neg_inf[0]] * len(self._outputs)
                for (i, _), v in zip(present, values):
                    full[i] = v
                into.append(torch.stack(full))
            self._outputs = [None] * len(self._outputs)
        norms = [t for t in self._qk if t is not None]
        if norms:
            if len({(t.shape, t.dtype) for t in norms}) == 1:  # one stack and one max for every projection
                maxima = torch.stack(norms).flatten(1).amax(1)
            else:  # projections of different sizes (grouped-query attention's keys): one max each
                maxima = torch.stack([t.amax() for t in norms])
            if len(norms) < len(self._qk):  # some projection did not run: -inf in its place
                found = iter(maxima.unbind())
                maxima = torch.stack([self._neg_inf[0] if t is None else next(found) for t in self._qk])
            self._qk_parts.append(maxima.view(-1, 2))
            self._qk = [None] * len(self._qk)

    # -- at check() -------------------------------------------------------------------------------------
    def row(self) -> torch.Tensor:
        """The sampled step's row (float32, one value per column; -inf: not measured), built on the device."""
        try:
            with torch.no_grad():
                return self._row()
        finally:
            self._rms, self._absmax, self._qk_parts, self._logits = [], [], [], []
            self._blocks_done = self._qk_done = False

    def _row(self) -> torch.Tensor:
        self._flush_micro_batch()
        n = len(self.blocks)
        parts = [self._max_over(self._rms, n), self._max_over(self._absmax, n)]
        if self._attention_blocks:
            if self._qk_parts and self._head_dim is not None:  # measured parts: the head size is known
                bound = self._max_over(self._qk_parts, -1).view(-1, 2).float()
                parts.append(bound[:, 0] * bound[:, 1] / math.sqrt(self._head_dim))
            else:
                parts.append(self._neg_inf[: len(self._attention_blocks)])
        if self._has_output:
            parts.append(self._max_over(self._logits, 1))
        grads = [_local(p.grad) for p in self._params]  # this rank's shards of sharded parameters
        if self.with_optimizer:
            weights = [_local(p) for p in self._params]
            updates, floors = self._optimizer_updates(weights, grads)
            grad, weight, update = self._block_norms(grads, weights, norms=updates)
            parts += [
                self._grad_norms(grad, grads),
                torch.where(update > 0, update / weight, self._neg_inf[:n]),
                self._block_floor(floors),
            ]
        else:
            parts.append(self._grad_norms(self._block_norms(grads)[0], grads))
        return torch.cat([p.float().reshape(-1) for p in parts]) if parts else self._neg_inf[:0]

    def _max_over(self, values: list[torch.Tensor], size: int) -> torch.Tensor:
        """The max over what was measured (a vector of `size`), or -inf when nothing was."""
        if not values:
            return self._neg_inf[:size]
        if len(values) == 1:  # the usual case: one measured micro-batch
            return values[0].reshape(size)
        return torch.stack(values).amax(0).reshape(size)

    def _placeholder(self, p: torch.Tensor) -> torch.Tensor:
        """An empty tensor standing in for a missing gradient (its norm is 0) in a `_foreach` call."""
        if p.dtype not in self._empty:
            self._empty[p.dtype] = torch.zeros(0, dtype=p.dtype, device=p.device)
        return self._empty[p.dtype]

    def _block_norms(self, *tensors: Sequence[torch.Tensor | None], norms: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """Per block, the L2 norm of its parameters' tensors, for each list of `tensors` (None counts as 0) and then
        for `norms` (a list of per-parameter norms computed already): one `_foreach_norm` and one `stack` for all
        of them, summed per block by one `index_add_`; (lists, blocks)."""
        lists = len(tensors) + bool(norms)
        if not self._params:
            return self._neg_inf[:0].expand(lists, 0)
        filled = [t if t is not None else self._placeholder(p) for ts in tensors for t, p in zip(ts, self._params)]
        squares = torch.stack(thirdparty.foreach_norm(filled) + list(norms)).float().square().view(lists, -1)
        return torch.zeros(lists, len(self.blocks), device=squares.device).index_add_(1, self._owner, squares).sqrt()

    def _grad_norms(self, norms: torch.Tensor, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """The blocks' true gradient norms: divided by the loss scale while a GradScaler's gradients are still
        scaled (check() before `scaler.unscale_`: else every scale change would move them 2x), and -inf (not
        measured) for each block none of whose watched parameters has a gradient (0 would read as a measured,
        vanished gradient)."""
        scale = thirdparty.grads_scaled_by(self.scaler, self.optimizer)
        if scale is not None:
            norms = norms / scale.to(norms.device, norms.dtype)
        measured = {owner for owner, g in zip(self._owners, grads) if g is not None}
        missing = frozenset(range(len(self.blocks))) - measured
        if not missing:
            return norms
        if missing not in self._unmeasured:
            self._unmeasured[missing] = torch.tensor(
                [i in missing for i in range(len(self.blocks))], device=self.device
            )
        return torch.where(self._unmeasured[missing], self._neg_inf[: len(self.blocks)], norms)

    def _block_floor(self, floors: list[torch.Tensor]) -> torch.Tensor:
        """Per block, the smallest Adam second moment from each parameter's -sqrt(min v); -inf where none."""
        n = len(self.blocks)
        floor = torch.full((n,), -math.inf, device=self.device).scatter_reduce_(
            0, self._owner, torch.stack(floors).float(), "amax"
        )
        return torch.where(floor > -math.inf, floor.square(), self._neg_inf[:n])

    def _optimizer_updates(
        self, weights: list[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per parameter (`weights` and `grads`: this rank's parts, in `_params` order): ||lr x update|| of the update
        the optimizer state points to, and -sqrt of its smallest Adam second moment (exp_avg_sq; -inf: none). Adam's
        update is the bias-corrected m / (sqrt(v) + eps) (weight decay left out), SGD's the momentum buffer (else the
        gradient); other optimizers give 0 (not measured)."""
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        state = self.optimizer.state
        updates: list[torch.Tensor] = [self._zero] * len(self._params)
        floors: list[torch.Tensor] = [self._neg_inf[0]] * len(self._params)  # -sqrt(min v) per parameter
        subsets: dict[tuple[int, int], list[int]] = {}  # (param group, part) -> parameters: few `_foreach` calls
        filled: dict[int, tuple[int, int]] = {}  # param group -> (its current part, elements in it)
        for i, p in enumerate(self._params):
            group, size = groups.get(id(p)), weights[i].numel()
            if group is not None and state.get(p) and size:
                part, elements = filled.get(id(group), (0, 0))
                if elements and elements + size > PART_ELEMENTS:
                    part, elements = part + 1, 0
                filled[id(group)] = (part, elements + size)
                subsets.setdefault((id(group), part), []).append(i)
        scalars: dict[int, tuple[Any, Any]] = {}
        for (group_id, _), indices in subsets.items():
            group = groups[id(self._params[indices[0]])]
            states = [state[self._params[i]] for i in indices]
            if all("exp_avg" in s and "exp_avg_sq" in s for s in states):
                if group_id not in scalars:
                    scalars[group_id] = _adam_scalars(group, states[0].get("step", 1))
                shift, scale = scalars[group_id]
                d = thirdparty.foreach_sqrt([_local(s["exp_avg_sq"]) for s in states])
                thirdparty.foreach_neg_(d)  # -sqrt(v): its max is -sqrt(min v), the floor
                for i, top in zip(indices, thirdparty.foreach_max(d)):
                    floors[i] = top
                thirdparty.foreach_sub_(d, shift)
                thirdparty.foreach_reciprocal_(d)
                thirdparty.foreach_mul_(d, [_local(s["exp_avg"]) for s in states])  # -m / (sqrt(v) + eps sqrt(bc2))
            elif all("momentum_buffer" in s for s in states):
                moments = [
                    _local(s["momentum_buffer"]) if s["momentum_buffer"] is not None else grads[i]
                    for s, i in zip(states, indices)
                ]
                if any(t is None for t in moments):
                    continue
                d = [t for t in moments if t is not None]
                scale = _on_host(group.get("lr", 0.0))
            else:
                continue
            norms = thirdparty.foreach_norm(d)
            thirdparty.foreach_mul_(norms, scale)
            for i, v in zip(indices, norms):
                updates[i] = v
        if subsets and all(u is self._zero for u in updates) and not self._warned_optimizer:
            self._warned_optimizer = True
            log.warning(
                "forensics: precursors: the update/weight ratio and the Adam second-moment floor are not "
                "measured with %s: its state has neither Adam's exp_avg / exp_avg_sq nor SGD's "
                "momentum_buffer",
                type(self.optimizer).__name__,
            )
        return updates, floors


PART_ELEMENTS = 1 << 27
"""Optimizer-state elements per batch of `_foreach` calls (512 MB of fp32 temporaries, which live only between the
backward and the optimizer step, when the activations are freed): all of a small model's blocks in one batch (the
chain is bound by launches and passes over memory, not by its size: GPT-2 small's 85 M elements took 1.78 ms in two
batches and 1.46 ms in one on an H200; one batch per block cost 9 % of a step), a large model's in batches whose
temporaries stay bounded."""


def _adam_scalars(group: dict, step: Any) -> tuple[Any, Any]:
    """(eps x sqrt(bc2), lr x sqrt(bc2) / bc1) of Adam's bias corrections bc = 1 - beta^step, so that the update
    is scale x m / (sqrt(v) + shift). Host numbers where the step and lr are (a CPU tensor's value included);
    0-dim device tensors where the optimizer keeps them on the device (fused / capturable): never a device read."""
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    eps, lr = group.get("eps", 1e-8), group.get("lr", 0.0)
    step, lr = _on_host(step), _on_host(lr)
    if isinstance(step, torch.Tensor):
        root_bc2 = (1 - beta2**step).sqrt()
        return eps * root_bc2, lr * root_bc2 / (1 - beta1**step)
    root_bc2 = math.sqrt(1 - beta2**step)
    return eps * root_bc2, lr * root_bc2 / (1 - beta1**step)
