"""Telling the user's code from forensics' own when replay meets an exception.

Replay runs code that is not forensics': the model's forward (a custom module, a transformers model),
the loss, the factory. When that code raises on the dump's data (a label out of range, a shape it does
not accept), the user must see their own traceback and exit 2 — not "a bug in forensics" (exit 1).

The rule: walk the traceback from where it was raised outwards, skipping library frames (the standard
library, torch, numpy, safetensors, zstandard); the first other frame decides. In forensics' own
packages it is a bug of ours; anywhere else (the user's modules, transformers' model code) it is theirs.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from types import TracebackType

import torch

from forensics.errors import ForensicsError, UserCodeError

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = tuple(os.path.join(_ROOT, package) + os.sep for package in ("forensics", "capture", "replay"))
_LIBRARIES = [sysconfig.get_paths()["stdlib"], os.path.dirname(torch.__file__)]
for _name in ("numpy", "safetensors", "zstandard"):
    try:
        _module = __import__(_name)
        _LIBRARIES.append(os.path.dirname(os.path.abspath(_module.__file__)))
    except ImportError:  # pragma: no cover - optional here
        pass
LIBRARIES = tuple(os.path.abspath(p) + os.sep for p in _LIBRARIES)


def _frames(tb: TracebackType | None) -> list[str]:
    files = []
    while tb is not None:
        files.append(os.path.abspath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    return files


def raised_by_user_code(exc: BaseException) -> bool:
    """True when the innermost frame outside library code belongs to neither forensics, capture nor replay."""
    for filename in reversed(_frames(exc.__traceback__)):
        if filename.startswith(LIBRARIES) or filename.startswith("<"):
            continue
        return not filename.startswith(OURS)
    return False


def as_user_error(exc: Exception, doing: str) -> Exception:
    """`exc` as a UserCodeError (with the user's traceback) when their code raised it; else `exc` itself."""
    if isinstance(exc, ForensicsError) or not raised_by_user_code(exc):
        return exc
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = (f"your code raised {type(exc).__name__} while {doing}: {str(exc)[:300]}. The traceback printed "
               "above is from your model / loss code; fix it, or pass --factory / --loss that accept this data")
    return UserCodeError(message, text)
