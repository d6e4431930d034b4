"""Consent and imports: pick the model factory, loss and optimizer class a dump names, importing only what the user agreed to.

A dump names the code that rebuilds its model (`recipe.factory`, `recipe.loss`) and its optimizer
class. Nothing a dump names is imported unless the user agreed to it:

* `trust=True` (CLI `--trust`): import what the dump names;
* `factory="module:fn"` / `loss="module:fn"` (CLI `--factory`, `--loss`): the user names the code;
* built-in recipes (forensics.recipes.BUILTIN_RECIPES: `forensics.recipes:huggingface_model`,
  `forensics.recipes:default_loss`, the demo's models) are forensics' own code (a dump can only
  *pick* one, not change it), so they are used without trust;
* optimizer classes from `torch.optim` are used without trust; any other class needs `trust=True`;
* a function of the job's training script (`__main__:fn`) is never imported (that would run the script's
  training again): with `trust=True` it is defined from the script's source the dump holds
  (replay/load/main_script.py), with the values of the globals it read in the job (recorded in the dump); without,
  or without that source, the error says what to pass. The same for `--factory __main__:fn` / `--loss __main__:fn`
  the user names (a model whose factory the job could not record: the dump then holds the script too).

Where imports come from. The user's --path entries (`sys_path`) go in front of sys.path, as PYTHONPATH would put
them. The directories a dump names — the job's script directory and working directory (manifest
`environment.script_dir`, `environment.cwd`) — are used only with `trust=True`, and then after every other way
to import (RecordedDirsFinder, last on sys.meta_path, serving only names nothing installed resolves), so a file planted
there can never stand in for a module or namespace package that exists here (`shlex`, `yaml`, `transformers`, the
`google` namespace): `python train.py` had them importable, so `from model import GPT` in
the script or a recipe `tinylm:build` beside it imports without --path (job_paths). Directories that are not real
directories of this host (under /proc, /sys, /dev) or that lie inside the dump itself are never added. A --factory
or --loss the user names consents to that code alone, not to the dump's directories: when it is not found, the
error names the recorded directory that holds it (pass it with --path).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from forensics.core.errors import RecipeError
from forensics.format.location import Location, RemotePath, is_url
from forensics.recipes import is_builtin
from forensics.report.wording import clean
from forensics.replay.load.main_script import TRUST_NOTE, define_from_script, move_instruction

logger = logging.getLogger(__name__)

DEFAULT_LOSS_PATH = "forensics.recipes:default_loss"
MAIN_PREFIX = "__main__:"  # a function of the job's training script (python train.py)
TRUSTED_OPTIMIZER_PREFIX = "torch.optim."

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


LEGACY_PATHS = {
    "capture.integrations.lightning:training_step_loss": "forensics.capture.integrations.lightning:training_step_loss"
}
"""Import paths forensics itself wrote into dumps while its two sides were the top-level packages `capture` and
`replay` (before commit e5f195a, "One import root"): the Lightning callback's default replay loss, recorded as the
job's `loss_fn` (no other function of ours was ever recorded as a factory or loss: `git log -p -S` of
capture/state/recipe.py and the integrations). Only these exact names are rewritten; any other `replay.*` or
`capture.*` is a user's own package (a replay buffer is common in RL) and is imported as named."""


def current_path(path: str) -> str:
    """`path` as it is imported now: one of LEGACY_PATHS under its current name, anything else unchanged."""
    return LEGACY_PATHS.get(path, path) if isinstance(path, str) else path


def _split_path(path: str, what: str) -> tuple[str, str]:
    if not isinstance(path, str) or ":" not in path:
        raise RecipeError(f"the {what} {path!r} is not of the form 'package.module:function'")
    module, _, attr = current_path(path).partition(":")
    if not module or not attr:
        raise RecipeError(f"the {what} {path!r} is not of the form 'package.module:function'")
    return module, attr


def _put_on_sys_path(sys_path: tuple[str, ...] | list[str]) -> None:
    """The user's own import directories, in front (kept: model code may import lazily at forward time)."""
    for entry in reversed(list(sys_path)):
        if entry not in sys.path:
            sys.path.insert(0, entry)


