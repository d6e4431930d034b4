"""Pick samples out of a batch tree: infer the batch size and slice every per-sample leaf.

A batch is a tree of dict / list / tuple nodes (the shape `Dump.micro_batch(i)` returns), e.g. the
Hugging Face `{"input_ids": T, "attention_mask": T, "labels": T, "sample_ids": [...]}`.

The rule, in one place (both functions below follow it):

* **Batch size.** Every tensor leaf with at least one dimension votes with its `shape[0]`.
  The batch size is the most common vote (ties: the first tensor met, depth-first in the tree's
  own order). Only if the tree has no such tensor do *per-sample lists* vote with their length.
* **Per-sample list.** A list or tuple whose items are all plain values (str, int, float, bool,
  None), e.g. `sample_ids`. A list or tuple holding a tensor or another container is structure
  (e.g. `(inputs, targets)`) and is walked into, not sliced.
* **Slicing.** `select_samples` takes rows `indices` (in that order) of every tensor leaf whose
  `shape[0]` equals the batch size and of every per-sample list whose length equals it. Every other
  leaf (0-d tensors, tensors of another length such as `position_ids` of shape `(1, T)`, strings,
  numbers, `forensics.format.Unreplayable` markers) is kept as it is, shared with the input.
  Containers are rebuilt with their own type (dict subclasses and named tuples included, falling
  back to a plain dict / tuple when the type cannot be rebuilt from its items: the one rule of
  `forensics.format.batch_tree.rebuild`, which every batch walker follows).

A tensor whose first dimension happens to equal the batch size without being per-sample (e.g. a
`(T,)` tensor with `T == B`) is sliced too; the tree carries nothing that could tell them apart.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from forensics.core.errors import ReplayError
from forensics.format.batch_tree import map_tensors, map_tree, rebuild


@dataclass(frozen=True)
class SampleRef:
    """One sample of the step: position `index` in micro-batch `micro_batch` (sample_id for display).

    Equality and hashing use the position only (sample ids are JSON values, possibly unhashable).
    """

    micro_batch: int
    index: int
    sample_id: Any = field(default=None, compare=False)


log = logging.getLogger(__name__)

_PLAIN = (str, int, float, bool, type(None))


class SampleSelectionError(ReplayError):
    """Samples cannot be selected from a batch (bad indices for its size)."""


class BatchSizeError(SampleSelectionError):
    """No batch size can be inferred: the batch has no tensor with a dimension and no per-sample list."""


def _is_per_sample_list(node: Any) -> bool:
    return isinstance(node, (list, tuple)) and all(isinstance(v, _PLAIN) for v in node)


def _votes(node: Any, tensors: list[int], lists: list[int]) -> None:
    if isinstance(node, torch.Tensor):
        if node.dim() >= 1:
            tensors.append(node.shape[0])
    elif isinstance(node, Mapping):
        for value in node.values():
            _votes(value, tensors, lists)
    elif isinstance(node, (list, tuple)):
        if _is_per_sample_list(node):
            lists.append(len(node))
        else:
            for value in node:
                _votes(value, tensors, lists)


def _most_common(votes: list[int]) -> int:
    counts = Counter(votes)
    best = max(counts.values())
    return next(v for v in votes if counts[v] == best)  # ties: the first met


def batch_size(batch: Any) -> int:
    """Number of samples in a batch tree (rule in the module docstring).

    Args:
        batch: a tensor, or a dict / list / tuple tree with tensors and plain values as leaves.
    Returns:
        The inferred batch size (may be 0 for an empty batch).
    Raises:
        BatchSizeError: the tree has neither a tensor with a dimension nor a per-sample list.
    Example:
        >>> batch_size({"input_ids": torch.zeros(4, 7, dtype=torch.long), "sample_ids": list("abcd")})
        4
    """
    tensors: list[int] = []
    lists: list[int] = []
    _votes(batch, tensors, lists)
    if tensors:
        if len(set(tensors)) > 1:
            log.debug("tensor leaves disagree on dim 0 %s; taking the most common", sorted(set(tensors)))
        return _most_common(tensors)
    if lists:
        return _most_common(lists)
    raise BatchSizeError(
        f"cannot infer the batch size of a {type(batch).__name__}: it holds no tensor with at least "
        "one dimension and no list of per-sample values. Store the batch as a dict/list/tuple of "
        "tensors whose first dimension is the batch, or pass the sample ids explicitly."
    )


def _select(batch: Any, size: int, indices: list[int]) -> Any:
    index_tensors: dict[torch.device, torch.Tensor] = {}

    def leaf(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            if node.dim() >= 1 and node.shape[0] == size:
                key = node.device
                if key not in index_tensors:
                    index_tensors[key] = torch.tensor(indices, dtype=torch.long, device=node.device)
                return node.index_select(0, index_tensors[key])
            return node
        if _is_per_sample_list(node) and len(node) == size:
            return rebuild(node, [node[i] for i in indices])
        return node

    return map_tree(batch, leaf, whole=_is_per_sample_list)


def map_sample_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of the tree with `fn` applied to every per-sample tensor (dim 0 == the batch size).

    Every other leaf is kept as it is. Used to add or remove the batch dimension around
    `torch.func.vmap`.

    Example:
        >>> map_sample_tensors({"x": torch.zeros(3, 2), "pos": torch.zeros(1, 2)}, lambda t: t[0])["x"].shape
        torch.Size([2])
    """
    size = batch_size(batch)
    return map_tensors(batch, lambda t: fn(t) if t.dim() >= 1 and t.shape[0] == size else t)


