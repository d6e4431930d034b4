"""The report model: schema "forensics-report/1" checks, JSON-safe conversion, loading (docs/REPORT_FORMAT.md)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from forensics.core.errors import ForensicsError
from forensics.format.jsonio import json_tree
from forensics.core.kinds import VerdictKind

log = logging.getLogger(__name__)

SCHEMA = "forensics-report/1"
SCHEMA_MAJOR = 5  # the newest major this reader implements; 2 = 1 + verdict.kind "exception" and its block;
# 3 = 2 + verdict.kind "instability_ahead" and the `precursor` block (a precursor dump); 4 = 3 + verdict.kind
# "trigger_sample" (samples that crossed first on a state that could not take them: not bad data); 5 = 4 + verdict.kind
# "silent_corruption" and the `silent` block (a silent-corruption dump judged on the replay device)
_SCHEMA_RE = re.compile(r"^forensics-report/(\d+)$")

VERDICT_KINDS = tuple(kind.value for kind in VerdictKind)  # the values verdict.kind may take (newest major)


def schema_for(kind: VerdictKind | str) -> str:
    """The schema string of a report with this verdict: the major that introduced the kind."""
    return f"forensics-report/{VerdictKind(kind).schema_major}"


# Top-level keys in the order docs/REPORT_FORMAT.md lists them; report.json keeps this order.
SCHEMA_KEYS = (
    "schema",
    "created_at",
    "dump",
    "trigger",
    "environment",
    "reproduced",
    "fidelity",
    "rng",
    "verdict",
    "culprit",
    "precision",
    "bisection",
    "per_sample",
    "per_layer",
    "history",
    "history_pattern",
    "timings",
    "exception",
    "weights",
)
# Optional sections: absent or null when that analysis was not run. Value: the JSON type if present.
_OPTIONAL_TYPES = {
    "rng": dict,
    "precision": dict,
    "bisection": dict,
    "per_sample": list,
    "per_layer": list,
    "history": dict,
    "history_pattern": str,
    "timings": dict,
}

_NONFINITE_STRINGS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class ReportError(ForensicsError):
    """A report is missing, not valid JSON, of a newer schema, or lacks a required field (bad input)."""


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _require(d: dict, key: str, types: type | tuple, where: str) -> Any:
    if key not in d:
        raise ReportError(
            f"report is missing '{where}{key}'; it is required by schema {SCHEMA} (see docs/REPORT_FORMAT.md)"
        )
    value = d[key]
    # bool is an int subclass: an int field must not accept true/false.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise ReportError(f"report field '{where}{key}' must be {_names(types)}, got {_type_name(value)}")
    return value


def _as_tuple(types: type | tuple) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _names(types: type | tuple) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in _as_tuple(types))


def check_schema(schema: Any) -> int:
    """Check a report's `schema` string and return its major version.

    Args:
        schema: the value of the report's "schema" key.
    Returns:
        The major version (currently always 1).
    Raises:
        ReportError: not a "forensics-report/<int>" string, or a newer major than this reader.
    Example:
        >>> check_schema("forensics-report/1")
        1
    """
    m = _SCHEMA_RE.match(schema) if isinstance(schema, str) else None
    if m is None:
        raise ReportError(f"not a forensics report: schema is {schema!r}, expected {SCHEMA!r}")
    major = int(m.group(1))
    if major > SCHEMA_MAJOR:
        raise ReportError(
            f"report uses schema forensics-report/{major}, newer than "
            f"forensics-report/{SCHEMA_MAJOR} that this forensics reads; upgrade forensics to read it"
        )
    if major < 1:
        raise ReportError(f"report schema {schema!r} is not a known version; expected {SCHEMA!r}")
    return major


def validate_report(d: Any) -> dict:
    """Check that `d` is a report of schema "forensics-report/1" (docs/REPORT_FORMAT.md).

    Checks the schema string, that every REQUIRED section is present with the right JSON type,
    the few nested keys renderers and the CLI rely on (dump.step, dump.rank, verdict.kind,
    verdict.headline, culprit.samples), and the type of OPTIONAL sections when present.
    Unknown keys are allowed (newer writers of the same major may add keys).

    Args:
        d: the report dict (as returned by the replay engine, or parsed from report.json).
    Returns:
        `d` itself, unchanged.
    Raises:
        ReportError: with a message naming the offending field.
    Example:
        >>> validate_report({"schema": "forensics-report/6"})
        Traceback (most recent call last):
        ...
        forensics.report.model.ReportError: report uses schema forensics-report/6, newer than ...
    """
    if not isinstance(d, dict):
        raise ReportError(f"a report must be a JSON object, got {_type_name(d)}")
    if "schema" not in d:
        raise ReportError(f"not a forensics report: no 'schema' key (expected {SCHEMA!r})")
    major = check_schema(d["schema"])
    _require(d, "created_at", str, "")
    dump = _require(d, "dump", dict, "")
    _require(dump, "step", int, "dump.")
    _require(dump, "rank", int, "dump.")
    _require(d, "trigger", dict, "")
    _require(d, "environment", dict, "")
    _require(d, "reproduced", bool, "")
    _require(d, "fidelity", dict, "")
    verdict = _require(d, "verdict", dict, "")
    kind = _require(verdict, "kind", str, "verdict.")
    known = [k.value for k in VerdictKind if k.schema_major <= major]
    if kind not in known:
        raise ReportError(f"unknown verdict.kind {kind!r}; schema forensics-report/{major} knows {', '.join(known)}")
    _require(verdict, "headline", str, "verdict.")
    if "suggestions" in verdict and not isinstance(verdict["suggestions"], list):
        raise ReportError("report field 'verdict.suggestions' must be a list of strings")
    culprit = _require(d, "culprit", dict, "")
    samples = _require(culprit, "samples", list, "culprit.")
    for i, s in enumerate(samples):
        if not isinstance(s, dict) or "sample_id" not in s:
            raise ReportError(f"culprit.samples[{i}] must be an object with a 'sample_id'")
    for key, typ in _OPTIONAL_TYPES.items():
        value = d.get(key)
        if value is not None and not isinstance(value, typ):
            raise ReportError(f"report field '{key}' must be {typ.__name__} or null, got {_type_name(value)}")
    for key in ("per_sample", "per_layer"):
        for i, row in enumerate(d.get(key) or []):
            if not isinstance(row, dict):
                raise ReportError(f"{key}[{i}] must be an object, got {_type_name(row)}")
    return d


def to_json_safe(obj: Any) -> Any:
    """Return a copy of `obj` that `json.dumps(..., allow_nan=False)` accepts.

    nan / inf / -inf become "nan" / "inf" / "-inf"; tuples, sets and lists become lists; dict keys
    become strings; torch / numpy scalars (and one-element tensors / arrays) become Python numbers
    or bools; Path becomes str; Enum becomes its value; anything else becomes its repr() string.

    Args:
        obj: any value, typically the report dict.
    Returns:
        A tree of dict / list / str / int / float / bool / None.
    Example:
        >>> to_json_safe({"loss": float("nan"), "shape": (2, 3)})
        {'loss': 'nan', 'shape': [2, 3]}
    """
    return json_tree(obj, _float_word, _safe_repr)


def _float_word(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _safe_repr(obj: Any) -> str:
    try:
        return repr(obj)
    except Exception:  # noqa: BLE001
        return f"<unrepresentable {type(obj).__name__}>"


def as_float(value: Any) -> float | None:
    """Decode a report number: a JSON number, "nan"/"inf"/"-inf", or null -> float or None.

    Also accepts the dump format's tagged {"__float__": "nan"}. Anything else -> None.

    Example:
        >>> as_float("inf"), as_float(1), as_float(None)
        (inf, 1.0, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _NONFINITE_STRINGS.get(value.strip().lower())
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return as_float(value["__float__"])
    if hasattr(value, "item") and hasattr(value, "shape"):  # a one-element torch / numpy value
        return as_float(to_json_safe(value))  # a repr string (several elements) reads as None
    return None


def load_report(path: str | os.PathLike) -> dict:
    """Read and validate a report.json.

    Args:
        path: the report.json file, or a directory holding one.
    Returns:
        The validated report dict (non-finite numbers stay encoded as "nan"/"inf"/"-inf").
    Raises:
        ReportError: the file is missing, not JSON, or not a valid report.
    Example:
        >>> report = load_report("replay-out/report.json")  # doctest: +SKIP
    """
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError(f"no report at {p}; run `forensics replay <dump>` to make one") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"cannot read report {p}: {e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{p} is not valid JSON ({e}); was it truncated? Re-run `forensics replay`") from e
    try:
        return validate_report(data)
    except ReportError as e:
        raise ReportError(f"{p}: {e}") from e
