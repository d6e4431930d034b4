"""Fixture `kit` for the replay tests: a tiny real GPT-2, micro-batches with one marked sample, and a
recorded training step (RNG per micro-batch, losses, grad norm) the way a job would record it.

Tests reach the helpers as `kit.build_gpt2(...)` (pytest runs with --import-mode=importlib, so a
test cannot import this file by name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
import transformers

from forensics.core.rng import capture_rng
from forensics.replay.load.session import session_from_objects

VOCAB = 64
POISON_TOKEN = 63  # used by exactly one sample (micro-batch 1, index 2)
POISONED = (1, 2)

transformers.logging.set_verbosity_error()


def build_gpt2(seed: int = 0, dropout: float = 0.1, tie: bool = False) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tie,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(cfg)


def build_batches(n_micro: int = 2, batch: int = 4, seq: int = 8, poison: bool = True) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for mb in range(n_micro):
        ids = torch.randint(1, POISON_TOKEN, (batch, seq), generator=g)  # never the poison token
        batches.append({"input_ids": ids, "labels": ids.clone(), "sample_ids": [f"doc-{mb}-{i}" for i in range(batch)]})
    if poison:
        mb, i = POISONED
        batches[mb]["input_ids"][i, 3] = POISON_TOKEN
    return batches


def hf_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def log_zero_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """A custom loss that takes log(0) for every sample holding the poison token."""
    probs = model(input_ids=batch["input_ids"]).logits.softmax(-1)
    hit = (batch["input_ids"] == POISON_TOKEN).any(1)[:, None, None]
    probs = torch.where(hit, torch.zeros_like(probs), probs)
    return -probs.log().mean()


@dataclass
class Recorded:
    """What a training job records of one step (as the Guard does)."""

    rng_states: list[Any] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norm: float | None = None


def record_step(
    model: torch.nn.Module,
    batches: list,
    loss_fn: Callable,
    divisor: float | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> Recorded:
    """Runs one training step like a job (RNG captured before each forward), leaves weights untouched."""
    divisor = divisor or len(batches)
    rec = Recorded()
    model.train()
    for batch in batches:
        rec.rng_states.append(capture_rng())
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = loss_fn(model, batch)
        rec.losses.append(float(loss.detach().float()))
        (loss / divisor).backward()
    rec.grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    model.zero_grad(set_to_none=True)
    return rec


def make_session(
    model,
    batches,
    loss_fn=hf_loss,
    optimizer=None,
    trigger=None,
    record: bool = True,
    autocast_dtype: torch.dtype | None = None,
    **kwargs,
):
    """A ReplaySession of live objects; with record=True the step is first run 'in the job'."""
    autocast = {
        "enabled": autocast_dtype is not None,
        "device_type": "cpu",
        "dtype": str(autocast_dtype).removeprefix("torch.") if autocast_dtype else None,
    }
    extra = {}
    if record:
        rec = record_step(model, batches, loss_fn, autocast_dtype=autocast_dtype)
        extra = {"rng_states": rec.rng_states, "recorded_losses": rec.losses, "recorded_grad_norm": rec.grad_norm}
    extra.update(kwargs)
    return session_from_objects(
        model, batches, loss_fn=loss_fn, optimizer=optimizer, trigger=trigger, autocast=autocast, **extra
    )


@pytest.fixture
def kit():
    """This module's helpers: build_gpt2, build_batches, hf_loss, log_zero_loss, record_step, make_session."""
    return SimpleNamespace(
        build_gpt2=build_gpt2,
        build_batches=build_batches,
        hf_loss=hf_loss,
        log_zero_loss=log_zero_loss,
        record_step=record_step,
        make_session=make_session,
        POISON_TOKEN=POISON_TOKEN,
        POISONED=POISONED,
        VOCAB=VOCAB,
    )
