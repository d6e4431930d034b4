"""Framework adapters for the Guard: DDP, Accelerate, DeepSpeed, Hugging Face Trainer, Lightning, torchtitan.

Each lives in its own module and is imported only when its name is first used, so `import capture`
never imports accelerate, deepspeed, transformers, lightning or torchtitan.

    from capture.integrations import DistributedGuard             # torch DDP (torchrun)
    from capture.integrations import AccelerateGuard              # accelerate.Accelerator
    from capture.integrations import DeepSpeedGuard               # deepspeed engines, ZeRO 0-3
    from capture.integrations import ForensicsTrainerCallback     # transformers.Trainer
    from capture.integrations import ForensicsLightningCallback   # pytorch_lightning / lightning
    from capture.integrations import ForensicsTrainer             # torchtitan's Trainer (config: [forensics])
"""

from __future__ import annotations

from forensics.lazy import lazy_exports

_EXPORTS = {
    "DistributedGuard": "capture.integrations.ddp",
    "AccelerateGuard": "capture.integrations.accelerate",
    "DeepSpeedGuard": "capture.integrations.deepspeed",
    "ForensicsTrainerCallback": "capture.integrations.hf_trainer",
    "ForensicsLightningCallback": "capture.integrations.lightning",
    "ForensicsTrainer": "capture.integrations.torchtitan",
}

__all__ = list(sorted(_EXPORTS))  # a list literal's type for linters


__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
