"""Example: plain torch DistributedDataParallel with gradient accumulation, guarded by forensics.

    torchrun --nproc_per_node=2 scripts/examples/ddp_example.py --dump-dir /tmp/dumps --run-id ddp
    forensics replay /tmp/dumps/ddp/step-000000003 --rank 1
    torchrun --nproc_per_node=2 scripts/examples/ddp_example.py --fp16 --initial-scale-power 40 --policy continue

Runs on CPU (gloo) or GPUs (nccl). Rank 1 reads a corrupt sample in step 3: both ranks write a dump of
step 3 (full weights and optimizer state each, their own micro-batches and sample IDs) and stop.
With --fp16 (autocast + GradScaler), the GradScaler's overflow-and-skip steps are recorded, not dumped.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import _common
from forensics.capture import DetectionConfig, DumpConfig, GuardConfig, IndexedDataset
from forensics.capture.integrations import DistributedGuard


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--fp16", action="store_true", help="fp16 autocast with a GradScaler")
    args = parser.parse_args()
    rank, world, device = _common.init_distributed()

    model = _common.tiny_gpt2().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=_common.LR, fused=args.fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _common.warmup)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**args.initial_scale_power, enabled=args.fp16)
    # --- forensics: one line to create the guard (pass the DDP wrapper or the model) ---
    guard = DistributedGuard(
        ddp,
        optimizer,
        scheduler,
        scaler,
        config=GuardConfig(
            dump_dir=args.dump_dir,
            run_id=args.run_id,
            detection=DetectionConfig(
                on_nonfinite=args.policy, max_grad_norm=_common.CLIP, min_loss_scale=args.min_loss_scale
            ),
            dumping=DumpConfig(max_dumps=args.max_dumps, state_layout=args.layout, shard_replicas=args.replicas),
        ),
    )

    samples = world * args.steps * args.accum * args.micro_batch
    dataset = IndexedDataset(_common.EmbedsDataset(samples, poison=args.poison))  # adds batch["sample_ids"]
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=DistributedSampler(dataset, shuffle=False))
    batches = iter(loader)
    with _common.reported(rank, guard) as timer:  # one report line per rank; the Guard closed
        for _step in range(args.steps):
            for index in range(args.accum):
                batch = {k: v.to(device) for k, v in next(batches).items()}
                guard.record_batch(batch)  # forensics
                sync = contextlib.nullcontext() if index == args.accum - 1 else ddp.no_sync()
                with sync:
                    with torch.autocast(device.type, dtype=torch.float16, enabled=args.fp16):
                        loss = ddp(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss
                        guard.record_loss(loss)  # forensics
                    scaler.scale(loss / args.accum).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), _common.CLIP)
            timer.restart()
            if guard.check(grad_norm=grad_norm):  # forensics
                scaler.step(optimizer)  # the plain optimizer.step() without --fp16
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
