"""How forensics words things for people, in one place: numbers, sample ids, micro-batch numbers, lists.

Used by the verdict prose (replay/judge/verdict.py), the terminal summary, Markdown and HTML renderers and
`forensics inspect`, so the same value reads the same everywhere. JSON keeps the raw values.
"""

from __future__ import annotations

import json
import math
import unicodedata
from typing import Any, Iterable

from forensics.core.kinds import HistoryPattern, VerdictKind
from forensics.report.model import as_float

MAX_ID_CHARS = 120  # longer sample ids are cut on screen (report.json keeps them whole)
MAX_LISTED_SAMPLES = 5


def clean(text: Any, max_chars: int | None = None) -> str:
    """One-line, terminal-safe text: control and format characters (ANSI escapes, newlines,
    bidi overrides) are shown as escapes; cut to `max_chars` with an ellipsis."""
    s = text if isinstance(text, str) else str(text)
    out = []
    for c in s:
        if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            out.append(c.encode("unicode_escape", "backslashreplace").decode("ascii"))
        else:
            out.append(c)
    s = "".join(out)
    if max_chars is not None and len(s) > max_chars:
        s = s[: max_chars - 1] + "…"
    return s


def fmt_id(sample_id: Any, max_chars: int = MAX_ID_CHARS) -> str:
    """A sample id as shown to people: strings in single quotes, other JSON values as JSON."""
    if isinstance(sample_id, str):
        return "'" + clean(sample_id, max_chars) + "'"
    try:
        text = json.dumps(sample_id, ensure_ascii=False, allow_nan=True, default=repr)
    except (TypeError, ValueError):
        text = repr(sample_id)
    return clean(text, max_chars)


ROOT_MODULE = "<root>"  # replay/localize/forward_backward.ROOT_MODULE: the model's own forward, outside its submodules
LOSS_MODULE = "<loss>"  # ... LOSS_MODULE: ops outside every module (the loss function's own code)
_MARKERS = {
    ROOT_MODULE: "the model's own forward (outside its submodules, e.g. where it computes the loss)",
    LOSS_MODULE: "the loss function's own code (outside every module)",
}


def module_words(name: Any, quote: bool = True) -> str:
    """' at `transformer.h.0.ln_2`' as people read it; the report's markers `<root>` (an op of the model's own
    forward, outside every submodule: a Hugging Face model's loss) and `<loss>` in words (' in the model's own
    forward ...')."""
    if name in _MARKERS:
        return f" in {_MARKERS[name]}"
    return f" at `{clean(name)}`" if quote else f" at {clean(name)}"


def fmt_num(value: Any, digits: int = 4) -> str:
    """A report number in short form: 1.234, 3.1e+38, nan, inf; null -> 'n/a'."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    x = as_float(value)
    if x is None:
        return "n/a" if value is None else clean(value, 40)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def fmt_list(values: Iterable[Any], limit: int = 8) -> str:
    vals = list(values)
    shown = ", ".join(fmt_num(v) for v in vals[-limit:])
    return ("…, " if len(vals) > limit else "") + shown


# ---- micro-batch numbers: 0-based in JSON, 1-based in every sentence a person reads ----


def mb_number(index: Any) -> str:
    """A 0-based micro-batch index as people count it: 1 -> '2' (as in 'micro-batch 2 of 4')."""
    if isinstance(index, int) and not isinstance(index, bool):
        return str(index + 1)
    return "?" if index is None else clean(index)


def mb_phrase(index: Any, total: Any = None) -> str:
    """'micro-batch 2 of 4' for index 1 of a 4-micro-batch step ('micro-batch 2' without a total)."""
    of = f" of {total}" if isinstance(total, int) and not isinstance(total, bool) and total > 0 else ""
    return f"micro-batch {mb_number(index)}{of}"


def fmt_size(num: int) -> str:
    """A byte count: '512 B', '3.1 MB'."""
    value = float(num)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


def verdict_label(kind: Any) -> str:
    """'bad sample' for a verdict kind; an unknown kind is shown cleaned, as it is."""
    try:
        return VerdictKind(kind).label
    except ValueError:
        return clean(kind)


def pattern_words(pattern: Any, trigger: Any = None) -> tuple[str, str]:
    """(words, usual cause) of a history pattern for a dump of `trigger` (HistoryPattern.cause_for); an unknown
    pattern as its cleaned name and no cause."""
    try:
        found = HistoryPattern(pattern)
    except ValueError:
        return clean(pattern).replace("_", " "), ""
    return found.words, found.cause_for(trigger)


def fp32_ran_words(ran: Any) -> str:
    """What an fp32 re-run ran, from a precision block's `fp32_ran`: '214 ops in float32, none in float16 or bfloat16
    (the code's own autocast held off 2 time(s))'."""
    ran = ran if isinstance(ran, dict) else {}
    ops = ran.get("ops") if isinstance(ran.get("ops"), dict) else {}
    if not sum(n for n in ops.values() if isinstance(n, int)):
        return "no matrix product, convolution or attention ran, so the pass's precision could not be checked"
    low = ", ".join(f"{fmt_num(n)} in {clean(k, 20)}" for k, n in sorted(ops.items()) if k in ("float16", "bfloat16"))
    held = []
    if ran.get("held_autocasts"):
        held.append(f"the code's own autocast held off {fmt_num(ran['held_autocasts'])} time(s)")
    if ran.get("held_casts"):
        held.append(f"{fmt_num(ran['held_casts'])} cast(s) to float16 / bfloat16 made in float32")
    text = f"{fmt_num(ops.get('float32', 0))} ops in float32, " + (
        f"but {low}" if low else "none in float16 or bfloat16"
    )
    return text + (f" ({'; '.join(held)})" if held else "")
