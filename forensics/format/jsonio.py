"""JSON encoding of dump metadata: non-finite floats tagged, unknown values named, never dropped."""

from __future__ import annotations

import json
import math
from typing import Any

_FLOAT_TAG = "__float__"
UNSERIALIZABLE_TAG = "__unserializable__"


def to_jsonable(obj: Any) -> Any:
    """Returns `obj` as plain JSON values; non-finite floats tagged, other objects named by type."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_FLOAT_TAG: str(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "item") and hasattr(obj, "shape") and math.prod(obj.shape) == 1:
        return to_jsonable(obj.item())  # numpy / torch scalars
    return {UNSERIALIZABLE_TAG: type(obj).__qualname__}


def from_jsonable(obj: Any) -> Any:
    """Inverse of `to_jsonable` for tagged floats; unserializable placeholders become None."""
    if isinstance(obj, dict):
        if len(obj) == 1 and _FLOAT_TAG in obj:
            try:
                return float(obj[_FLOAT_TAG])
            except (TypeError, ValueError):
                raise ValueError(f"malformed float tag {str(obj)[:60]}") from None
        if len(obj) == 1 and UNSERIALIZABLE_TAG in obj:
            return None
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return obj


def dumps(obj: Any) -> bytes:
    return json.dumps(to_jsonable(obj), indent=1, allow_nan=False).encode("utf-8")


def loads(data: bytes) -> Any:
    return from_jsonable(json.loads(data.decode("utf-8")))
