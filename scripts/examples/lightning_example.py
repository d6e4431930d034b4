"""Example: a Lightning `Trainer.fit()` guarded by forensics with one callback.

    python scripts/examples/lightning_example.py --dump-dir /tmp/dumps --run-id lit
    forensics replay /tmp/dumps/lit/step-000000003 --path scripts/examples --trust

Sample 13 is corrupt: with 2 samples per micro-batch and 2 micro-batches per step it is read in step 3,
micro-batch 0. The dump names the LightningModule factory (`_common:lit_gpt2`) and its training_step
as the loss, so replay can rebuild the module (with --trust, since both are your code).
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

import _common
from forensics.capture import DetectionConfig, DumpConfig, GuardConfig, IndexedDataset
from forensics.capture.integrations import ForensicsLightningCallback
from forensics.core.errors import TrainingFaultError


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    parser.set_defaults(poison=13)
    args = parser.parse_args()
    try:
        import pytorch_lightning as pl
    except ImportError:
        import lightning.pytorch as pl

    samples = args.steps * args.accum * args.micro_batch
    loader = DataLoader(
        IndexedDataset(_common.EmbedsDataset(samples, poison=args.poison)), batch_size=args.micro_batch, shuffle=False
    )
    # --- forensics: one callback (the recipe tells replay how to rebuild this LightningModule) ---
    callback = ForensicsLightningCallback(
        GuardConfig(
            dump_dir=args.dump_dir,
            run_id=args.run_id,
            detection=DetectionConfig(on_nonfinite=args.policy),
            dumping=DumpConfig(recipe={"factory": "_common:lit_gpt2", "factory_kwargs": {"fused": args.fused}}),
        )
    )
    trainer = pl.Trainer(
        max_steps=args.steps,
        accumulate_grad_batches=args.accum,
        gradient_clip_val=_common.CLIP,
        precision=args.precision,
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback],
    )
    try:
        trainer.fit(_common.lit_gpt2(fused=args.fused), loader)
        _common.report(trainer.global_rank, fault=None, dumps=callback.guard.dumps)
    except TrainingFaultError as fault:
        _common.report(trainer.global_rank, fault=fault.trigger, dump=fault.dump_path, dump_error=fault.dump_error)


if __name__ == "__main__":
    main()