class RecordedDirsFinder(importlib.abc.MetaPathFinder):
    """Serves top-level modules from the job's recorded directories (consented with trust), and only names nothing
    else on this host resolves: placed after every other finder of sys.meta_path, it is asked only when the standard
    library, the installed packages and sys.path lack the name — a namespace package included (a regular `google/`
    package there never replaces the installed `google` namespace, as it would from anywhere on sys.path) — and it
    asks the finders placed after it first. The directories never go on sys.path itself."""

    def __init__(self) -> None:
        self.dirs: list[str] = []

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if path is not None or "." in fullname or not self.dirs:  # submodules: found through their package's path
            return None
        later = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
        for finder in later:
            find = getattr(finder, "find_spec", None)
            if callable(find) and find(fullname, None, target) is not None:
                return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, list(self.dirs))
        if spec is not None and spec.loader is None and spec.submodule_search_locations is not None:
            # a namespace package only the recorded directories hold: its portions fixed (recomputed from sys.path,
            # which lacks these directories, they would vanish)
            spec.submodule_search_locations = list(spec.submodule_search_locations)
        return spec


def _append_to_sys_path(job_dirs: tuple[str, ...] | list[str]) -> None:
    """Directories the dump names (consented with trust): served by the RecordedDirsFinder after every other way to
    import, never ahead of (nor inside a namespace of) the standard library or an installed package."""
    if not job_dirs:
        return
    finder = next((f for f in sys.meta_path if isinstance(f, RecordedDirsFinder)), None)
    if finder is None:
        finder = RecordedDirsFinder()
        sys.meta_path.append(finder)
    for entry in job_dirs:
        if entry not in finder.dirs:
            finder.dirs.append(entry)


def import_object(
    path: str,
    what: str = "recipe",
    sys_path: tuple[str, ...] | list[str] = (),
    job_dirs: tuple[str, ...] | list[str] = (),
) -> Any:
    """Imports `module:attr.sub` (no consent check: call only for paths the user agreed to). `sys_path` goes in
    front of sys.path; `job_dirs` (directories the dump names: pass them only with trust) after every other way to import (RecordedDirsFinder)."""
    module_name, attr = _split_path(path, what)
    _put_on_sys_path(sys_path)
    _append_to_sys_path(job_dirs)
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # any import-time failure of user code is a recipe problem
        raise RecipeError(
            f"cannot import the {what} {clean(path, 200)!r}: {type(exc).__name__}: {clean(str(exc), 300)}. "
            "Check the path, or pass --path DIR (sys_path=) so Python can find the module"
        ) from exc
    if not callable(obj):
        raise RecipeError(f"the {what} {clean(path, 200)!r} is not callable")
    return obj


def _where_recorded(path: str, recorded_dirs: list[str]) -> str | None:
    """The first directory the dump names that holds `path`'s top-level module (a hint for --path; nothing there is
    imported)."""
    top = path.partition(":")[0].split(".")[0]
    for directory in recorded_dirs:
        if os.path.isfile(os.path.join(directory, top + ".py")) or os.path.isdir(os.path.join(directory, top)):
            return directory
    return None


def import_named(path: str, what: str, sys_path: tuple[str, ...] | list[str], recorded_dirs: list[str]) -> Any:
    """Imports code the user named (--factory / --loss): from the installed packages and their --path entries only.
    When it is not found there but one of the job's recorded directories holds it, the error says to pass that
    directory with --path (naming code consents to that code, not to the directories a dump names)."""
    try:
        return import_object(path, what, sys_path)
    except RecipeError as exc:
        if not isinstance(exc.__cause__, ImportError):
            raise
        found = _where_recorded(path, recorded_dirs)
        if found is None or found in sys_path:
            raise
        raise RecipeError(
            f"{exc}. The job ran from {clean(found, 200)}, which holds it: pass --path "
            f"{clean(found, 200)} if you trust the code there (forensics does not import from a "
            "directory the dump names unless you pass --trust)"
        ) from exc.__cause__


@dataclass
class TrainingScript:
    """The job's training script as the dump holds it (manifest `recipe.script`), or why it does not."""

    name: str = "the training script"
    source: bytes | None = None
    globals: dict = field(default_factory=dict)
    """The job's values of the globals its functions read (manifest `recipe.script.globals`)."""
    unrecorded: dict = field(default_factory=dict)
    """Globals they read whose values the dump could not hold: name -> type name."""
    used: list[str] = field(default_factory=list)
    """Filled at replay: the recorded globals a function defined from the script uses (said in the report)."""


def _from_main(path: str, what: str, trust: bool, script: TrainingScript, flag: str) -> Any:
    """`__main__:fn`: defined from the recorded script with trust; never imported (see the module docstring)."""
    qualname = path.removeprefix(MAIN_PREFIX)
    shown, name = clean(qualname, 100), clean(script.name, 100)
    move = move_instruction(qualname, script.name, flag)
    if script.source is None:
        raise RecipeError(
            f"the dump's {what} `{shown}` was defined in the job's training script (__main__), and the "
            "dump holds no copy of that script; forensics does not import the script (that would run all of its "
            "top-level code). "
            f"To replay, {move}."
        )
    if not trust:
        raise RecipeError(
            f"the dump's {what} `{shown}` is defined in the training script {name}, whose source the "
            "dump holds; it was NOT run. Pass --trust to define it from that source (only the script's "
            f"imports, definitions and constants run, never its training code; {TRUST_NOTE}), or "
            f"{move}."
        )
    obj, used = define_from_script(script.source, qualname, script.name, what, flag, script.globals, script.unrecorded)
    script.used.extend(name for name in used if name not in script.used)
    return obj


