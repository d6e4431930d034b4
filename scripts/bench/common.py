"""Shared bits of the benchmarks: machine description, a GPT-2 builder, device timing."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time

import torch


def machine() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name} ({props.multi_processor_count} SMs) x{torch.cuda.device_count()}"
    else:
        gpu = "no GPU"
    return (
        f"{platform.node()}: {os.cpu_count()} CPU cores, {gpu}, torch {torch.__version__}, "
        f"python {platform.python_version()}, {datetime.date.today().isoformat()}"
    )


def gpt2(size: str, device: str, dropout: float = 0.1) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    if size == "small":  # GPT-2 small, 124M parameters
        config = GPT2Config(
            n_layer=12,
            n_embd=768,
            n_head=12,
            n_positions=1024,
            vocab_size=50257,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
    else:  # a CPU-sized stand-in
        config = GPT2Config(
            n_layer=4,
            n_embd=256,
            n_head=4,
            n_positions=256,
            vocab_size=4096,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
    return GPT2LMHeadModel(config).to(device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)
