"""Framework adapters for the Guard: DDP, Accelerate, DeepSpeed, Hugging Face Trainer, Lightning, torchtitan.

Each lives in its own module and is imported only when its name is first used, so `import forensics.capture`
never imports accelerate, deepspeed, transformers, lightning or torchtitan.

    from forensics.capture.integrations import DistributedGuard             # torch DDP (torchrun)
    from forensics.capture.integrations import AccelerateGuard              # accelerate.Accelerator
    from forensics.capture.integrations import DeepSpeedGuard               # deepspeed engines, ZeRO 0-3
    from forensics.capture.integrations import ForensicsTrainerCallback     # transformers.Trainer
    from forensics.capture.integrations import ForensicsLightningCallback   # pytorch_lightning / lightning
    from forensics.capture.integrations import ForensicsTrainer             # torchtitan's Trainer (config: [forensics])
"""

from __future__ import annotations

from forensics.core.lazy import lazy_exports

_EXPORTS = {
    "DistributedGuard": "forensics.capture.integrations.ddp",
    "AccelerateGuard": "forensics.capture.integrations.accelerate",
    "DeepSpeedGuard": "forensics.capture.integrations.deepspeed",
    "ForensicsTrainerCallback": "forensics.capture.integrations.hf_trainer",
    "ForensicsLightningCallback": "forensics.capture.integrations.lightning",
    "ForensicsTrainer": "forensics.capture.integrations.torchtitan",
}

__all__ = list(sorted(_EXPORTS))  # a list literal's type for linters


__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
