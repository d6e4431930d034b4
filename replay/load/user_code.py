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
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

from forensics.core.errors import ForensicsError, UserCodeError
from forensics.core.fsio import our_code_directories
from forensics.recipes import BUILTIN_RECIPES, DEFAULT_LOSS, DEMO_MODEL_CODE, is_builtin

OURS = our_code_directories()
"""Where forensics' own code lies: a frame there is not the user's."""
_LIBRARIES = [os.path.dirname(torch.__file__)]
for _name in ("numpy", "safetensors", "zstandard"):
    try:
        _module = __import__(_name)
        if _module.__file__ is not None:
            _LIBRARIES.append(os.path.dirname(os.path.abspath(_module.__file__)))
    except ImportError:  # pragma: no cover - optional here
        pass
LIBRARIES = tuple(os.path.abspath(p) + os.sep for p in _LIBRARIES)
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})
_SITE = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})
"""Installed packages: under the standard library's directory in an installation without a virtual environment,
but not the standard library (forensics itself, transformers, the user's packages may be there)."""


def _library(filename: str) -> bool:
    """A frame of library code: the standard library, torch, numpy, safetensors, zstandard (or generated code)."""
    return (
        filename.startswith("<")
        or filename.startswith(LIBRARIES)
        or (filename.startswith(_STDLIB) and not filename.startswith(_SITE))
    )


def _module_file(module: str) -> str | None:
    spec = importlib.util.find_spec(module)  # finds the file without importing the module
    return os.path.abspath(spec.origin) if spec is not None and spec.origin else None


RECIPE_FILES = frozenset(
    filter(None, (_module_file(m) for m in {p.partition(":")[0] for p in BUILTIN_RECIPES} | set(DEMO_MODEL_CODE)))
)
"""The files of the built-in recipes' modules and the model code they build from: model code, though it ships with
forensics."""


def _frames(tb: TracebackType | None) -> list[str]:
    files = []
    while tb is not None:
        files.append(os.path.abspath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    return files


def _deciding_frame(exc: BaseException) -> str | None:
    """The file of the innermost frame outside library code (None: library frames only)."""
    for filename in reversed(_frames(exc.__traceback__)):
        if not _library(filename):
            return filename
    return None


def raised_by_user_code(exc: BaseException) -> bool:
    """True when the innermost frame outside library code is model code: outside forensics, capture and replay,
    or in a built-in recipe (RECIPE_FILES)."""
    filename = _deciding_frame(exc)
    return filename is not None and (filename in RECIPE_FILES or not filename.startswith(OURS))


def _built_in_model_raised(exc: BaseException) -> bool:
    """The model code that raised was entered through a built-in recipe: the outermost frame of model code (outside
    the libraries and forensics' own machinery), the default loss passed over (it only calls the model, which may be
    the user's), is in a demo model; or the default loss itself raised with nothing of the user's below it."""
    default_loss = _module_file(DEFAULT_LOSS.partition(":")[0])
    model_code = [
        f for f in _frames(exc.__traceback__) if not _library(f) and (f in RECIPE_FILES or not f.startswith(OURS))
    ]
    owners = [f for f in model_code if f != default_loss]
    return owners[0] in RECIPE_FILES if owners else bool(model_code)


def recipe_is_built_in(recorded: Mapping[str, Any], factory: str | None, loss: str | None) -> bool:
    """Whether the replay's model and loss are both built-in recipes (`factory` / `loss`: the user's --factory /
    --loss, else the dump's `recorded` recipe): then no code of the user's runs in a forward or a loss — the
    built-in Hugging Face recipe builds a class transformers itself exports, never remote code."""
    return is_builtin(factory or recorded.get("factory")) and is_builtin(loss or recorded.get("loss") or DEFAULT_LOSS)


def as_user_error(exc: Exception, doing: str, built_in_recipe: bool = False) -> Exception:
    """`exc` as a UserCodeError when model code raised it: the user's own with their traceback; a built-in recipe's
    (the demo models, the default loss, and with `built_in_recipe` — model and loss both built in, see
    recipe_is_built_in — transformers' code the built-in Hugging Face recipe runs) in one sentence, since its
    traceback would run through code the user did not write and cannot fix there. Else (a bug of forensics) `exc`
    itself."""
    if isinstance(exc, ForensicsError) or not raised_by_user_code(exc):
        return exc
    what = str(exc)[:300].rstrip(".")
    if built_in_recipe or _built_in_model_raised(exc):
        return UserCodeError(
            f"the model the dump's recipe names (built into forensics) raised {type(exc).__name__} "
            f"on the dump's data while {doing}: {what}. The data does not fit that model (a tensor of "
            "another shape, type or range than it takes): the dump was changed after it was written, or its "
            "recipe is not the job's; pass --factory / --loss that accept this data",
            "",
        )
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return UserCodeError(
        f"your code raised {type(exc).__name__} while {doing}: {what}. The traceback printed above "
        "is from your model / loss code; fix it, or pass --factory / --loss that accept this data",
        text,
    )
