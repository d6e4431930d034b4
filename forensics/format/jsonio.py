"""JSON encoding of dump metadata: non-finite floats tagged, unknown values named, never dropped."""

from __future__ import annotations

import enum
import json
import math
from pathlib import PurePath
from typing import Any, Callable

from forensics.format.limits import MAX_JSON_DEPTH, MAX_JSON_NUMBER_DIGITS

_FLOAT_TAG = "__float__"
UNSERIALIZABLE_TAG = "__unserializable__"


def json_tree(
    obj: Any, nonfinite: Callable[[float], Any], unknown: Callable[[Any], Any], _seen: set[int] | None = None
) -> Any:
    """The one JSON walker of forensics: `obj` as dict / list / str / int / float / bool / None.

    Tuples, sets and lists become lists (sets sorted by repr); dict keys strings; Enums their value;
    paths strings; one-element torch / numpy values Python numbers. A non-finite float becomes
    `nonfinite(x)`, any other object `unknown(obj)`, a cycle a marker string. The dump format and the
    report schema differ only in those two choices (to_jsonable here, report.model.to_json_safe).
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj.value if isinstance(obj, enum.Enum) else obj
    if isinstance(obj, enum.Enum):
        return json_tree(obj.value, nonfinite, unknown, _seen)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else nonfinite(obj)
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, (dict, list, tuple, set, frozenset)):
        seen = _seen if _seen is not None else set()
        if id(obj) in seen:
            return f"<cycle: {type(obj).__name__}>"
        seen.add(id(obj))
        try:
            if isinstance(obj, dict):
                return {
                    (k if isinstance(k, str) else str(json_tree(k, nonfinite, unknown, seen))): json_tree(
                        v, nonfinite, unknown, seen
                    )
                    for k, v in obj.items()
                }
            items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
            return [json_tree(v, nonfinite, unknown, seen) for v in items]
        finally:
            seen.discard(id(obj))
    if _is_scalar_array(obj):
        return json_tree(obj.item(), nonfinite, unknown, _seen)
    return unknown(obj)


def _is_scalar_array(obj: Any) -> bool:
    """A torch / numpy value with exactly one element."""
    module = type(obj).__module__ or ""
    if not (module.startswith(("torch", "numpy")) and hasattr(obj, "item")):
        return False
    try:
        size = obj.numel() if callable(getattr(obj, "numel", None)) else getattr(obj, "size", None)
        return size == 1
    except Exception:  # noqa: BLE001 - a tensor on a broken device, a meta tensor ...
        return False


def to_jsonable(obj: Any) -> Any:
    """Returns `obj` as plain JSON values for a dump: non-finite floats tagged, other objects named by type."""
    return json_tree(obj, lambda x: {_FLOAT_TAG: str(x)}, lambda o: {UNSERIALIZABLE_TAG: type(o).__qualname__})


def from_jsonable(obj: Any) -> Any:
    """Inverse of `to_jsonable` for tagged floats; unserializable placeholders become None."""
    if isinstance(obj, dict):
        if len(obj) == 1 and _FLOAT_TAG in obj:
            try:
                return float(obj[_FLOAT_TAG])
            except (TypeError, ValueError):
                raise JSONRefused(f"has a malformed float tag {str(obj)[:60]}") from None
        if len(obj) == 1 and UNSERIALIZABLE_TAG in obj:
            return None
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return obj


def lenient_float(value: Any) -> float | None:
    """A number read from dump or report metadata: `float(value)`, NaN and Inf kept; None for None, a bool,
    or anything that is not a number (the one lenient parser; a strict field is checked by `manifest.py`).

    Example:
        >>> [lenient_float(v) for v in (2, "1.5", None, True, "n/a")]
        [2.0, 1.5, None, None, None]
    """
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def dumps(obj: Any) -> bytes:
    return json.dumps(to_jsonable(obj), indent=1, allow_nan=False).encode("utf-8")


class JSONRefused(ValueError):
    """Well-formed JSON that a dump may not hold: nested too deep, a number too long, a key twice, a bare NaN or
    Infinity. Its message is a phrase to follow the document's name ("is nested too deep ...")."""


def _bounded_int(text: str) -> int:
    """A JSON integer of bounded length (int() of a huge digit string is quadratic; floats are bounded)."""
    if len(text) > MAX_JSON_NUMBER_DIGITS:
        raise JSONRefused(f"has a number of {len(text)} digits (at most {MAX_JSON_NUMBER_DIGITS})")
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: with a key twice, one reader takes the first value and another
    the last (a file listed twice in the manifest, with the bad checksum hidden behind the good one)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONRefused(f"has the key {key[:120]!r} twice in one object (which value counts is ambiguous)")
            seen.add(key)
    return obj


def _constant(name: str) -> Any:
    raise JSONRefused(
        f'holds a bare {name}, which is not JSON (a dump writes a non-finite number as {{"{_FLOAT_TAG}": "inf"}})'
    )


TOO_DEEP = f"is nested too deep (more than {MAX_JSON_DEPTH} levels; a dump's JSON is a handful of levels deep)"


def parse_json(data: bytes | bytearray) -> Any:
    """Parses untrusted JSON with limits: nesting at most MAX_JSON_DEPTH, integers at most
    MAX_JSON_NUMBER_DIGITS digits, no key twice in an object, no bare NaN / Infinity. Raises JSONRefused for those,
    ValueError for text that is not JSON (never RecursionError or MemoryError); `refusal` words either."""
    try:
        parsed = json.loads(
            data.decode("utf-8"), parse_int=_bounded_int, object_pairs_hook=_object, parse_constant=_constant
        )
    except RecursionError:  # the C parser's own guard against deep nesting
        raise JSONRefused(TOO_DEEP) from None
    level = [(parsed, 1)]  # the depth, measured without recursion
    while level:
        node, depth = level.pop()
        if depth > MAX_JSON_DEPTH:
            raise JSONRefused(TOO_DEEP)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        level.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return parsed


def refusal(exc: ValueError) -> str:
    """Why parse_json (or from_jsonable) refused a document, as a phrase to follow its name: the limit it broke, or
    "is truncated or not valid JSON (<the parser's words>)"."""
    if isinstance(exc, JSONRefused):
        return str(exc)
    text = str(exc)
    return f"is truncated or not valid JSON ({text if len(text) <= 200 else text[:197] + '...'})"


def loads(data: bytes | bytearray) -> Any:
    """`parse_json` then the dump format's float tags decoded."""
    return from_jsonable(parse_json(data))
