"""A GPT-2 job on CUDA whose data holds one token id past the vocabulary: the embedding's device-side assert
poisons the CUDA context mid-run. Run as a script (one process, or under torchrun with NCCL: the bad record is
on rank 1 only); the Guard's excepthook must dump what the host holds and let the job fail with its own error.

Usage: python tests/replay/device_assert_job.py DUMP_DIR   (prints "forensics-job: step N" as it trains)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import token_job  # (the data recipe names it: replay imports it with --path tests/replay)

from forensics.capture import DumpConfig, Guard, GuardConfig, RecordConfig

BAD_STEP, BAD_MB, BAD_ROW = 5, 1, 2


def main(dump_dir: str) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if world > 1:
        torch.distributed.init_process_group("nccl", device_id=device)
    bad = (BAD_STEP * 2 + BAD_MB) * 4 + BAD_ROW if rank == world - 1 else None
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=token_job.VOCAB, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=dump_dir,
            run_id="assert",
            recording=RecordConfig(snapshot_every=2, window_steps=8),
            dumping=DumpConfig(
                data_recipe={"dataset": "token_job:make_dataset", "dataset_kwargs": {"n": 96, "bad": bad}}
            ),
        ),
    )
    loader = iter(torch.utils.data.DataLoader(token_job.make_dataset(96, bad), batch_size=4))
    for step in range(10):
        print(f"forensics-job: rank {rank} step {step} t={time.time():.3f}", flush=True)
        for _ in range(2):
            batch = next(loader)
            guard.record_batch(batch)
            loss = model(input_ids=batch["input_ids"].to(device), labels=batch["labels"].to(device)).loss
            guard.record_loss(loss)
            (loss / 2).backward()
            if world > 1:
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
    print(f"forensics-job: rank {rank} finished without the fault", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
