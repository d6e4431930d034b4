"""forensics/format/batch_tree.py's one batch-tree mapper: every walker (capture's host copies, FSDP2 casts, sample
selection) rebuilds containers by the same rule, named tuples and dict-likes included."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from forensics.format.batch_tree import map_tensors, map_tree, rebuild

Pair = namedtuple("Pair", "inputs targets")


class Batch(dict):
    """A dict subclass such as a collator returns."""


class Strict(dict):
    def __init__(self, required):  # a constructor of its own: cannot be rebuilt from a mapping
        super().__init__(required["x"])


def test_named_tuples_and_dict_subclasses_keep_their_type_and_every_tensor_is_mapped():
    batch = Batch(
        pair=Pair(torch.ones(2), torch.zeros(2, dtype=torch.long)),
        ids=["a", "b"],
        extra=OrderedDict(w=torch.ones(1)),
        meta=(1, "x"),
    )
    out = map_tensors(batch, lambda t: t.double() if t.is_floating_point() else t)
    assert type(out) is Batch and type(out["pair"]) is Pair and type(out["extra"]) is OrderedDict
    assert out["pair"].inputs.dtype == torch.float64 and out["pair"].targets.dtype == torch.long
    assert out["extra"]["w"].dtype == torch.float64
    assert out["ids"] == ["a", "b"] and out["meta"] == (1, "x")
    assert batch["pair"].inputs.dtype == torch.float32  # the input is left as it was


def test_a_container_that_cannot_be_rebuilt_falls_back_to_a_plain_one_with_the_data():
    assert rebuild(Strict({"x": {"a": 1}}), [2]) == {"a": 2} and type(rebuild(Strict({"x": {"a": 1}}), [2])) is dict
    assert rebuild(torch.Size([2, 3]), [4, 5]) == torch.Size([4, 5])


def test_whole_treats_a_container_as_one_leaf():
    tree = {"ids": ["a", "b", "c"], "x": [torch.ones(1)]}
    out = map_tree(
        tree,
        lambda v: v[::-1] if isinstance(v, list) else v,
        whole=lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
    )
    assert out["ids"] == ["c", "b", "a"] and torch.equal(out["x"][0], torch.ones(1))
