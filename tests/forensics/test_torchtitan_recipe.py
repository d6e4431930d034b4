"""The built-in torchtitan recipe (forensics/recipes.py) reads a dump's names and numbers, never more: it imports only
torchtitan's own model families and builds only their model-args dataclass from plain values."""

from __future__ import annotations

import pytest

from forensics.core.errors import RecipeError
from forensics.recipes import TORCHTITAN_FACTORY, TORCHTITAN_LOSS, is_builtin, torchtitan_model


def test_the_torchtitan_recipes_are_builtin():
    assert is_builtin(TORCHTITAN_FACTORY) and is_builtin(TORCHTITAN_LOSS)


@pytest.mark.parametrize("family", ["os", "llama3.model", "../llama3", "", None])
def test_a_family_that_is_not_torchtitans_is_refused_before_any_import(family):
    with pytest.raises(RecipeError, match="model famil"):
        torchtitan_model(family, {"dim": 8})


@pytest.mark.xdist_group("torchtitan")  # the worker that imports torchtitan for the other torchtitan tests
def test_model_args_that_are_not_plain_values_or_fields_are_refused():
    pytest.importorskip("torchtitan")
    with pytest.raises(RecipeError, match="no field"):
        torchtitan_model("llama3", {"__class__": 1})
    with pytest.raises(RecipeError, match="not a number"):
        torchtitan_model("llama3", {"dim": [256]})
    with pytest.raises(RecipeError, match="not a RoPEScalingArgs"):
        torchtitan_model("llama3", {"rope_scaling_args": {"scaling_factor": {"x": 1}}})
    model = torchtitan_model("llama3", {"dim": 16, "n_layers": 1, "n_heads": 2, "vocab_size": 32, "max_seq_len": 8})
    assert model.tok_embeddings.weight.shape == (32, 16) and len(model.layers) == 1
