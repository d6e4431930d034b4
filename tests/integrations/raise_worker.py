"""Test worker (torchrun, gloo): rank 1 reads a record with token ids past the vocabulary in step 2.

The forward raises IndexError on rank 1 only; nothing wraps the loop: the Guard's excepthook dumps the
step and rank 1 exits non-zero. torchrun must then stop rank 0 (waiting in its next collective) instead
of leaving it hung. Usage: raise_worker.py DUMP_DIR [fsdp2]

With `fsdp2` the model is sharded with `fully_shard` and EVERY rank reads a bad record in the same micro-batch:
each raises in the embedding's forward, while FSDP2 holds the root module's parameters gathered, and each
writes its own shards (the sharded layout needs no collective), so the step dump is complete.
"""

from __future__ import annotations

import sys

import torch
import transformers
from torch.nn.parallel import DistributedDataParallel

from forensics.capture import DumpConfig, Guard, GuardConfig

BAD_STEP, BAD_MB, BAD_ROW = 2, 1, 3


def build(vocab: int = 64):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=vocab,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def main() -> None:
    dump_dir = sys.argv[1]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    model = build()
    fsdp2 = sys.argv[2:] == ["fsdp2"]
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = Guard(
        ddp,
        optimizer,
        config=GuardConfig(dump_dir=dump_dir, run_id="raise", dumping=DumpConfig(background_write=False)),
    )
    data = torch.Generator().manual_seed(rank)
    for step in range(4):
        for mb in range(2):
            ids = torch.randint(0, 64, (4, 8), generator=data)
            if (rank == 1 or fsdp2) and step == BAD_STEP and mb == BAD_MB:
                ids[BAD_ROW, 5] = 300  # a corrupted record: ids past the vocabulary
            batch = {"input_ids": ids, "labels": ids, "sample_ids": [f"r{rank}-s{step}-m{mb}-{i}" for i in range(4)]}
            guard.record_batch(batch)
            loss = ddp(input_ids=ids, labels=ids).loss
            guard.record_loss(loss)
            (loss / 2).backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
    guard.close()


if __name__ == "__main__":
    main()
