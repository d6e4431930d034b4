"""Models and losses of the demo scenarios that are not plain Hugging Face models, as built-in recipes.

Each factory and loss here is named by import path in a demo dump's recipe
(`GuardConfig(dumping=DumpConfig(recipe={"factory": "forensics.demo.models:adapter_lm", ...}))`). Those paths are listed in
the static allow-list `forensics.recipes.BUILTIN_RECIPES`, so replay rebuilds them without `--trust`:
a dump can only pick one of these functions and give it JSON keyword arguments.

Factories take only JSON-able keyword arguments and build small, randomly initialised models (no
downloads); replay loads the dump's weights into them afterwards.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from forensics.recipes import name_default_loss


log = logging.getLogger(__name__)

MODULE = "forensics.demo.models"
FACTORIES = ("adapter_lm", "sensor_classifier", "gated_lm", "tiny_gpt2")
LOSSES = ("quality_weighted_loss",)
RECIPES = frozenset(f"{MODULE}:{name}" for name in FACTORIES + LOSSES)


def gpt2_config(**overrides: Any):
    """A tiny GPT-2 config: 2 layers, width 32, 2 heads, 64-token vocabulary, 32 positions."""
    from transformers import GPT2Config

    values = dict(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    values.update(overrides)
    return GPT2Config(**values)


# GPT2Config's defaults for the fields forensics.demo.gpt2 reads, then gpt2_config()'s demo sizes
TINY_GPT2_DEFAULTS = dict(
    n_layer=2,
    n_embd=32,
    n_head=2,
    vocab_size=64,
    n_positions=32,
    n_inner=None,
    activation_function="gelu_new",
    resid_pdrop=0.1,
    embd_pdrop=0.1,
    attn_pdrop=0.1,
    layer_norm_epsilon=1e-5,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    reorder_and_upcast_attn=False,
    add_cross_attention=False,
    tie_word_embeddings=True,
)


def tiny_gpt2(config: dict | None = None) -> nn.Module:
    """The demo's GPT-2 language model in plain torch (forensics.demo.gpt2): transformers' GPT2LMHeadModel of
    `gpt2_config(**config)`, the same parameters and numbers, built without importing transformers.

    Raises:
        ValueError: `config` asks for a GPT-2 variant the plain model does not implement, or names an unknown field.
    """
    from forensics.demo.gpt2 import GPT2LMHeadModel

    values = dict(TINY_GPT2_DEFAULTS)
    overrides = dict(config or {})
    unknown = sorted(set(overrides) - set(values))
    if unknown:
        raise ValueError(f"tiny_gpt2 takes GPT2Config fields {sorted(values)}; not {unknown}")
    values.update(overrides)
    variant = {
        "activation_function": "gelu_new",
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
    }
    unsupported = sorted(k for k, v in variant.items() if values[k] != v)
    if unsupported:
        raise ValueError(
            f"tiny_gpt2 implements GPT-2 with {variant}, not { ({k: values[k] for k in unsupported}) }: build this "
            "model with forensics.recipes:huggingface_model"
        )
    return GPT2LMHeadModel(values)


def llama_config(**overrides: Any):
    """A tiny Llama config: 2 layers, width 32, 2 heads (2 KV heads), 64-token vocabulary."""
    from transformers import LlamaConfig

    values = dict(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    values.update(overrides)
    return LlamaConfig(**values)


# -- (c) features -> adapter -> language model ------------------------------------------------------
class SwiGLUAdapter(nn.Module):
    """Projects a frozen encoder's per-token features to the LM width: down(silu(gate(x)) * up(x)).

    There is no normalisation in front of it (as in many multimodal connectors), so the size of the
    features reaches the products directly: features of a few hundred make gate*up ~ 1e5, fine in
    fp32 and above float16's 65504.
    """

    def __init__(self, n_features: int, hidden: int, out: int):
        super().__init__()
        self.gate = nn.Linear(n_features, hidden)
        self.up = nn.Linear(n_features, hidden)
        self.down = nn.Linear(hidden, out)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(features)) * self.up(features))


class AdapterLM(nn.Module):
    """Per-token features -> SwiGLU adapter -> small Llama, trained with the LM's own loss."""

    def __init__(self, n_features: int, adapter_hidden: int, config: dict):
        super().__init__()
        from transformers import LlamaForCausalLM

        lm_config = llama_config(**config)
        self.adapter = SwiGLUAdapter(n_features, adapter_hidden, lm_config.hidden_size)
        self.lm = name_default_loss(LlamaForCausalLM(lm_config))

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None):
        return self.lm(inputs_embeds=self.adapter(features), labels=labels)


