"""The replay recipe recorded in a dump: import paths of a model factory and loss, never executed here."""

from __future__ import annotations

from typing import Callable

import torch

from forensics.recipes import DEFAULT_LOSS, huggingface_recipe, model_class


def import_path(fn: Callable) -> str | None:
    """`module:qualname` for a module-level function, or None where it cannot be imported by name."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or "<" in qualname:  # lambdas and closures
        return None
    return f"{module}:{qualname}"


def build_recipe(model: torch.nn.Module, loss_fn: Callable | None, sample_id_key: str,
                 override: dict | None) -> dict:
    """The recipe written to the manifest (docs/DUMP_FORMAT.md `recipe`; keys documented in docs/GUIDE.md).

    A user override (GuardConfig.dumping.recipe) replaces a field together with the fields that belong to it:
    a new `factory` drops the automatic `factory_kwargs` (and `loss` its `loss_kwargs`) unless the override
    gives its own.
    """
    recipe = dict(huggingface_recipe(model) or {})
    if not recipe:
        cls = model_class(model)
        recipe = {"factory": None, "factory_kwargs": {}, "model_class": f"{cls.__module__}.{cls.__qualname__}",
                  "source": "unknown: pass DumpConfig(recipe={'factory': 'pkg.mod:fn', ...}) or --factory at replay"}
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
    return (f"{model_class(model).__name__} is not a Hugging Face model, and no loss_fn was given: replay would call "
            "model(**batch).loss. Pass Guard(..., loss_fn=my_loss) with a module-level `def my_loss(model, batch)`, "
            "or GuardConfig(dumping=DumpConfig(recipe={'loss': 'mypkg.losses:my_loss'})), or --loss at replay")
