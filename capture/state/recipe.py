"""The replay recipe recorded in a dump: import paths of a model factory and loss, never executed here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from forensics.recipes import DEFAULT_LOSS, huggingface_recipe, is_builtin, model_class


def import_path(fn: Callable) -> str | None:
    """`module:qualname` for a module-level function, or None where it cannot be imported by name."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or "<" in qualname:  # lambdas and closures
        return None
    return f"{module}:{qualname}"


def build_recipe(model: torch.nn.Module, loss_fn: Callable | None, sample_id_key: str, override: dict | None) -> dict:
    """The recipe written to the manifest (docs/DUMP_FORMAT.md `recipe`; keys documented in docs/GUIDE.md).

    A user override (GuardConfig.dumping.recipe) replaces a field together with the fields that belong to it:
    a new `factory` drops the automatic `factory_kwargs` (and `loss` its `loss_kwargs`) unless the override
    gives its own.
    """
    recipe = dict(huggingface_recipe(model) or {})
    if not recipe:
        cls = model_class(model)
        recipe = {
            "factory": None,
            "factory_kwargs": {},
            "model_class": f"{cls.__module__}.{cls.__qualname__}",
            "source": "unknown: pass DumpConfig(recipe={'factory': 'pkg.mod:fn', ...}) or --factory at replay",
        }
    if loss_fn is None:
        recipe.update(loss=DEFAULT_LOSS, loss_kwargs={"ignore_keys": [sample_id_key]})
    else:
        recipe.update(loss=import_path(loss_fn), loss_kwargs={})
    if override:
        override = dict(override)
        for field, kwargs in (("factory", "factory_kwargs"), ("loss", "loss_kwargs")):
            if field in override and override[field] != recipe.get(field) and kwargs not in override:
                recipe[kwargs] = {}
        recipe.update(override)
        recipe["source"] = "user"
    return recipe


def default_loss_fits(model: torch.nn.Module, recipe: dict, override: dict | None = None) -> str | None:
    """Why the recipe's loss cannot serve this model (None: it can): the built-in default loss calls
    `model(**batch).loss`, which only Hugging Face-style models answer. A GuardConfig.dumping.recipe that names the loss
    itself (the default one included: a model of the user's that answers `.loss`) is taken at its word."""
    if recipe.get("loss") != DEFAULT_LOSS or huggingface_recipe(model) is not None or "loss" in (override or {}):
        return None
    return (
        f"{model_class(model).__name__} is not a Hugging Face model, and no loss_fn was given: replay would call "
        "model(**batch).loss. Pass Guard(..., loss_fn=my_loss) with a module-level `def my_loss(model, batch)`, "
        "or GuardConfig(dumping=DumpConfig(recipe={'loss': 'mypkg.losses:my_loss'})), or --loss at replay"
    )


@dataclass(frozen=True)
class ReplayNeeds:
    """What a replay of this job's dumps will need that the dump cannot give, known when the Guard is created."""

    factory: str | None = None
    """Why no model factory can be recorded (None: one is)."""
    loss: str | None = None
    """Why the recorded loss cannot serve the model (default_loss_fits; None: it can)."""
    trusted: tuple[str, ...] = ()
    """The recipe's import paths that are the user's code: replay imports (or, for `__main__`, defines) them only
    with --trust."""

    def words(self) -> str | None:
        """The one line the Guard logs at creation (None: a plain `forensics replay DUMP` will do)."""
        parts = []
        if self.factory:
            parts.append(f"a model factory ({self.factory})")
        if self.loss:
            parts.append(f"a loss ({self.loss})")
        if self.trusted:
            parts.append(
                f"--trust (the dump names your code: {', '.join(self.trusted)}; replay imports it only with "
                "your consent)"
            )
        if not parts:
            return None
        return f"a replay of this job's dumps will need {'; '.join(parts)}. Replay with: {self.command('DUMP')}"

    def command(self, dump: Any) -> str:
        """The replay command that works for a dump of this job."""
        flags = " --trust" if self.trusted else ""
        if self.factory:
            flags += (
                " --factory MODULE:FUNCTION --path DIR_OF_MODULE" if not self.trusted else " --factory MODULE:FUNCTION"
            )
        if self.loss:
            flags += " --loss MODULE:FUNCTION"
        return f"forensics replay {dump}{flags}"


def replay_needs(
    model: torch.nn.Module, recipe: dict, override: dict | None = None, script_name: str | None = None
) -> ReplayNeeds:
    """What a replay will need beyond the dump (ReplayNeeds), from the recipe the Guard records. `script_name`: the
    training script's file name when `__main__` is a script (the dump then holds its source, so a factory defined
    in it can be named at replay: `--factory __main__:build --trust`)."""
    factory = None
    if not recipe.get("factory"):
        cls = model_class(model)
        where = (
            f"a function of {script_name} that returns it works too: --factory __main__:FUNCTION --trust"
            if script_name
            else "--factory module:fn at replay"
        )
        factory = (
            f"no recipe can be recorded for {cls.__name__}, which is not a Hugging Face model: pass "
            "GuardConfig(dumping=DumpConfig(recipe={'factory': 'pkg.module:build'})) now, or name one at "
            f"replay ({where})"
        )
    trusted = tuple(
        path for key in ("factory", "loss") if isinstance(path := recipe.get(key), str) and not is_builtin(path)
    )
    return ReplayNeeds(factory, default_loss_fits(model, recipe, override), trusted)
