"""The models, losses and data of the GPU natural-run verdict suite (scripts/natural_gpu/make_dumps.py): nothing planted.

A GPT written the way nanoGPT's model.py has it (token + position embeddings, pre-LN blocks of causal self-attention
and a 4x GELU MLP, a final LayerNorm, the head tied to the token embedding, nanoGPT's init), shrunk to 2 layers x 64.
Attention goes through `F.scaled_dot_product_attention` (nanoGPT's "flash" path) or, with `flash=False`, the
explicit q.k^T softmax nanoGPT falls back to (where fp16 attention logits can overflow).

The losses are module-level functions, so a dump names them (`scripts.natural_gpu.models:copy_loss_fp16`) and a
replay imports them with `--trust` (or `--loss ... --path REPO`). Two of them enter autocast THEMSELVES, as a user's
loss function does (issue 41): `torch.autocast("cuda", ...)`, written as a user writes it (inert on a CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True
    flash: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd, self.flash = config.n_head, config.n_embd, config.flash
        mask = torch.tril(torch.ones(config.block_size, config.block_size)).view(
            1, 1, config.block_size, config.block_size
        )
        self.register_buffer("bias", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        else:  # nanoGPT's manual implementation
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd, bias=config.bias), CausalSelfAttention(config)
        self.ln_2, self.mlp = nn.LayerNorm(config.n_embd, bias=config.bias), MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def build_gpt(seed: int = 0, **kwargs) -> GPT:
    """The recipe's factory: the model, seeded (replay loads the dump's weights into it afterwards)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**kwargs))


# -- losses: (model, batch) -> loss ------------------------------------------------------------------------------
def copy_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """nanoGPT's loss, no autocast of its own (the loop enters it, or none)."""
    return model(batch["x"], batch["y"])[1]


def copy_loss_fp16(model: nn.Module, batch: dict) -> torch.Tensor:
    """The user's loss function that enters fp16 autocast itself (issue 41's case)."""
    with torch.autocast("cuda", dtype=torch.float16):
        _, loss = model(batch["x"], batch["y"])
    return loss


def copy_loss_bf16(model: nn.Module, batch: dict) -> torch.Tensor:
    """The same, in bf16."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(batch["x"], batch["y"])
    return loss


# -- data -----------------------------------------------------------------------------------------------------------
def copy_batches(batch: int, half: int, vocab: int, seed: int = 1, copy_token: int = 0):
    """The copy task: `half` tokens drawn i.i.d. uniform from 1..vocab-1, a separator (token 0), the same tokens
    again; the targets are the next tokens, only the copied half counted (the first half is unpredictable: -1).
    Every record is drawn from the same distribution: no sample is bad data."""
    gen = torch.Generator().manual_seed(seed)
    step = 0
    while True:
        src = torch.randint(1, vocab, (batch, half), generator=gen)
        seq = torch.cat([src, torch.full((batch, 1), copy_token), src], dim=1)  # 2 * half + 1 tokens
        x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
        y[:, :half] = -1
        yield {"x": x, "y": y, "sample_ids": [f"s{step}-i{i}" for i in range(batch)]}
        step += 1


def sequence_batches(batch: int, length: int, vocab: int, seed: int = 1):
    """Learnable sequences start + stride * t (mod vocab): the model fits them and its attention sharpens."""
    gen = torch.Generator().manual_seed(seed)
    step = 0
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 6, (batch, 1), generator=gen)
        seq = (start + stride * torch.arange(length + 1)) % vocab
        yield {"x": seq[:, :-1].clone(), "y": seq[:, 1:].clone(), "sample_ids": [f"s{step}-i{i}" for i in range(batch)]}
        step += 1


def random_token_batches(batch: int, length: int, vocab: int, seed: int = 1):
    """Hugging Face style batches of i.i.d. uniform random tokens (input_ids = labels)."""
    gen = torch.Generator().manual_seed(seed)
    step = 0
    while True:
        ids = torch.randint(0, vocab, (batch, length), generator=gen)
        yield {"input_ids": ids, "labels": ids.clone(), "sample_ids": [f"s{step}-i{i}" for i in range(batch)]}
        step += 1
