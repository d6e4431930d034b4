"""A Lightning `Callback` that guards `Trainer.fit()`: one line, same detectors, policies and dump.

    trainer = pl.Trainer(..., callbacks=[ForensicsLightningCallback(GuardConfig(dump_dir="dumps"))])

Hooks used (automatic optimization): `on_train_batch_start` records the micro-batch and RNG before its
`training_step`; the loss `training_step` returns is recorded as it leaves the step (before Lightning
divides it by `accumulate_grad_batches` and, in fp16, scales it), by wrapping the module's
`training_step` for the length of the fit; `on_before_optimizer_step` (after backward and fp16
unscaling, before clipping) runs the check. The 'skip' policy drops the step's gradients there.
For replay, name a factory that builds your LightningModule: `DumpConfig(recipe={"factory": "pkg.mod:fn"})`;
the recorded loss is `training_step_loss` (the module's own `training_step`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any, Callable

import torch

from forensics.capture.config import GuardConfig
from forensics.capture.integrations.ddp import DistributedGuard

try:  # the standalone package first: a callback must subclass the Callback of the Trainer in use
    from pytorch_lightning import Callback
except ImportError:  # pragma: no cover - only the unified `lightning` package installed
    from lightning.pytorch import Callback

log = logging.getLogger(__name__)


def training_step_loss(model: Any, batch: Any) -> torch.Tensor:
    """Replay loss of a LightningModule: the loss its own `training_step(batch, 0)` returns."""
    return _step_loss(model.training_step(batch, 0))


def _step_loss(output: Any) -> Any:
    if isinstance(output, Mapping):
        return output.get("loss")
    return output


class ForensicsLightningCallback(Callback):
    """Guards a Lightning fit; the Guard is built at `on_train_start`.

    Args:
        config: GuardConfig. `loss_divisor` defaults to `accumulate_grad_batches`, `max_grad_norm` to
            `gradient_clip_val` (norm clipping).
        loss_fn: `(module, batch) -> loss` for replay; default `training_step_loss`.
    Attributes:
        guard: the DistributedGuard once training has started (its `dumps` lists what was written).
    """

    def __init__(self, config: GuardConfig | None = None, loss_fn: Callable | None = None):
        self.config = config or GuardConfig()
        self.loss_fn = loss_fn or training_step_loss
        self.guard: DistributedGuard | None = None
        self._module: Any = None

    def on_train_start(self, trainer, pl_module) -> None:
        if not pl_module.automatic_optimization:
            log.warning(
                "forensics: manual optimization is not guarded by ForensicsLightningCallback; "
                "call Guard.record_batch / record_loss / check in your training_step"
            )
            return
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            log.warning("forensics: %d optimizers; only the first one's state is dumped", len(optimizers))
        config = self.config.replace()  # a copy: the callback adjusts it to the Trainer
        if config.detection.loss_divisor is None:
            config.detection.loss_divisor = float(trainer.accumulate_grad_batches)
        clip = trainer.gradient_clip_val
        algorithm = str(trainer.gradient_clip_algorithm or "norm")
        if config.detection.max_grad_norm is None and clip and algorithm.endswith("norm"):
            config.detection.max_grad_norm = float(clip)
        schedulers = trainer.lr_scheduler_configs
        self.guard = DistributedGuard(
            pl_module,
            optimizers[0],
            schedulers[0].scheduler if schedulers else None,
            getattr(trainer.precision_plugin, "scaler", None),
            config=config,
            loss_fn=self.loss_fn,
        )
        self.guard.integration = {
            "framework": "lightning",
            "precision": str(trainer.precision),
            "strategy": type(trainer.strategy).__name__,
        }
        self._wrap_training_step(pl_module)

    def _wrap_training_step(self, pl_module) -> None:
        original = pl_module.training_step
        guard = self.guard

        @functools.wraps(original)
        def training_step(*args, **kwargs):
            output = original(*args, **kwargs)
            loss = _step_loss(output)
            if isinstance(loss, torch.Tensor):
                guard.record_loss(loss)
            return output

        pl_module.training_step = training_step  # an instance attribute; removed at the end of the fit
        self._module = pl_module

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.guard is not None:
            self.guard.record_batch(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.guard is not None and not self.guard.check(step=trainer.global_step):
            optimizer.zero_grad(set_to_none=True)  # 'skip': the optimizer step has nothing to apply

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        """A step that raised: dump it (the exception then goes on as Lightning decides)."""
        if self.guard is not None and isinstance(exception, Exception):
            self.guard.record_exception(exception)
        self.close()

    def close(self) -> None:
        """Unwraps `training_step` and waits for background dump writes."""
        if self._module is not None:
            if "training_step" in vars(self._module):
                del self._module.training_step
            self._module = None
        if self.guard is not None:
            self.guard.close()