def select_samples(batch: Any, indices: Iterable[int]) -> Any:
    """A new batch tree holding only the samples at `indices` (in that order).

    Args:
        batch: a batch tree (see the module docstring for which leaves are per-sample).
        indices: sample positions in `range(batch_size(batch))`; repeats are allowed, an empty
            list gives a batch of size 0.
    Returns:
        The sliced tree; leaves that are not per-sample are the input's own objects.
    Raises:
        BatchSizeError: no batch size can be inferred.
        SampleSelectionError: an index is negative or not below the batch size.
    Example:
        >>> b = {"x": torch.arange(6).reshape(3, 2), "sample_ids": ["a", "b", "c"], "name": "s"}
        >>> select_samples(b, [2, 0])["sample_ids"]
        ['c', 'a']
    """
    indices = [int(i) for i in indices]
    size = batch_size(batch)
    bad = [i for i in indices if i < 0 or i >= size]
    if bad:
        raise SampleSelectionError(f"sample indices {bad} are out of range for a batch of {size}; use 0..{size - 1}")
    return _items_kept(batch, _select(batch, size, indices))


NUM_ITEMS_KEY = "num_items_in_batch"  # forensics.capture.integrations.hf_trainer.NUM_ITEMS_KEY


def _label_items(batch: Mapping[str, Any]) -> int | None:
    """The label positions a causal loss counts in `batch` (labels[..., 1:] != -100), or None without labels."""
    labels = batch.get("shift_labels", batch.get("labels"))
    if not isinstance(labels, torch.Tensor) or labels.dim() < 1:
        return None
    counted = labels if "shift_labels" in batch or labels.dim() < 2 else labels[..., 1:]
    return int(counted.ne(-100).sum())


def _items_kept(batch: Any, selected: Any) -> Any:
    """A batch that carries the Hugging Face Trainer's `num_items_in_batch` (the loss is a sum over the step's label
    tokens divided by it): the selection's count, scaled by the share of label tokens it keeps, so a sample alone
    or a step without some samples gives a loss in the units of the step's own loss — a mean per token — not a
    fraction of it (issue 50: 0.67 against a step loss of 5.38). Exact for a step of one micro-batch."""
    if not isinstance(batch, Mapping) or NUM_ITEMS_KEY not in batch or not isinstance(selected, MutableMapping):
        return selected
    total, kept, items = _label_items(batch), _label_items(selected), batch[NUM_ITEMS_KEY]
    if not total or kept is None or kept == total:
        return selected
    if isinstance(items, torch.Tensor) and items.numel() == 1:
        selected[NUM_ITEMS_KEY] = items * kept / total
    elif isinstance(items, (int, float)) and not isinstance(items, bool):
        selected[NUM_ITEMS_KEY] = items * kept / total
    return selected
