"""The training script's source, recorded for a loss or model factory defined in it (`python train.py`), and for a
model without a recorded factory (the user can then name one the script defines: `--factory __main__:build --trust`).

Such a function is named `__main__:lm_loss`, which replay cannot import: `__main__` there is forensics, and
importing `train` instead would run the script's training again. So the Guard reads the script once, when it
is created (what the job runs, not a later edit), and each dump holds it as `main_script.py` (size-capped);
replay defines the function from it, behind --trust, without running its top-level training code
(replay/load/main_script.py). Such a function often reads module globals that only the script's top level sets
(nanoGPT's `exec(open('configurator.py').read())`, `globals().update(...)`, `ddp_world_size` from the environment):
at each dump the values of the globals it reads (its code objects' names, and those of the script's own functions
it calls) are recorded by name when they are JSON values (`recipe.script.globals`), and named with their type when
they are not (`recipe.script.unrecorded`); replay defines them before the function runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from typing import Any

from forensics.format import spec

log = logging.getLogger(__name__)

MAIN_PREFIX = "__main__:"
MAX_GLOBAL_BYTES = 64 << 10  # one global's JSON: a config dict fits, a tokenizer's vocabulary does not
MAX_GLOBALS_BYTES = 256 << 10  # all of them: the manifest stays small (its reader caps it, docs/DUMP_FORMAT.md)


def uses_main(recipe: dict) -> bool:
    """The recipe's loss or factory is defined in the training script."""
    return any(isinstance(recipe.get(key), str) and recipe[key].startswith(MAIN_PREFIX) for key in ("loss", "factory"))


def wants_script(recipe: dict) -> bool:
    """The dump should hold the training script: the recipe names a function of it, or names no model factory (the
    user may then name one defined in the script at replay: `--factory __main__:build --trust`)."""
    return uses_main(recipe) or not recipe.get("factory")


class MainScript:
    """The script's bytes (or why there are none) for dumps whose recipe names `__main__`."""

    def __init__(self, recipe: dict):
        self.source: bytes | None = None
        self.name = "the training script"
        self.why_missing: str | None = None
        if wants_script(recipe):
            self._read(say=uses_main(recipe))

    def _read(self, say: bool = True) -> None:
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        if not path or not os.path.isfile(path):
            self.why_missing = "the job's __main__ is not a script file (an interactive session, python -c)"
        else:
            self.name = os.path.basename(path)
            try:
                size = os.path.getsize(path)
                if size > spec.MAX_MAIN_SCRIPT:
                    self.why_missing = f"{self.name} is {size} bytes, over the {spec.MAX_MAIN_SCRIPT} recorded"
                else:
                    with open(path, "rb") as file:
                        self.source = file.read(spec.MAX_MAIN_SCRIPT + 1)[: spec.MAX_MAIN_SCRIPT]
            except OSError as exc:
                self.why_missing = f"{self.name} could not be read ({type(exc).__name__}: {exc})"
        if self.why_missing and say:
            log.warning(
                "forensics: the loss or model factory is defined in the training script, but %s: replay will "
                "need it in an importable module (--loss module:fn)",
                self.why_missing,
            )

    def describe(self, recipe: dict) -> dict:
        """The manifest's recipe, with `script` naming the recorded source and the globals its functions read
        (docs/DUMP_FORMAT.md `recipe`)."""
        if not uses_main(recipe):
            if self.source is None or not wants_script(recipe):
                return recipe
            return {**recipe, "script": {"file": spec.MAIN_SCRIPT, "name": self.name, "globals": {}, "unrecorded": {}}}
        recipe = dict(recipe)
        if self.source is not None:
            try:
                recorded, unrecorded = read_globals(recipe)
            except Exception as exc:  # noqa: BLE001 - odd objects in __main__ must not cost the dump
                log.warning("forensics: could not read the training script's globals (%s: %s)", type(exc).__name__, exc)
                recorded, unrecorded = {}, {}
            recipe["script"] = {
                "file": spec.MAIN_SCRIPT,
                "name": self.name,
                "globals": recorded,
                "unrecorded": unrecorded,
            }
            recipe["note"] = (
                f"defined in the training script {self.name}, whose source the dump holds: replay --trust "
                "defines it from there without running the script's training code"
            )
        else:
            recipe["note"] = (
                f"defined in the training script, which the dump does not hold ({self.why_missing}): "
                "move it into a module and replay with --loss module:fn --path DIR"
            )
        return recipe

    def files(self) -> dict[str, bytes]:
        """The dump's extra file holding the script ({} when there is none)."""
        return {spec.MAIN_SCRIPT: self.source} if self.source is not None else {}


def _code_names(code: types.CodeType) -> set[str]:
    """Every global (or attribute) name a code object and the code nested in it (closures, comprehensions) read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _codes(obj: Any) -> list[types.CodeType]:
    """The code of a function, or of a class's methods (a class the recipe names as its factory)."""
    obj = getattr(obj, "__func__", obj)
    if isinstance(obj, types.FunctionType):
        return [obj.__code__]
    if isinstance(obj, type):
        return [c for value in vars(obj).values() for c in _codes(value)]
    return []


def _json_value(value: Any) -> tuple[bool, int]:
    """(value survives a JSON round trip unchanged and fits MAX_GLOBAL_BYTES, its size in bytes). Encoded piece by
    piece and abandoned past the cap: a 10-million-token list global costs nothing at dump time."""
    try:
        pieces, size = [], 0
        for piece in json.JSONEncoder(allow_nan=False).iterencode(value):
            size += len(piece)
            if size > MAX_GLOBAL_BYTES:
                return False, size
            pieces.append(piece)
        return json.loads("".join(pieces)) == value, size
    except (TypeError, ValueError, RecursionError):
        return False, 0


def read_globals(recipe: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """The values of the `__main__` globals the recipe's functions read: ({name: JSON value}, {name: type name}).

    Follows the script's own functions and classes they use; leaves out modules, functions and classes (replay
    defines those from the source) and dunder names. A value that is not JSON (a tensor, a module instance) or is
    over MAX_GLOBAL_BYTES is named with its type only: replay refuses a function that needs it, saying so.
    """
    main = sys.modules.get("__main__")
    space = vars(main) if main is not None else {}
    todo: list[Any] = []
    for key in ("loss", "factory"):
        path = recipe.get(key)
        if isinstance(path, str) and path.startswith(MAIN_PREFIX):
            obj: Any = main
            for part in path.removeprefix(MAIN_PREFIX).split("."):
                obj = getattr(obj, part, None)
            todo.append(obj)
    seen: set[int] = set()
    names: set[str] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for code in _codes(obj):
            for name in _code_names(code) - names:
                names.add(name)
                value = space.get(name)
                if getattr(value, "__module__", None) == "__main__" and callable(value):
                    todo.append(value)
    recorded: dict[str, Any] = {}
    unrecorded: dict[str, str] = {}
    total = 0
    for name in sorted(names):
        if name not in space or name.startswith("__"):
            continue
        value = space[name]
        if isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)):
            continue  # defined again from the source (defs, classes, imports)
        ok, size = _json_value(value)
        if ok and total + size <= MAX_GLOBALS_BYTES:
            recorded[name] = value
            total += size
        else:
            unrecorded[name] = type(value).__qualname__[:100]
    return recorded, unrecorded