def _consented(path: str, what: str, trust: bool, sys_path, script: TrainingScript, job_dirs: list[str]) -> Any:
    """The recorded `path`, imported where consent allows it: built-ins always; anything else with trust, which also
    lets the job's recorded directories serve imports (after every other way to import)."""
    flag = "--factory" if what == "model factory" else "--loss"
    if isinstance(path, str) and path.startswith(MAIN_PREFIX):
        if trust:
            _put_on_sys_path(sys_path)  # the script's own imports (`from model import GPT`)
            _append_to_sys_path(job_dirs)
        return _from_main(path, what, trust, script, flag)
    if trust:
        return import_object(path, what, sys_path, job_dirs)
    if is_builtin(path):
        return import_object(path, what, sys_path)
    raise RecipeError(
        f"the dump asks to import the {what} {path!r}, which is not forensics' own code; it was NOT "
        f"imported. If you trust this dump and that code, pass --trust (trust=True), or name the code "
        f"yourself with {flag} module:fn (e.g. {flag} {path})."
    )


@dataclass
class ResolvedRecipe:
    factory: Callable[..., torch.nn.Module]
    factory_kwargs: dict
    loss_fn: LossFn
    factory_path: str
    loss_path: str
    notes: list[str] = field(default_factory=list)
    """What the report should say about how the code was found (recorded globals used, sys.path entries added)."""


def _kwargs(recorded_path: Any, override: str | None, recorded: Any, given: dict | None) -> dict:
    """The keyword arguments for a factory or loss: `given` (--factory-kwargs / --loss-kwargs); else the recorded
    ones — also for a --factory / --loss that names the user's code moved out of the script — unless they belong to
    a built-in recipe the override replaces (the default loss's `ignore_keys`, the Hugging Face factory's config)."""
    if given is not None:
        return dict(given)
    if override and override != recorded_path and (not recorded_path or is_builtin(recorded_path)):
        return {}
    return dict(recorded or {}) if isinstance(recorded, dict) else {}


# Directories of the host's kernel, never a job's code: a dump naming one (e.g. /proc/self/cwd, which is whatever
# directory the replay runs in) is ignored.
SYSTEM_DIRS = ("/proc", "/sys", "/dev")


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def job_paths(environment: dict | None, dump_dir: str | os.PathLike | Location | None = None) -> list[str]:
    """The job's script directory and working directory (manifest `environment`) as real directories of this host:
    absolute, existing, resolved through symbolic links, not under /proc, /sys or /dev, and not inside the dump
    (`dump_dir`) itself. Put on sys.path only with trust (see the module docstring)."""
    environment = environment or {}
    own = (
        None
        if dump_dir is None or isinstance(dump_dir, RemotePath) or is_url(str(dump_dir))
        else os.path.realpath(dump_dir)
    )
    found: list[str] = []
    for key in ("script_dir", "cwd"):
        path = environment.get(key)
        if not (isinstance(path, str) and "\x00" not in path and os.path.isabs(path)):
            continue
        real = os.path.realpath(path)
        if (
            not os.path.isdir(real)
            or any(_inside(p, d) for p in (os.path.normpath(path), real) for d in SYSTEM_DIRS)
            or (own is not None and _inside(real, own))
            or real in found
        ):
            continue
        found.append(real)
    return found


def recorded_dirs_note(job_dirs: list[str] | tuple[str, ...]) -> str:
    """What --trust adds to the imports, in the words the report and the consent text use."""
    return (
        "with --trust, modules not found in the standard library or the installed packages are imported from the "
        "job's directories recorded in the dump: "
        + ", ".join(clean(d, 200) for d in job_dirs)
        + " (never in place of an installed package or namespace package)"
    )


