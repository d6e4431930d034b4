"""The demo's plain-torch GPT-2 (forensics.demo.gpt2, recipe forensics.demo.models:tiny_gpt2) against transformers'
GPT2LMHeadModel: loaded with the same weights, the same loss, logits and gradients bit for bit, dropout included —
what lets the demo train transformers' model and replay its dump without importing transformers."""

from __future__ import annotations

import pytest
import torch

from forensics.demo import models

transformers = pytest.importorskip("transformers")


def _pair(**config):
    torch.manual_seed(0)
    reference = models.name_default_loss(transformers.GPT2LMHeadModel(models.gpt2_config(**config)))
    twin = models.tiny_gpt2(config)
    missing, unexpected = twin.load_state_dict(reference.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: transformers may leave it out
    assert twin.lm_head.weight is twin.transformer.wte.weight
    assert sorted(dict(twin.named_parameters())) == sorted(dict(reference.named_parameters()))
    return reference, twin


def _run(model, batch, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks, when the two draw them in the same order
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("training", [True, False])
def test_tiny_gpt2_computes_what_transformers_gpt2_computes(training):
    reference, twin = _pair(n_embd=32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 16), generator=gen)
    embeds = torch.randn(3, 16, 32, generator=gen)
    embeds[1, 5:8] = 1e38  # the demo's bad record: the non-finite values must appear in the same places
    for batch in ({"input_ids": ids, "labels": ids}, {"inputs_embeds": embeds, "labels": ids}):
        for model in (reference, twin):
            model.train(training)
        loss_r, logits_r, grads_r = _run(reference, batch, seed=7)
        loss_t, logits_t, grads_t = _run(twin, batch, seed=7)
        assert _same(loss_r, loss_t) and _same(logits_r, logits_t)
        for name, grad in grads_r.items():
            assert _same(grad, grads_t[name]), name


def test_tiny_gpt2_refuses_a_variant_it_does_not_implement():
    with pytest.raises(ValueError, match="huggingface_model"):
        models.tiny_gpt2({"activation_function": "relu"})
    with pytest.raises(ValueError, match="not \\['n_kv_heads'\\]"):
        models.tiny_gpt2({"n_kv_heads": 2})
