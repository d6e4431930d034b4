"""Example: a Hugging Face `Trainer` run guarded by forensics with one callback.

    python scripts/examples/hf_trainer_example.py --dump-dir /tmp/dumps --run-id trainer
    torchrun --nproc_per_node=2 scripts/examples/hf_trainer_example.py      # DDP works the same way
    DS_ACCELERATOR=cpu torchrun --nproc_per_node=1 scripts/examples/hf_trainer_example.py --deepspeed-stage 2
    forensics replay /tmp/dumps/trainer/step-00000000N

The Trainer shuffles, so the corrupt sample lands in whichever step the sampler puts it; the callback
dumps that step (the batch holding the sample, its ID, the pre-step weights and AdamW state).
"""

from __future__ import annotations

import os
import tempfile

import torch

import _common
from forensics.capture import DetectionConfig, GuardConfig, IndexedDataset
from forensics.capture.integrations import ForensicsTrainerCallback
from forensics.core.errors import TrainingFaultError


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument(
        "--deepspeed-stage",
        type=int,
        default=None,
        choices=(0, 1, 2, 3),
        help="run the Trainer with DeepSpeed at this ZeRO stage (launch with torchrun)",
    )
    parser.add_argument("--sequential", action="store_true", help="read samples in order (no shuffling)")
    parser.set_defaults(poison=13)
    args = parser.parse_args()
    from transformers import Trainer, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", 1))
    samples = world * args.steps * args.accum * args.micro_batch  # one epoch = args.steps steps
    dataset = IndexedDataset(_common.EmbedsDataset(samples, poison=args.poison))  # items carry "sample_ids"
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.accum,
            learning_rate=_common.LR,
            max_grad_norm=_common.CLIP,
            warmup_steps=3,
            lr_scheduler_type="constant_with_warmup",
            report_to=[],
            save_strategy="no",
            logging_steps=1000,
            use_cpu=not torch.cuda.is_available(),
            bf16=args.bf16,
            seed=0,
            remove_unused_columns=False,  # keep "sample_ids": the callback takes it out before the forward
            train_sampling_strategy="sequential" if args.sequential else "random",
            deepspeed=None
            if args.deepspeed_stage is None
            else {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": args.deepspeed_stage},
            },
        )
        # --- forensics: one callback ---
        callback = ForensicsTrainerCallback(
            GuardConfig(dump_dir=args.dump_dir, run_id=args.run_id, detection=DetectionConfig(on_nonfinite=args.policy))
        )
        trainer = Trainer(model=_common.tiny_gpt2(), args=training_args, train_dataset=dataset, callbacks=[callback])
        rank = training_args.process_index
        try:
            trainer.train()
            _common.report(rank, fault=None, dumps=callback.guard.dumps)
        except TrainingFaultError as fault:
            _common.report(rank, fault=fault.trigger, dump=fault.dump_path, dump_error=fault.dump_error)
        finally:
            callback.close()


if __name__ == "__main__":
    main()
