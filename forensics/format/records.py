"""The loss history (`history.json`) and the precursor table (`precursors.json`) of a dump, checked once at the loader.

Both are untrusted numbers that the replay fits trends to, plots and words: a 400-digit integer (valid JSON) raised
OverflowError deep in a trend fit or a plot, a firing without its `statistic` a KeyError. So each file is parsed here
into values of one kind each — steps integers within int64, measurements Python floats (NaN and Inf kept: a
non-finite loss is what a crash dump records), names strings, the keys a reader uses present — and a file that
cannot be is refused as a whole (ValueError, worded to follow the file's name). Nothing downstream sees a raw value.
"""

from __future__ import annotations

import math
from typing import Any

from forensics.core.errors import cut_text

MAX_INT = (1 << 63) - 1
"""Steps, counts and sizes are int64 in the job; anything beyond is not a value the Guard wrote."""


def checked_history(history: dict) -> dict:
    """`history.json` with every column a list of None / bool / number (steps and counts ints within int64, the rest
    floats) and `summary` an object of the same; `capacity` an int. Raises ValueError naming the first bad value."""
    out: dict[str, Any] = {}
    for key, column in history.items():
        if key == "capacity":
            out[key] = _int(column, "capacity") if column is not None else None
        elif key == "summary":
            if not isinstance(column, dict):
                raise ValueError("'summary' must be an object")
            out[key] = {k: _value(v, f"summary.{k}", integer=k.endswith(("step", "steps"))) for k, v in column.items()}
        elif not isinstance(column, list):
            raise ValueError(f"column {cut_text(key, 60)!r} must be a list")
        else:
            out[key] = [_value(v, f"{key}[{i}]", integer=key == "step") for i, v in enumerate(column)]
    return out


def checked_precursors(table: dict) -> dict:
    """`precursors.json` as `{"columns": [{"layer", "statistic", "dtype"?, "limit"?}], "steps": [int], "values":
    [[float | None per column] per step], "firings": [{"step", "layer", "statistic", "rule", "value", "baseline",
    "started", "dumped", ...}], "config": {...}}`: every number in range, every firing with its step, layer and
    statistic. Raises ValueError naming the first bad value."""
    columns = []
    for j, column in enumerate(_list(table.get("columns"), "columns")):
        if (
            not isinstance(column, dict)
            or not isinstance(column.get("layer"), str)
            or not isinstance(column.get("statistic"), str)
        ):
            raise ValueError(f"column {j} must be {{'layer': str, 'statistic': str}}")
        row = {"layer": column["layer"], "statistic": column["statistic"]}
        if isinstance(column.get("dtype"), str):
            row["dtype"] = column["dtype"]
        limit = _value(column.get("limit"), f"columns[{j}].limit")
        if isinstance(limit, float) and math.isfinite(limit) and limit > 0:
            row["limit"] = limit
        columns.append(row)
    steps = [_int(s, f"steps[{i}]") for i, s in enumerate(_list(table.get("steps"), "steps"))]
    values = _list(table.get("values"), "values")
    if len(values) != len(steps):
        raise ValueError("one row of values per step")
    rows = []
    for i, row in enumerate(values):
        if not isinstance(row, list) or len(row) != len(columns):
            raise ValueError(f"every row must hold {len(columns)} numbers or nulls")
        rows.append([_float(v, f"values[{i}][{j}]") for j, v in enumerate(row)])
    firings = [_firing(f, i) for i, f in enumerate(_list(table.get("firings") or [], "firings"))]
    raw = table.get("config")
    raw = raw if isinstance(raw, dict) else {}
    config = {
        k: _value(v, f"config.{k}", integer=isinstance(v, int))
        for k, v in raw.items()
        if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
    }  # the settings: numbers
    return {"columns": columns, "steps": steps, "values": rows, "firings": firings, "config": config}


def _firing(firing: Any, index: int) -> dict:
    if not isinstance(firing, dict):
        raise ValueError(f"firing {index} must be an object")
    missing = [k for k in ("step", "layer", "statistic") if k not in firing]
    if missing:
        raise ValueError(f"firing {index} lacks {', '.join(repr(k) for k in missing)}")
    if not isinstance(firing["layer"], str) or not isinstance(firing["statistic"], str):
        raise ValueError(f"firing {index}: 'layer' and 'statistic' must be strings")
    out = {
        "step": _int(firing["step"], f"firings[{index}].step"),
        "layer": firing["layer"],
        "statistic": firing["statistic"],
        "dumped": firing.get("dumped") is True,
    }
    for key in ("value", "baseline", "z"):
        out[key] = _float(firing.get(key), f"firings[{index}].{key}")
    started = firing.get("started")
    out["started"] = _int(started, f"firings[{index}].started") if started is not None else None
    for key in ("rule", "words"):
        if isinstance(firing.get(key), str):
            out[key] = firing[key]
    return out


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"'{what}' must be a list")
    return value


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) > MAX_INT:
        raise ValueError(f"{where} must be an integer within int64, not {cut_text(repr(value), 40)}")
    return value


def _float(value: Any, where: str) -> float | None:
    """A measurement: None, or a float (an int converted; NaN / Inf kept)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number or null, not {cut_text(repr(value), 40)}")
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise ValueError(f"{where} is out of range ({len(str(abs(value)))} digits)")
    return float(value)


def _value(value: Any, where: str, integer: bool = False) -> Any:
    """A history / config cell: None, a bool, a string kept; a list checked element by element; a number an int
    within int64 where `integer` (else a float)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, list):
        return [_value(v, f"{where}[{i}]", integer) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _value(v, f"{where}.{k}", integer) for k, v in value.items()}
    if integer and isinstance(value, int):
        return _int(value, where)
    if isinstance(value, (int, float)):
        return _float(value, where)
    raise ValueError(f"{where} must be a number, not {type(value).__name__}")
