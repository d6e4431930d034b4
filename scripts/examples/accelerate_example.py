"""Example: a Hugging Face Accelerate loop (accumulate(), backward, clip_grad_norm_, optional bf16) guarded by forensics.

    torchrun --nproc_per_node=2 scripts/examples/accelerate_example.py --dump-dir /tmp/dumps --run-id acc
    accelerate launch --num_processes 2 scripts/examples/accelerate_example.py --mixed-precision bf16
    forensics replay /tmp/dumps/acc/step-000000003 --rank 1

Rank 1 reads a corrupt sample in step 3: both ranks dump step 3 and stop.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

import _common
from forensics.capture import DetectionConfig, DumpConfig, GuardConfig, IndexedDataset
from forensics.capture.integrations import AccelerateGuard
from forensics.core.errors import TrainingFaultError


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16", "fp16"))
    parser.add_argument(
        "--deepspeed-stage",
        type=int,
        default=None,
        choices=(0, 1, 2, 3),
        help="use Accelerate's DeepSpeed plugin with this ZeRO stage",
    )
    args = parser.parse_args()
    from accelerate import Accelerator, DeepSpeedPlugin

    plugin = None
    if args.deepspeed_stage is not None:
        plugin = DeepSpeedPlugin(
            hf_ds_config={
                "train_micro_batch_size_per_gpu": args.micro_batch,
                "gradient_accumulation_steps": args.accum,
                "gradient_clipping": _common.CLIP,
                "zero_optimization": {"stage": args.deepspeed_stage},
                "steps_per_print": 10_000,
            }
        )
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accum,
        mixed_precision=args.mixed_precision,
        cpu=not torch.cuda.is_available() and plugin is None,
        deepspeed_plugin=plugin,
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    if torch.distributed.is_initialized():  # Accelerate's DeepSpeed mode on CPU reports one process
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _common.tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=_common.LR)
    # Not prepared: it steps once per optimizer step (a prepared one steps once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _common.warmup)
    model, optimizer = accelerator.prepare(model, optimizer)
    # --- forensics: one line to create the guard (after prepare) ---
    guard = AccelerateGuard.create(
        accelerator,
        model,
        optimizer,
        scheduler,
        config=GuardConfig(
            dump_dir=args.dump_dir,
            run_id=args.run_id,
            detection=DetectionConfig(on_nonfinite=args.policy, max_grad_norm=_common.CLIP),
            dumping=DumpConfig(state_layout=args.layout, shard_replicas=args.replicas),
        ),
    )

    samples = world * args.steps * args.accum * args.micro_batch
    dataset = IndexedDataset(_common.EmbedsDataset(samples, poison=args.poison))
    # A DistributedSampler, so every example gives rank r the same samples (a prepared loader works too).
    loader = DataLoader(
        dataset,
        batch_size=args.micro_batch,
        sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False),
    )
    timer = _common.Timer()
    try:
        for batch in loader:
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with accelerator.accumulate(model):
                guard.record_batch(batch)  # forensics
                loss = model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss
                guard.backward(loss)  # forensics: record_loss + backward
                grad_norm = None
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), _common.CLIP)
                timer = _common.Timer()
                if guard.check(grad_norm=grad_norm):  # forensics (no-op until sync)
                    optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
        _common.report(rank, fault=None)
    except TrainingFaultError as fault:
        _common.report(
            rank, fault=fault.trigger, dump=fault.dump_path, dump_seconds=timer(), dump_error=fault.dump_error
        )
    finally:
        guard.close()
        accelerator.end_training()


if __name__ == "__main__":
    main()
