"""Telling the user's code from forensics' own when replay meets an exception.

Replay runs code that is not forensics': the model's forward (a custom module, a transformers model),
the loss, the factory. When that code raises on the dump's data (a label out of range, a shape it does
not accept), the user must see their own traceback and exit 2 — not "a bug in forensics" (exit 1).

The rule: walk the traceback from where it was raised outwards, skipping library frames (the standard
library, torch, numpy, safetensors, zstandard); the first other frame decides. In forensics' own
packages it is a bug of ours; anywhere else (the user's modules, transformers' model code) it is theirs.
The built-in recipes (forensics.recipes.BUILTIN_RECIPES: the demo models, the default loss) are model
code too: the model a dump names raising on that dump's data is bad input, as it is for any model.
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig
import traceback
from types import TracebackType

import torch

from forensics.errors import ForensicsError, UserCodeError
from forensics.recipes import BUILTIN_RECIPES

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # replay/load/ -> the repository
OURS = tuple(os.path.join(_ROOT, package) + os.sep for package in ("forensics", "capture", "replay"))
_LIBRARIES = [sysconfig.get_paths()["stdlib"], os.path.dirname(torch.__file__)]
for _name in ("numpy", "safetensors", "zstandard"):
    try:
        _module = __import__(_name)
        _LIBRARIES.append(os.path.dirname(os.path.abspath(_module.__file__)))
    except ImportError:  # pragma: no cover - optional here
        pass
LIBRARIES = tuple(os.path.abspath(p) + os.sep for p in _LIBRARIES)


def _module_file(module: str) -> str | None:
    spec = importlib.util.find_spec(module)  # finds the file without importing the module
    return os.path.abspath(spec.origin) if spec is not None and spec.origin else None


RECIPE_FILES = frozenset(filter(None, (_module_file(path.partition(":")[0]) for path in BUILTIN_RECIPES)))
"""The files of the built-in recipes' modules: model code, though it ships with forensics."""


def _frames(tb: TracebackType | None) -> list[str]:
    files = []
    while tb is not None:
        files.append(os.path.abspath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    return files


def _deciding_frame(exc: BaseException) -> str | None:
    """The file of the innermost frame outside library code (None: library frames only)."""
    for filename in reversed(_frames(exc.__traceback__)):
        if not (filename.startswith(LIBRARIES) or filename.startswith("<")):
            return filename
    return None


def raised_by_user_code(exc: BaseException) -> bool:
    """True when the innermost frame outside library code is model code: outside forensics, capture and replay,
    or in a built-in recipe (RECIPE_FILES)."""
    filename = _deciding_frame(exc)
    return filename is not None and (filename in RECIPE_FILES or not filename.startswith(OURS))


def as_user_error(exc: Exception, doing: str) -> Exception:
    """`exc` as a UserCodeError (with the user's traceback) when their code raised it; else `exc` itself."""
    if isinstance(exc, ForensicsError) or not raised_by_user_code(exc):
        return exc
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    what = str(exc)[:300].rstrip(".")
    if _deciding_frame(exc) in RECIPE_FILES:
        message = (f"the model the dump's recipe names (built into forensics) raised {type(exc).__name__} on the "
                   f"dump's data while {doing}: {what}. The data does not fit that model (a tensor of "
                   "another shape or type than it takes): the dump was changed after it was written, or its recipe "
                   "is not the job's; pass --factory / --loss that accept this data")
    else:
        message = (f"your code raised {type(exc).__name__} while {doing}: {what}. The traceback printed "
                   "above is from your model / loss code; fix it, or pass --factory / --loss that accept this data")
    return UserCodeError(message, text)
