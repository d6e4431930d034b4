"""Shared by the example scripts: a tiny random GPT-2, a dataset of embedding samples (one poisoned), CLI flags.

Nothing here is needed to use forensics; it only keeps each example down to its integration lines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

from forensics.core.errors import TrainingFaultError

EMBD, VOCAB, SEQ = 32, 64, 16


LR = 1e-3
CLIP = 1.0


def tiny_gpt2(seed: int = 0):
    """A 2-layer, 32-wide GPT-2 with random weights (no download); dropout off so runs are comparable."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=EMBD,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


SIZES = {  # Llama shapes for --size: hidden, intermediate, layers, heads, vocabulary
    "tiny": (EMBD, 2 * EMBD, 2, 2, VOCAB),
    "small": (512, 1408, 4, 8, 32000),  # 45 M parameters: a sharded dump of a few hundred MB on a CPU
    "1b": (2048, 5632, 18, 16, 32000),  # 1.06 B parameters
    "7b": (4096, 11008, 32, 32, 32000),  # 6.74 B parameters (Llama-2-7B's shape)
    "13b": (5120, 13824, 40, 40, 32000),  # 13.0 B parameters (Llama-2-13B's shape)
}


def tiny_model(arch: str = "gpt2", seed: int = 0, size: str = "tiny", device: torch.device | None = None):
    """`tiny_gpt2()`, or a Llama (RMSNorm, SwiGLU, rotary) for `arch="llama"`: 2 layers 32 wide, or a `size` from
    SIZES, initialised straight on `device` (a 1 B model's host init would take longer than the training)."""
    if arch == "gpt2":
        return tiny_gpt2(seed)
    import transformers

    torch.manual_seed(seed)
    hidden, intermediate, layers, heads, vocab = SIZES[size]
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    with torch.device(device or "cpu"):
        return transformers.LlamaForCausalLM(config)


def warmup(step: int) -> float:
    """Learning-rate multiplier of every example: linear warm-up over 4 steps."""
    return min(1.0, (step + 1) / 4)


class EmbedsDataset(torch.utils.data.Dataset):
    """`n` samples {"inputs_embeds": (SEQ, 32), "labels": (SEQ,)}; sample `poison` holds a 1e38.

    A 1e38 entry overflows LayerNorm's variance, so any micro-batch holding that sample has a NaN
    loss: the stand-in for a corrupt record in a real corpus.
    """

    def __init__(
        self,
        n: int,
        poison: int | None = None,
        seed: int = 1,
        poison_value: float = 1e38,
        width: int = EMBD,
        vocab: int = VOCAB,
    ):
        generator = torch.Generator().manual_seed(seed)
        self.items = [
            {
                "inputs_embeds": torch.randn(SEQ, width, generator=generator),
                "labels": torch.randint(0, vocab, (SEQ,), generator=generator),
            }
            for _ in range(n)
        ]
        if poison is not None and poison >= 0:
            self.items[poison]["inputs_embeds"][0, 0] = poison_value

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dump-dir", default="forensics_dumps", help="where dumps go")
    p.add_argument("--run-id", default=None, help="names the run's dump folder (default: a timestamp)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps to train")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch (per rank)")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument(
        "--poison",
        type=int,
        default=29,
        help="dataset index of the corrupt sample (-1: none). With 2 ranks and the defaults, "
        "29 is read by rank 1 in step 3, micro-batch 1",
    )
    p.add_argument("--model", default="gpt2", choices=("gpt2", "llama"), help="the tiny model to train")
    p.add_argument("--size", default="tiny", choices=tuple(SIZES), help="Llama size (--model llama)")
    p.add_argument(
        "--poison-value",
        type=float,
        default=1e38,
        help="value planted in the corrupt sample (RMSNorm maps 1e38 to 0: use inf for llama)",
    )
    p.add_argument(
        "--policy", default="raise", choices=("raise", "skip", "continue"), help="what the Guard does on a NaN/Inf step"
    )
    p.add_argument("--max-dumps", type=int, default=3, help="DumpConfig.max_dumps")
    p.add_argument(
        "--initial-scale-power",
        type=int,
        default=16,
        help="fp16: the loss scale starts at 2**this (40 makes the first steps overflow)",
    )
    p.add_argument(
        "--layout",
        default="auto",
        choices=("auto", "full", "sharded"),
        help="DumpConfig.state_layout: how the ranks write the state",
    )
    p.add_argument("--replicas", type=int, default=1, help="DumpConfig.shard_replicas (sharded layout)")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "sgd"),
        help="adamw (two moments per weight) or plain sgd (no state: a 13 B dump of 2 ranks fits a 128 GB disk)",
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="AdamW(fused=True): the default GuardConfig then checks without a sync (judged one step late)",
    )
    p.add_argument(
        "--min-loss-scale",
        type=float,
        default=1.0,
        help="fp16: an overflow at this loss scale or below is a fault, not a normal skip",
    )
    return p


def report(rank: int, **fields) -> None:
    """One JSON line per rank on stdout, for people and for tests (one write, so ranks' lines do not mix)."""
    sys.stdout.write("forensics-example " + json.dumps({"rank": rank, **fields}, default=str) + "\n")
    sys.stdout.flush()


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def restart(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.start, 4)


@contextlib.contextmanager
def reported(rank: int, guard):
    """The training loop of a torchrun example: yields a Timer (restart it before `guard.check()`: a fault's line
    says how long the dump took). A clean end reports the dumps and history, closes the Guard and tears the process
    group down; a TrainingFaultError reports the fault and closes the Guard, with no collective (another rank may
    be gone; the process group dies with this one)."""
    timer = Timer()
    try:
        yield timer
    except TrainingFaultError as fault:
        report(rank, fault=fault.trigger, dump=fault.dump_path, dump_seconds=timer(), dump_error=fault.dump_error)
        guard.close()
        return
    report(rank, fault=None, dumps=guard.dumps, history=guard.history.to_dict())
    guard.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def init_distributed() -> tuple[int, int, torch.device]:
    """The torchrun process group (NCCL on GPUs, else gloo): this process's rank, the world size and its device."""
    cuda = torch.cuda.is_available()
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def env_rank() -> int:
    return int(os.environ.get("RANK", 0))


def lit_gpt2(fused: bool = False):
    """The examples' LightningModule (a factory replay can import: `--factory _common:lit_gpt2`); `fused`: its AdamW
    fused (the default GuardConfig then checks without a sync, except under 16-mixed's GradScaler), clipped by the
    module itself (Lightning refuses gradient_clip_val for a fused optimizer under mixed precision)."""
    try:
        import pytorch_lightning as pl
    except ImportError:  # the unified package
        import lightning.pytorch as pl

    class LitGPT2(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch, batch_idx):
            return self.model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR, fused=True if fused else None)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            """A fused AdamW under mixed precision: Lightning refuses gradient_clip_val ("performs unscaling of
            gradients internally"), so the module clips itself, unscaling first when a GradScaler (16-mixed) still
            holds the gradients scaled; GradScaler.step then knows they are unscaled."""
            if not fused:
                return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            if not gradient_clip_val:
                return None
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                scaler.unscale_(optimizer)
            if str(gradient_clip_algorithm or "norm").endswith("value"):
                torch.nn.utils.clip_grad_value_(self.parameters(), gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)
            return None

    return LitGPT2()


def optimizer_for(args: argparse.Namespace, params) -> torch.optim.Optimizer:
    """The example's optimizer from --optimizer / --fused."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=LR, fused=True if args.fused else None)
    return torch.optim.AdamW(params, lr=LR, fused=args.fused)
