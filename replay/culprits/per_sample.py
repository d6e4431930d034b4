"""Per-sample loss and gradient norm of a replayed step, and per-layer gradient norms.

`per_sample_stats` answers "which sample of the batch is bad?" the way people do it by hand:
feed the batch one sample at a time and look at each loss and gradient norm. Two ways, same rows:

* vectorised (`batches` and `loss_fn` given): `torch.func.vmap(grad_and_value(functional_call))`
  over the samples of each micro-batch, one pass. Used only while it is safe: the forward must be
  free of random ops (vmap runs with `randomness="error"`, so dropout in train mode falls back and
  keeps its RNG hook), and the per-sample gradients must fit in `max_vmap_bytes`. Any failure
  (an op without a batching rule, BatchNorm in train mode, `.item()` in the model) falls back.
* one sample at a time (always available): for each sample, clear the grads, call `before_each`
  (the caller's RNG restore), `run_one(ref)`, backward, gradient norm.

Both leave the model's parameters, buffers (BatchNorm running stats) and `.grad` as they found them.
Non-finite values stay floats (nan / inf); the report writer encodes them.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable, Mapping, Sequence, TypedDict

import torch

from forensics.core.errors import ReplayError
from forensics.replay.load.samples import map_sample_tensors, select_samples

log = logging.getLogger(__name__)

DEFAULT_MAX_VMAP_BYTES = 1 << 30
"""Per-sample gradients take (samples x trainable parameter bytes); 1 GiB keeps small models
vectorised and sends anything of LLM size to the one-sample loop."""


class _SampleNumbers(TypedDict):
    sample_id: Any
    micro_batch: int
    index: int
    loss: float | None
    grad_norm: float | None
    finite: bool


class SampleRow(_SampleNumbers, total=False):
    """One sample replayed alone: a row of the report's `per_sample` table; `error` when that sample raised."""

    error: str


class PerSampleError(ReplayError):
    """A per-sample replay returned something that is not a scalar loss."""


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _total_norm(tensors: list[torch.Tensor]) -> float | None:
    """2-norm over all tensors, accumulated in float64 (one device-to-host transfer)."""
    if not tensors:
        return None
    norms = torch.stack([torch.linalg.vector_norm(t.detach(), dtype=torch.float64) for t in tensors])
    return float(torch.linalg.vector_norm(norms))


