"""The tiny models, losses and data of the natural-instability suite (tests/natural/natural_job.py): nothing planted.

A pre-LN decoder-only transformer written out in plain torch (so that what overflows in fp16 autocast is the same
on every machine: the q.k matmul, the output projection), its blocks in `layers` (a ModuleList), attention modules
with `q_proj` / `k_proj` children and a `head_dim` attribute (what the precursor monitor looks for), an untied
`lm_head`. Replay rebuilds it through the recipe `natural_models:build` (with `--trust --path tests/natural`).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, qk_norm: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.qk_norm = heads, width // heads, qk_norm
        self.q_proj, self.k_proj = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
        self.v_proj, self.o_proj = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.qk_norm:  # queries and keys of unit RMS per head: the logits stay bounded
            q, k = (nn.functional.rms_norm(t, (self.head_dim,)) for t in (q, k))
        logits = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # without QK-norm nothing holds them
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = logits.masked_fill(causal, -math.inf).softmax(-1)
        return self.o_proj((weights.to(v.dtype) @ v).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, qk_norm: bool = False):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), Attention(width, heads, qk_norm)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    def __init__(
        self,
        vocab: int = 64,
        width: int = 32,
        heads: int = 2,
        layers: int = 2,
        seq_len: int = 16,
        final_norm: bool = True,
        qk_norm: bool = False,
    ):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        self.layers = nn.ModuleList(Block(width, heads, qk_norm) for _ in range(layers))
        self.norm = nn.LayerNorm(width) if final_norm else nn.Identity()
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def build(seed: int = 0, **kwargs) -> TinyLM:
    """The recipe's factory: the model, seeded (its weights are then loaded from the dump)."""
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Next-token cross-entropy (fp32 under autocast, as F.cross_entropy is), no z-loss."""
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
