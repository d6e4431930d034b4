"""A training job whose step runs out of memory: a tiny Llama (eager attention) on dynamically padded micro-batches,
one sample of step 2 is 100,000 tokens long, so its micro-batch's attention mask alone needs 10 GB. Run it under a
memory cap (RLIMIT_AS, like a device with a few GB): the allocation then fails at once, as on a GPU.

Usage: python oom_job.py DUMP_DIR [DEVICE]   (DEVICE cuda:0: a real CUDA out-of-memory, no cap needed)
"""

from __future__ import annotations

import sys

import torch
import transformers

from forensics.capture import Guard, GuardConfig

LONG = 100_000


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=1 << 20,
    )
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def collate(rows: list[torch.Tensor]) -> dict:
    """Dynamic padding: each micro-batch as long as its longest sample."""
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(dump_dir: str, device: str = "cpu") -> None:
    model = tiny_llama().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=dump_dir, run_id="oom"))
    lengths = torch.Generator().manual_seed(0)
    for step in range(4):
        with guard.capture_errors():
            for mb in range(2):
                sizes = [int(torch.randint(8, 24, (1,), generator=lengths)) for _ in range(4)]
                if step == 2 and mb == 1:
                    sizes[1] = LONG
                batch = {
                    k: v.to(device)
                    for k, v in collate([torch.randint(0, 64, (n,), generator=lengths) for n in sizes]).items()
                }
                guard.record_batch(batch, sample_ids=[f"doc-{step}-{mb}-{i}" for i in range(4)])
                loss = model(**batch).loss
                guard.record_loss(loss)
                (loss / 2).backward()
            if guard.check():
                optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main(*sys.argv[1:3])
