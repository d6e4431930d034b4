"""Example: FSDP2 (`torch.distributed.fsdp.fully_shard`, DTensor parameters) guarded by forensics.

    torchrun --nproc_per_node=2 scripts/examples/fsdp2_example.py --dump-dir /tmp/dumps --run-id fsdp2
    forensics replay /tmp/dumps/fsdp2/step-000000003 --rank 1
    torchrun --nproc_per_node=4 scripts/examples/fsdp2_example.py --mesh hsdp     # 2 replicas x 2 shards

Runs on CPU (gloo) or GPUs (nccl; --bf16 adds FSDP2's bf16 mixed-precision policy). Rank 1 reads a
corrupt sample in step 3 (2 ranks): every rank writes its own shards of the weights and AdamW moments,
its micro-batches and sample IDs, and nothing else; no rank gathers the model. `forensics replay` reads
the step's rank dumps together and names the sample on one device.
"""

from __future__ import annotations


import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import _common
from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, IndexedDataset


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument(
        "--mesh",
        default="fsdp",
        choices=("fsdp", "hsdp"),
        help="fsdp: shard over every rank; hsdp: 2 replica groups, sharded within each",
    )
    parser.add_argument("--bf16", action="store_true", help="FSDP2 mixed precision: bf16 compute, fp32 reduce")
    args = parser.parse_args()
    rank, world, device = _common.init_distributed()
    if args.mesh == "hsdp":
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))

    model = _common.tiny_model(args.model, size=args.size, device=device)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.bf16
        else MixedPrecisionPolicy()
    )
    blocks = model.transformer.h if args.model == "gpt2" else model.model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = _common.optimizer_for(args, model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _common.warmup)
    # --- forensics: one line to create the guard ---
    guard = Guard(
        model,
        optimizer,
        scheduler,
        config=GuardConfig(
            dump_dir=args.dump_dir,
            run_id=args.run_id,
            detection=DetectionConfig(on_nonfinite=args.policy, max_grad_norm=_common.CLIP),
            dumping=DumpConfig(max_dumps=args.max_dumps, state_layout=args.layout, shard_replicas=args.replicas),
        ),
    )

    samples = world * args.steps * args.accum * args.micro_batch
    dataset = IndexedDataset(
        _common.EmbedsDataset(
            samples,
            poison=args.poison,
            poison_value=args.poison_value,
            width=model.config.hidden_size,
            vocab=model.config.vocab_size,
        )
    )
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=DistributedSampler(dataset, shuffle=False))
    batches = iter(loader)
    with _common.reported(rank, guard) as timer:  # one report line per rank; the Guard closed
        for _step in range(args.steps):
            for index in range(args.accum):
                batch = {k: v.to(device) for k, v in next(batches).items()}
                guard.record_batch(batch)  # forensics
                model.set_requires_gradient_sync(index == args.accum - 1)
                loss = model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss
                guard.record_loss(loss)  # forensics
                (loss / args.accum).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), _common.CLIP)
            timer.restart()
            if guard.check(grad_norm=grad_norm):  # forensics
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
