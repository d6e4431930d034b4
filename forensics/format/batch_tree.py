"""Batch trees <-> (JSON skeleton, flat tensor dict), as docs/DUMP_FORMAT.md 'Batches' specifies."""

from __future__ import annotations

import math
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from forensics.core.errors import DumpCorruptError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unreplayable:
    """Stands in for a batch leaf the writer could not store (its type name is kept)."""

    type_name: str
    path: str


@dataclass
class EncodedTree:
    skeleton: Any
    tensors: dict[str, torch.Tensor]
    unreplayable: list[dict[str, str]]  # [{"path": "batch['pixels']", "type": "PIL.Image"}]


def tensor_leaves(node: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor in a batch tree, in order: 'input_ids', 'meta.lengths', '[1][0]'."""
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from tensor_leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from tensor_leaves(value, f"{path}[{i}]")


def rebuild(node: Mapping[Any, Any] | list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    """A container like `node` holding `items` (its values, in order): the one rule every batch walker follows.

    A mapping gets `node`'s keys and is built as `type(node)(dict)` (dict subclasses and dict-likes such as
    transformers' BatchEncoding kept), a named tuple as `type(node)(*items)`, another list or tuple as
    `type(node)(items)`; a type that cannot be built so falls back to a plain dict / tuple / list.
    """
    if isinstance(node, Mapping):
        plain: dict[Any, Any] = dict(zip(node.keys(), items))
        kind: Any = type(node)  # a Mapping subclass: its constructor is its own
        return plain if kind is dict else _built(node, plain, lambda: kind(plain))
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return _built(node, tuple(items), lambda: type(node)(*items))
    if type(node) in (list, tuple):
        return type(node)(items)
    fallback = tuple(items) if isinstance(node, tuple) else list(items)
    return _built(node, fallback, lambda: type(node)(items))


def _built(node: Any, fallback: Any, build: Callable[[], Any]) -> Any:
    try:
        return build()
    except Exception:  # noqa: BLE001 - a container type with its own constructor: a plain one carries the data
        log.debug("cannot rebuild a %s from its items; using a plain %s", type(node).__name__, type(fallback).__name__)
        return fallback


def map_tree(node: Any, leaf: Callable[[Any], Any], *, whole: Callable[[Any], bool] | None = None) -> Any:
    """`node` with every leaf replaced by `leaf(value)`, containers rebuilt by `rebuild`.

    Mappings, lists and tuples (named tuples included) are walked into; anything else is a leaf, and so is a
    container for which `whole(container)` is true (e.g. a list of per-sample ids that is sliced as one).
    """
    if whole is not None and whole(node):
        return leaf(node)
    if isinstance(node, Mapping):
        return rebuild(node, [map_tree(v, leaf, whole=whole) for v in node.values()])
    if isinstance(node, (list, tuple)):
        return rebuild(node, [map_tree(v, leaf, whole=whole) for v in node])
    return leaf(node)


def map_tensors(node: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`node` with every tensor leaf replaced by `fn(tensor)`; other leaves kept (see `map_tree`).

    Example:
        >>> map_tensors({"x": torch.ones(2), "ids": ["a", "b"]}, lambda t: t * 2)["x"].tolist()
        [2.0, 2.0]
    """
    return map_tree(node, lambda v: fn(v) if isinstance(v, torch.Tensor) else v)


def storable(tensor: torch.Tensor) -> bool:
    """A dense tensor of a dtype safetensors can hold (sparse, nested, complex ones are unreplayable)."""
    from forensics.format.tensors import SAFETENSORS_DTYPES

    return tensor.layout == torch.strided and not tensor.is_nested and tensor.dtype in SAFETENSORS_DTYPES


def encode_tree(batch: Any) -> EncodedTree:
    """Splits a batch into a JSON skeleton and its tensor leaves; odd leaves are named, not dropped."""
    tensors: dict[str, torch.Tensor] = {}
    unreplayable: list[dict[str, str]] = []

    def encode(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor) and storable(node):
            key = f"t{len(tensors)}"
            tensors[key] = node.detach()
            return {"tensor": key}
        if isinstance(node, Mapping):  # dict, and dict-likes such as transformers' BatchEncoding
            if all(isinstance(k, str) for k in node):
                return {"dict": [[k, encode(v, f"{path}[{k!r}]")] for k, v in node.items()]}
        elif isinstance(node, tuple):
            return {"tuple": [encode(v, f"{path}[{i}]") for i, v in enumerate(node)]}
        elif isinstance(node, list):
            return {"list": [encode(v, f"{path}[{i}]") for i, v in enumerate(node)]}
        elif node is None or isinstance(node, (str, bool, int)):
            return {"value": node}
        elif isinstance(node, float):
            return {"value": node if math.isfinite(node) else {"__float__": str(node)}}
        type_name = f"{type(node).__module__}.{type(node).__qualname__}"
        unreplayable.append({"path": path, "type": type_name})
        return {"unreplayable": type_name}

    skeleton = encode(batch, "batch")
    return EncodedTree(skeleton, tensors, unreplayable)


def decode_tree(skeleton: Any, tensors: dict[str, torch.Tensor], path: str = "batch") -> Any:
    """Rebuilds the batch; raises DumpCorruptError on a skeleton that does not match the spec."""
    if not isinstance(skeleton, dict) or len(skeleton) != 1:
        raise DumpCorruptError(f"batch skeleton node at {path} is malformed")
    ((kind, payload),) = skeleton.items()
    if kind == "tensor":
        if not isinstance(payload, str) or payload not in tensors:
            raise DumpCorruptError(f"batch skeleton at {path} names missing tensor {str(payload)[:120]!r}")
        return tensors[payload]
    if kind in ("dict", "list", "tuple") and not isinstance(payload, list):
        raise DumpCorruptError(f"batch skeleton {kind} node at {path} must hold a list")
    if kind == "dict":
        if not all(isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) for item in payload):
            raise DumpCorruptError(f"batch skeleton dict node at {path} must hold [string key, node] pairs")
        return {k: decode_tree(v, tensors, f"{path}[{k!r}]") for k, v in payload}
    if kind == "list":
        return [decode_tree(v, tensors, f"{path}[{i}]") for i, v in enumerate(payload)]
    if kind == "tuple":
        return tuple(decode_tree(v, tensors, f"{path}[{i}]") for i, v in enumerate(payload))
    if kind == "value":
        if isinstance(payload, dict) and "__float__" in payload:
            return float(payload["__float__"])
        return payload
    if kind == "unreplayable":
        return Unreplayable(str(payload), path)
    raise DumpCorruptError(f"batch skeleton at {path} has unknown node kind {kind!r}")