def resolve_recipe(
    recipe: dict | None,
    *,
    trust: bool = False,
    factory: str | None = None,
    loss: str | None = None,
    sys_path: tuple[str, ...] | list[str] = (),
    script: TrainingScript | None = None,
    factory_kwargs: dict | None = None,
    loss_kwargs: dict | None = None,
    job_dirs: list[str] | tuple[str, ...] = (),
) -> ResolvedRecipe:
    """Picks the model factory and loss function, importing only what the user consented to.

    Args:
        recipe: the dump's recipe {"factory", "factory_kwargs", "loss", "loss_kwargs"}.
        trust: import whatever the recipe names.
        factory / loss: "module:fn" named by the user; used instead of the recipe's (always imported).
        sys_path: extra import directories (e.g. the training repo), added in front of sys.path.
        script: the training script the dump holds, for a recipe naming `__main__:fn`.
        factory_kwargs / loss_kwargs: used instead of the recorded ones (CLI --factory-kwargs / --loss-kwargs);
            None keeps the recorded ones, also with --factory / --loss.
        job_dirs: the job's script and working directories (job_paths): served after every other way to import, with trust only.
    Returns:
        ResolvedRecipe with callables; the loss takes (model, batch).
    Raises:
        RecipeError: nothing usable, not consented (message shows the path and says --trust /
            --factory), or the import failed.
    """
    recipe = recipe or {}
    script = script or TrainingScript()
    notes: list[str] = []
    recorded_dirs = [d for d in job_dirs if d not in sys_path]
    consented_dirs = recorded_dirs if trust else []
    if consented_dirs:
        notes.append(recorded_dirs_note(consented_dirs))
    factory_path = factory or recipe.get("factory")
    if not factory_path:
        raise RecipeError(
            "the dump has no model recipe; pass --factory module:fn, a function that "
            "returns the model (weights are loaded from the dump afterwards)"
        )
    if factory and factory.startswith(MAIN_PREFIX):  # a function of the training script the dump holds: defined from
        factory_fn = _consented(factory, "model factory", trust, sys_path, script, consented_dirs)  # it, with trust
    elif factory:
        factory_fn = (
            import_object(factory, "model factory", sys_path, consented_dirs)
            if trust
            else import_named(factory, "model factory", sys_path, recorded_dirs)
        )
    else:
        factory_fn = _consented(factory_path, "model factory", trust, sys_path, script, consented_dirs)
    loss_path = loss or recipe.get("loss") or DEFAULT_LOSS_PATH
    if not loss and "loss" in recipe and not recipe.get("loss"):
        logger.warning(
            "the job's loss function could not be named in the dump (a lambda or closure?); "
            "replaying with %s. Pass --loss module:fn to use the job's own.",
            DEFAULT_LOSS_PATH,
        )
    if loss and loss.startswith(MAIN_PREFIX):
        loss_callable = _consented(loss, "loss function", trust, sys_path, script, consented_dirs)
    elif loss:
        loss_callable = (
            import_object(loss, "loss function", sys_path, consented_dirs)
            if trust
            else import_named(loss, "loss function", sys_path, recorded_dirs)
        )
    else:
        loss_callable = _consented(loss_path, "loss function", trust, sys_path, script, consented_dirs)
    loss_kw = _kwargs(recipe.get("loss"), loss, recipe.get("loss_kwargs"), loss_kwargs)
    loss_fn: LossFn = (lambda model, batch: loss_callable(model, batch, **loss_kw)) if loss_kw else loss_callable
    kwargs = _kwargs(recipe.get("factory"), factory, recipe.get("factory_kwargs"), factory_kwargs)
    if script.used:
        values = ", ".join(f"{name}={clean(repr(script.globals[name]), 60)}" for name in script.used[:12])
        notes.append(
            f"defined from {clean(script.name, 100)} with the values the job's top-level code gave its "
            f"globals (recorded in the dump): {values}"
        )
    return ResolvedRecipe(factory_fn, kwargs, loss_fn, factory_path, loss_path, notes)


def optimizer_class(path: str, trust: bool) -> type:
    """The optimizer class named `path` ("torch.optim.adamw.AdamW"); non-torch classes need trust."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise RecipeError(f"optimizer class {path!r} is not a dotted path")
    if not (path.startswith(TRUSTED_OPTIMIZER_PREFIX) or trust):
        raise RecipeError(
            f"the dump's optimizer is {path!r}, which is not a torch.optim class; it was NOT "
            "imported. Pass --trust to import it (or replay without optimizer state)."
        )
    cls = import_object(f"{module_name}:{name}", "optimizer class")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise RecipeError(f"{path!r} is not a torch.optim.Optimizer subclass")
    return cls


__all__ = [
    "ResolvedRecipe",
    "TrainingScript",
    "job_paths",
    "recorded_dirs_note",
    "import_named",
    "resolve_recipe",
    "is_builtin",
    "import_object",
    "optimizer_class",
    "LossFn",
    "DEFAULT_LOSS_PATH",
    "TRUSTED_OPTIMIZER_PREFIX",
]
