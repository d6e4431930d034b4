"""A recorded Hugging Face config never makes the built-in recipe fetch or load code from the Hub, by rule: only the
attention and experts implementations built into torch and transformers pass (flash_attention_N only with its
package installed here, never its fallback to a Hub kernel); everything else is refused with the reason, and while
the model is built every loader of Hub kernels refuses (forensics.core.thirdparty.hub_kernels_refused)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from forensics.core.errors import RecipeError
from forensics.recipes import huggingface_model

GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16, "n_positions": 8}


def _build(config: dict | None = None, **kwargs):
    return huggingface_model(
        architecture=kwargs.pop("architecture", "GPT2LMHeadModel"), config=config or GPT2, **kwargs
    )


@pytest.mark.parametrize(
    "kwargs, field, reason",
    [
        ({"config": {**GPT2, "experts_implementation": "sonicmoe"}}, "config.experts_implementation", "Hub"),
        ({"config": {**GPT2, "_experts_implementation": "deepgemm"}}, "config._experts_implementation", "Hub"),
        ({"config": {**GPT2, "text_config": {"experts_implementation": "x"}}}, "text_config", "Hub"),
        ({"attn_implementation": "my_registered_attention"}, "attn_implementation", "not an implementation built"),
        (
            {"attn_implementation": {"": "sdpa", "text_config": "kernels-community/x"}},
            "attn_implementation.text",
            "Hub",
        ),
        ({"config": {**GPT2, "_attn_implementation": "paged|sdpa"}}, "config._attn_implementation", "built into"),
    ],
)
def test_a_setting_that_is_not_built_in_is_refused_with_the_reason(kwargs, field, reason):
    with pytest.raises(RecipeError) as err:
        _build(**kwargs)
    assert field in str(err.value) and reason in str(err.value) and "refused" in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_without_its_package_is_refused_before_transformers_falls_back_to_a_hub_kernel():
    """The attack: `kernels` installed, flash_attn not: transformers would load kernels-community/flash-attn2."""
    with pytest.raises(RecipeError) as err:
        _build(attn_implementation="flash_attention_2")
    assert "flash_attn package is not installed" in str(err.value) and "kernels-community" in str(err.value)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_built_in_implementations_still_build(implementation):
    model = _build(attn_implementation=implementation)
    assert model.config._attn_implementation == implementation


def test_while_the_model_is_built_every_hub_kernel_loader_refuses(monkeypatch):
    """A model type whose init fetches a kernel: stood in for by a `kernels` module and transformers' loaders that
    record a call. Inside the build they refuse; after it they are the library's own again."""
    import transformers.integrations.hub_kernels as hub

    calls: list[str] = []
    kernels = types.ModuleType("kernels")
    kernels.get_kernel = lambda repo, **kw: calls.append(repo)
    monkeypatch.setitem(sys.modules, "kernels", kernels)
    original_lazy, original_enabled = hub.lazy_load_kernel, hub._kernels_enabled
    seen: dict = {}
    gpt2 = __import__("transformers").GPT2LMHeadModel
    real_init = gpt2.__init__

    def init_that_fetches(self, config):
        real_init(self, config)
        seen["enabled"] = hub._kernels_enabled
        for fetch in (lambda: hub.lazy_load_kernel("causal-conv1d"), lambda: kernels.get_kernel("org/evil")):
            try:
                fetch()
            except RecipeError as exc:
                seen.setdefault("refused", []).append(str(exc))

    monkeypatch.setattr(gpt2, "__init__", init_that_fetches)
    _build()
    assert seen["enabled"] is False and len(seen["refused"]) == 2 and calls == []
    assert all("Hugging Face Hub" in words for words in seen["refused"])
    assert hub.lazy_load_kernel is original_lazy and hub._kernels_enabled == original_enabled  # restored
    kernels.get_kernel("org/after")
    assert calls == ["org/after"]
