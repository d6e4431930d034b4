"""Example: a DeepSpeed engine (ZeRO stage 0-3, fp32 / bf16 / fp16) guarded by forensics.

    torchrun --nproc_per_node=2 scripts/examples/deepspeed_example.py --zero-stage 3 --dump-dir /tmp/dumps --run-id z3
    forensics replay /tmp/dumps/z3/step-000000003 --rank 1
    torchrun --nproc_per_node=2 scripts/examples/deepspeed_example.py --precision fp16 \
        --initial-scale-power 40 --min-loss-scale 8589934592 --policy continue --steps 8   # GPU: fp16 skips

On CPU set DS_ACCELERATOR=cpu (gloo; torch's AdamW via "torch_adam", so nothing is compiled).
Rank 1 reads a corrupt sample in step 3: every rank gathers the full ZeRO state (weights, fp32 master
weights, Adam moments, keyed by parameter name) and writes its own dump of step 3.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, DistributedSampler

import _common
from forensics.capture import DetectionConfig, DumpConfig, GuardConfig, IndexedDataset
from forensics.capture.integrations import DeepSpeedGuard
from forensics.core.errors import TrainingFaultError


def ds_config(args) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": _common.CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": _common.LR, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "steps_per_print": 10_000,
    }
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif args.precision == "fp16":
        config["fp16"] = {
            "enabled": True,
            "initial_scale_power": args.initial_scale_power,
            "min_loss_scale": args.min_loss_scale,
            "hysteresis": 1,
        }
    return config


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = parser.parse_args()
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _common.tiny_model(args.model)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        config=ds_config(args),
        model_parameters=model.parameters(),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, _common.warmup),
    )
    # --- forensics: one line to create the guard ---
    guard = DeepSpeedGuard(
        engine,
        config=GuardConfig(
            dump_dir=args.dump_dir,
            run_id=args.run_id,
            detection=DetectionConfig(on_nonfinite=args.policy),
            dumping=DumpConfig(max_dumps=args.max_dumps, state_layout=args.layout, shard_replicas=args.replicas),
        ),
    )
    dtype = next(engine.module.parameters()).dtype

    samples = world * args.steps * args.accum * args.micro_batch
    dataset = IndexedDataset(_common.EmbedsDataset(samples, poison=args.poison, poison_value=args.poison_value))
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=DistributedSampler(dataset, shuffle=False))
    timer = _common.Timer()
    try:
        for batch in loader:
            batch = {
                "inputs_embeds": batch["inputs_embeds"].to(engine.device, dtype),
                "labels": batch["labels"].to(engine.device),
                "sample_ids": batch["sample_ids"],
            }
            guard.record_batch(batch)  # forensics
            loss = engine(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss
            guard.record_loss(loss)  # forensics
            engine.backward(loss)
            timer = _common.Timer()
            guard.check()  # forensics (no-op off the boundary)
            engine.step()
        _common.report(rank, fault=None, dumps=guard.dumps, history=guard.history.to_dict())
    except TrainingFaultError as fault:
        _common.report(
            rank, fault=fault.trigger, dump=fault.dump_path, dump_seconds=timer(), dump_error=fault.dump_error
        )
    finally:
        guard.close()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    main()
