"""GPT-2's language model in plain torch: the demo's model as replay rebuilds it, without importing transformers.

transformers 5's `modeling_gpt2` cannot be imported without its whole modelling stack (modeling_utils, the hub
kernel integration, torch._dynamo, torch.distributed.tensor, accelerate): about 0.7 s on a quiet 2-core machine,
most of the time between `import torch` and the first replayed step of the demo dump (BENCHMARKS.md "Replay's
first step"). The demo trains transformers' own `GPT2LMHeadModel`; its dump names this module's twin
(`forensics.demo.models:tiny_gpt2`), which has the same parameter names (transformer.h.0.ln_1 ...), the same
state_dict layout (Conv1D weights stored (in, out)) and runs the same torch ops in the same order as transformers'
eager attention path, so a replay computes the very numbers the job computed — dropout masks included, as they
come from the same RNG draws (tests/forensics/test_demo_gpt2.py compares the two bitwise).

Only what the demo uses: causal self-attention without a KV cache, no padding mask, no cross-attention, no
`reorder_and_upcast_attn`, activation "gelu_new", the ForCausalLM loss (mean over labels != -100).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class LMOutput(dict):
    """The forward's result: a dict with `logits` (and `loss` when labels were given), also read as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Conv1D(nn.Module):
    """A linear layer with its weight stored (in, out), as GPT-2's checkpoints store it: bias + x @ weight."""

    def __init__(self, n_out: int, n_in: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.weight.shape[1],))


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU, written as transformers' NewGELUActivation writes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GPT2Attention(nn.Module):
    """Causal multi-head self-attention, transformers' eager path: softmax(q k^T * scale + mask) v."""

    def __init__(self, n_embd: int, n_head: int, attn_pdrop: float, resid_pdrop: float, scale: bool):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.scaling = self.head_dim**-0.5 if scale else 1.0
        self.c_attn = Conv1D(3 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(attn_pdrop)
        self.resid_dropout = nn.Dropout(resid_pdrop)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        query, key, value = self.c_attn(x).split(x.size(-1), dim=2)
        shape = (*key.shape[:-1], -1, self.head_dim)
        key, value, query = (t.view(shape).transpose(1, 2) for t in (key, value, query))
        weights = torch.matmul(query, key.transpose(-1, -2)) * self.scaling + mask
        weights = F.softmax(weights, dim=-1).type(value.dtype)
        weights = F.dropout(weights, p=self.attn_dropout.p, training=self.training)
        out = torch.matmul(weights, value).transpose(1, 2)
        out = out.reshape(*out.shape[:-2], -1).contiguous()
        return self.resid_dropout(self.c_proj(out))


class GPT2MLP(nn.Module):
    def __init__(self, n_embd: int, n_inner: int, resid_pdrop: float):
        super().__init__()
        self.c_fc = Conv1D(n_inner, n_embd)
        self.c_proj = Conv1D(n_embd, n_inner)
        self.dropout = nn.Dropout(resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(gelu_new(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        n_embd, eps = config["n_embd"], config["layer_norm_epsilon"]
        self.ln_1 = nn.LayerNorm(n_embd, eps=eps)
        self.attn = GPT2Attention(
            n_embd, config["n_head"], config["attn_pdrop"], config["resid_pdrop"], config["scale_attn_weights"]
        )
        self.ln_2 = nn.LayerNorm(n_embd, eps=eps)
        self.mlp = GPT2MLP(n_embd, config["n_inner"] or 4 * n_embd, config["resid_pdrop"])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.ln_1(x), mask) + x
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.wte = nn.Embedding(config["vocab_size"], config["n_embd"])
        self.wpe = nn.Embedding(config["n_positions"], config["n_embd"])
        self.drop = nn.Dropout(config["embd_pdrop"])
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config["n_layer"]))
        self.ln_f = nn.LayerNorm(config["n_embd"], eps=config["layer_norm_epsilon"])

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        length = inputs_embeds.shape[1]
        positions = torch.arange(length, device=inputs_embeds.device).unsqueeze(0)
        x = self.drop(inputs_embeds + self.wpe(positions).to(inputs_embeds.device))
        # transformers' eager mask: 0 where a position may attend, the dtype's lowest value where it may not
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        low = torch.tensor(torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
        mask = torch.where(causal, torch.tensor(0.0, dtype=x.dtype, device=x.device), low)[None, None]
        for block in self.h:
            x = block(x, mask)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with its language-model head tied to the token embedding; `config` holds GPT2Config's fields."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config["n_embd"], config["vocab_size"], bias=False)
        if config.get("tie_word_embeddings", True):
            self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> LMOutput:
        logits = self.lm_head(self.transformer(input_ids, inputs_embeds))
        out = LMOutput(logits=logits)
        if labels is not None:  # transformers' ForCausalLM loss: tokens < n predict n, -100 ignored
            shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
            vocab = self.config["vocab_size"]
            out["loss"] = F.cross_entropy(
                logits.float().view(-1, vocab), shifted.view(-1).to(logits.device), ignore_index=-100
            )
        return out