def adapter_lm(n_features: int = 16, adapter_hidden: int = 64, config: dict | None = None) -> AdapterLM:
    """Factory of AdapterLM; `config` overrides `llama_config()` fields."""
    return AdapterLM(n_features, adapter_hidden, dict(config or {}))


# -- (e) a sensor-sequence classifier with batch statistics -----------------------------------------
class BatchStandardize(nn.Module):
    """Standardises each channel (B, C, T) with the micro-batch's own mean and variance over (B, T), written out in
    float32 as custom normalisation layers are (no running statistics). Unlike nn.BatchNorm1d, whose CPU and cuDNN
    kernels accumulate differently (double vs float) and so overflow on different inputs, these sums overflow on the
    same inputs on every device."""

    def __init__(self, n_channels: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_channels))
        self.bias = nn.Parameter(torch.zeros(n_channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = x.shape[0] * x.shape[2]
        centred = x - x.sum(dim=(0, 2), keepdim=True) / count
        variance = (centred * centred).sum(dim=(0, 2), keepdim=True) / count
        return centred / torch.sqrt(variance + self.eps) * self.weight[:, None] + self.bias[:, None]


class SensorClassifier(nn.Module):
    """Classifies multichannel sensor recordings (B, C, T): batch standardisation over channels, MLP, mean pool.

    The statistics are taken over every sample and time step of the micro-batch, so what one sample does to
    them depends on which other samples share its micro-batch.
    """

    def __init__(self, n_channels: int, hidden: int, n_classes: int):
        super().__init__()
        self.bn = BatchStandardize(n_channels)
        self.proj = nn.Linear(n_channels, hidden)
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        x = self.bn(features).transpose(1, 2)  # statistics per channel over (B, T); then (B, T, C)
        logits = self.head(F.gelu(self.proj(x)).mean(dim=1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def sensor_classifier(n_channels: int = 8, hidden: int = 32, n_classes: int = 4) -> SensorClassifier:
    """Factory of SensorClassifier."""
    return SensorClassifier(n_channels, hidden, n_classes)


# -- (g) a language model with a gate-usage regulariser under gate dropout ---------------------------
class GatedLM(nn.Module):
    """Small GPT-2 plus a few learned gates and a regulariser that keeps them in use.

    The regulariser is -log(sum of the gates that survive gate dropout). With only `n_gates` gates
    and dropout p, every gate is dropped at once with probability p**n_gates per forward: then the
    sum is 0 and the loss is +inf. Which forward that is depends only on the RNG state.
    The gates are drawn first in the forward, so the mask does not depend on the batch.
    """

    def __init__(self, n_gates: int, gate_dropout: float, aux_weight: float, config: dict):
        super().__init__()
        from transformers import GPT2LMHeadModel

        self.gate_logits = nn.Parameter(torch.zeros(n_gates))
        self.gate_dropout = nn.Dropout(gate_dropout)
        self.aux_weight = aux_weight
        self.lm = name_default_loss(GPT2LMHeadModel(gpt2_config(**config)))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        kept = self.gate_dropout(torch.sigmoid(self.gate_logits))
        out = self.lm(input_ids=input_ids, labels=labels)
        result = {"logits": out.logits}
        if labels is not None:
            result["loss"] = out.loss + self.aux_weight * -torch.log(kept.sum())
        return result


def gated_lm(
    n_gates: int = 4, gate_dropout: float = 0.5, aux_weight: float = 0.01, config: dict | None = None
) -> GatedLM:
    """Factory of GatedLM; `config` overrides `gpt2_config()` fields."""
    return GatedLM(n_gates, gate_dropout, aux_weight, dict(config or {}))


# -- (b) a loss with per-sample data-quality weights -------------------------------------------------
def quality_weighted_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Next-token loss with each sample's data-quality weight w in log space: mean(nll - log w).

    This is -log(w * p(sample)): a sample of weight 1 counts fully, lower weights add a penalty.
    Written for weights in (0, 1]; a weight of exactly 0 makes log(0) = -inf and the loss +inf.
    """
    input_ids = batch["input_ids"]
    logits = model(input_ids=input_ids).logits[:, :-1]
    nll = F.cross_entropy(logits.transpose(1, 2).float(), input_ids[:, 1:], reduction="none").mean(dim=1)
    return (nll - torch.log(batch["quality"])).mean()