def _scalar_loss(loss: Any, ref: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise PerSampleError(
            f"run_one({ref!r}) returned {shape}, not a scalar loss tensor; "
            "reduce the loss of the one-sample batch to a single number"
        )
    return loss.reshape(())


def _sample_row(ref: Any, loss: float | None, grad_norm: float | None) -> SampleRow:
    finite = loss is not None and math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
    return {
        "sample_id": ref.sample_id,
        "micro_batch": ref.micro_batch,
        "index": ref.index,
        "loss": loss,
        "grad_norm": grad_norm,
        "finite": finite,
    }


class _Wrapper(torch.nn.Module):
    """Lets `functional_call` drive a `loss_fn(model, batch)` that calls the model normally."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]):
        super().__init__()
        self.inner = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.inner, batch).reshape(())


def _vmap_stats(model: torch.nn.Module, loss_fn: Callable, batch: Any) -> tuple[list[float], list[float | None]]:
    """Per-sample losses and gradient norms of every sample of `batch`, vectorised.

    Raises whatever vmap raises when the model cannot be vectorised (the caller falls back).
    """
    from torch.func import functional_call, grad_and_value, vmap

    wrapper = _Wrapper(model, loss_fn)
    params = {n: p.detach() for n, p in wrapper.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in wrapper.named_parameters() if not p.requires_grad}
    frozen.update(dict(wrapper.named_buffers()))
    leaves: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        leaves.append(tensor)
        return tensor

    map_sample_tensors(batch, keep)

    def one_sample_loss(p: dict, xs: list[torch.Tensor]) -> torch.Tensor:
        it = iter(xs)
        sample = map_sample_tensors(batch, lambda t: next(it).unsqueeze(0))
        return functional_call(wrapper, (p, frozen), (sample,))

    with warnings.catch_warnings():  # ops without a batching rule still work, just slower: not news
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
        grads, losses = vmap(grad_and_value(one_sample_loss), in_dims=(None, 0), randomness="error")(params, leaves)
    if grads:
        per_param = torch.stack(
            [torch.linalg.vector_norm(g.flatten(1), dim=1, dtype=torch.float64) for g in grads.values()]
        )
        norms: list[float | None] = torch.linalg.vector_norm(per_param, dim=0).tolist()
    else:
        norms = [None] * len(losses)
    return [float(v) for v in losses.detach().float().tolist()], norms


def _can_vectorise(model: torch.nn.Module, n: int, max_bytes: int) -> bool:
    need = n * sum(p.numel() * p.element_size() for _, p in _trainable(model))
    if need > max_bytes:
        log.info(
            "per-sample gradients of %d samples need %.1f MiB (> %.1f MiB); one sample at a time",
            n,
            need / 2**20,
            max_bytes / 2**20,
        )
        return False
    return True


def per_sample_stats(
    model: torch.nn.Module,
    sample_refs: Sequence[Any],
    run_one: Callable[[Any], torch.Tensor],
    *,
    before_each: Callable[[Any], None] | None = None,
    batches: Mapping[int, Any] | Sequence[Any] | None = None,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    max_vmap_bytes: int = DEFAULT_MAX_VMAP_BYTES,
) -> list[SampleRow]:
    """Loss and gradient norm of each sample on its own, in the order of `sample_refs`.

    Args:
        model: the live model, in the mode (train / eval) the step ran in.
        sample_refs: objects with `.micro_batch`, `.index`, `.sample_id` (`forensics.replay.run.execute.SampleRef`).
        run_one: `run_one(ref)` runs the forward of the one-sample batch `ref` (e.g.
            `loss_fn(model, select_samples(batches[ref.micro_batch], [ref.index]))` under the
            step's autocast) and returns its scalar loss; it must not call backward.
        before_each: called with the ref right before each `run_one` (restore the RNG so that
            dropout is deterministic); called once per micro-batch on the vectorised path.
        batches: micro-batch trees indexed by `ref.micro_batch`. With `loss_fn`, enables the
            vectorised path.
        loss_fn: `loss_fn(model, batch) -> scalar loss`, entering the step's autocast itself.
        max_vmap_bytes: largest per-sample gradient memory the vectorised path may take.
    Returns:
        `[{"sample_id", "micro_batch", "index", "loss", "grad_norm", "finite"}]`; `loss` and
        `grad_norm` are floats (nan / inf when non-finite) or None (no gradient reached the
        parameters, or the forward raised: the row then has an `"error"` string too).
    Raises:
        PerSampleError: `run_one` returned something other than a scalar tensor.
    Example:
        >>> m = torch.nn.Linear(2, 1); x = torch.tensor([[1.0, 2.0], [float("nan"), 0.0]])
        >>> from types import SimpleNamespace as Ref
        >>> refs = [Ref(micro_batch=0, index=i, sample_id=f"s{i}") for i in range(2)]
        >>> rows = per_sample_stats(m, refs, lambda r: m(x[r.index:r.index + 1]).sum())
        >>> [r["finite"] for r in rows]
        [True, False]
    """
    refs = list(sample_refs)
    params = [p for _, p in _trainable(model)]
    saved_grads = [p.grad for p in params]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rows: dict[int, SampleRow] = {}
    try:
        if batches is not None and loss_fn is not None:
            rows.update(_vectorised_rows(model, refs, batches, loss_fn, before_each, max_vmap_bytes))
        for pos, ref in enumerate(refs):
            if pos not in rows:
                rows[pos] = _loop_row(params, ref, run_one, before_each)
    finally:
        with torch.no_grad():
            for buf, saved in saved_buffers:
                buf.copy_(saved)
        for p, g in zip(params, saved_grads):
            p.grad = g
    return [rows[pos] for pos in range(len(refs))]


def _vectorised_rows(model, refs, batches, loss_fn, before_each, max_bytes) -> dict[int, SampleRow]:
    groups: dict[int, list[int]] = {}
    for pos, ref in enumerate(refs):
        groups.setdefault(int(ref.micro_batch), []).append(pos)
    rows: dict[int, SampleRow] = {}
    for mb, positions in groups.items():
        if not _can_vectorise(model, len(positions), max_bytes):
            return rows
        batch = select_samples(batches[mb], [refs[p].index for p in positions])
        if before_each is not None:
            before_each(refs[positions[0]])
        try:
            losses, norms = _vmap_stats(model, loss_fn, batch)
        except Exception as exc:  # noqa: BLE001 - anything vmap cannot do means: use the loop
            log.info(
                "vectorised per-sample gradients not possible (%s: %s); one sample at a time",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return rows
        for p, loss, norm in zip(positions, losses, norms):
            rows[p] = _sample_row(refs[p], loss, norm)
    return rows


def _loop_row(params: list[torch.nn.Parameter], ref: Any, run_one: Callable, before_each: Callable | None) -> SampleRow:
    for p in params:
        p.grad = None
    if before_each is not None:
        before_each(ref)
    try:
        loss = _scalar_loss(run_one(ref), ref)
        grad_norm = None
        if loss.requires_grad:
            loss.backward()
            grad_norm = _total_norm([p.grad for p in params if p.grad is not None])
        return _sample_row(ref, float(loss.detach().float()), grad_norm)
    except PerSampleError:
        raise
    except (RuntimeError, IndexError, ValueError, ArithmeticError) as exc:  # e.g. a token id out of
        # the vocabulary: that sample is bad, the others still get their row
        log.warning(
            "sample %r (micro-batch %s, index %s) raised %s: %s",
            ref.sample_id,
            ref.micro_batch,
            ref.index,
            type(exc).__name__,
            exc,
        )
        row = _sample_row(ref, None, None)
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row


def rank_by_loss(rows: Sequence[SampleRow]) -> list[SampleRow]:
    """Rows worst first: non-finite rows (in their given order), then finite ones by loss, highest
    first (ties: higher gradient norm first, then given order). Returns a new list of the same dicts.

    Example:
        >>> [r["sample_id"] for r in rank_by_loss([
        ...     {"sample_id": "a", "loss": 2.0, "grad_norm": 1.0, "finite": True},
        ...     {"sample_id": "b", "loss": float("nan"), "grad_norm": None, "finite": False},
        ...     {"sample_id": "c", "loss": 5.0, "grad_norm": 1.0, "finite": True}])]
        ['b', 'c', 'a']
    """

    def key(item: tuple[int, SampleRow]) -> tuple:
        pos, row = item
        loss = row.get("loss")
        if not row.get("finite", False) or loss is None:
            return (0, 0.0, 0.0, pos)
        grad = row.get("grad_norm")
        return (1, -loss, -(grad if grad is not None else -math.inf), pos)

    return [row for _, row in sorted(enumerate(rows), key=key)]
