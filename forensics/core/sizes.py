"""Sizes in bytes as people write them ("16GiB", "800MiB", "32GB") and read them ("1.50 GiB"): the replay's
--memory-budget and the stream plan's words."""

from __future__ import annotations

import re

from forensics.core.errors import cut_text

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1 << 40,
}


MAX_SIZE = float(1 << 60)
"""The largest SIZE parse_bytes takes (1 EiB): beyond it a number is a typo, or a float that is no longer exact."""


def parse_bytes(text: str) -> int:
    """ "16GiB" -> 17179869184; "16GB" / "16G" are powers of ten; a bare number is bytes.

    Raises:
        ValueError: not a positive size.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write e.g. 16GiB, 800MiB or 32GB")
    value = float(match.group(1)) * _UNITS[unit]
    if not value < MAX_SIZE:  # also 1 followed by 400 zeros, which is inf as a float
        raise ValueError(f"{cut_text(text, 40)!r} is larger than any machine's memory (at most 1 EiB)")
    if int(value) <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return int(value)


def words(nbytes: float) -> str:
    """Bytes for people: 1.50 GiB, 300.0 MiB."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


__all__ = ["MAX_SIZE", "parse_bytes", "words"]
