"""Guard for Hugging Face Accelerate: `accumulate()`, `Accelerator.backward`, `clip_grad_norm_`, bf16/fp16, DeepSpeed plugin.

Accelerate runs the model's forward under autocast by wrapping `model.forward`, and divides the loss by
the accumulation count inside `backward`; the guard records both as they really happen. Its prepared
optimizer only steps when `accelerator.sync_gradients` is true, so `check()` is a no-op until then.
Under Accelerate's DeepSpeed plugin, `accelerator.backward` also calls `engine.step()`; the guard is
then a DeepSpeedGuard hooked into that call.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from forensics.capture.config import GuardConfig
from forensics.capture.integrations.ddp import DistributedGuard
from forensics.capture.integrations.deepspeed import DeepSpeedGuard

log = logging.getLogger(__name__)


def _autocast(accelerator: Any) -> dict | None:
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(str(accelerator.mixed_precision))
    if dtype is None:
        return None
    return {"enabled": True, "device_type": accelerator.device.type, "dtype": dtype}


class AccelerateGuard(DistributedGuard):
    """Watches a loop driven by `accelerate.Accelerator`.

    Args:
        accelerator: the Accelerator.
        model, optimizer, scheduler: as returned by `accelerator.prepare` (or not prepared).
        config: GuardConfig; `loss_divisor` defaults to the accelerator's gradient_accumulation_steps.
        loss_fn: `(model, batch) -> loss`, as for Guard.
    Example:
        >>> model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)  # doctest: +SKIP
        >>> guard = AccelerateGuard.create(accelerator, model, optimizer, scheduler, config=GuardConfig())    # doctest: +SKIP
        >>> for batch in loader:                                                                              # doctest: +SKIP
        ...     with accelerator.accumulate(model):
        ...         guard.record_batch(batch)
        ...         loss = model(**inputs).loss
        ...         guard.backward(loss)                     # record_loss + accelerator.backward
        ...         grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
        ...         if guard.check(grad_norm=grad_norm):     # no-op until the accumulation boundary
        ...             optimizer.step()
        ...         scheduler.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any = None,
        *,
        config: GuardConfig | None = None,
        loss_fn: Callable | None = None,
    ):
        self.accelerator = accelerator
        config = config or GuardConfig()
        if config.detection.loss_divisor is None:
            config = config.replace(loss_divisor=float(accelerator.gradient_accumulation_steps))
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the real one
        torch_scheduler = getattr(scheduler, "scheduler", scheduler)
        super().__init__(
            accelerator.unwrap_model(model),
            torch_optimizer,
            torch_scheduler,
            getattr(accelerator, "scaler", None),
            config=config,
            loss_fn=loss_fn,
            autocast=_autocast(accelerator),
        )
        self.integration = {
            "framework": "accelerate",
            "mixed_precision": str(accelerator.mixed_precision),
            "distributed_type": str(accelerator.distributed_type),
        }

    @classmethod
    def create(
        cls,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any = None,
        *,
        config: GuardConfig | None = None,
        loss_fn: Callable | None = None,
    ) -> DistributedGuard:
        """The right guard for this accelerator: an AccelerateGuard, or under the DeepSpeed plugin a
        DeepSpeedGuard hooked into `engine.step()` (call it after `accelerator.prepare`)."""
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None:
            return AccelerateDeepSpeedGuard(accelerator, wrapped.engine, config=config, loss_fn=loss_fn)
        return cls(accelerator, model, optimizer, scheduler, config=config, loss_fn=loss_fn)

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """`record_loss(loss)` then `accelerator.backward(loss)`: pass the loss before any division."""
        self.record_loss(loss)
        self.accelerator.backward(loss, **kwargs)

    def at_step_boundary(self) -> bool:
        """check() acts at the accumulation boundary (`accelerator.sync_gradients`) only."""
        return bool(self.accelerator.sync_gradients)


class AccelerateDeepSpeedGuard(DeepSpeedGuard):
    """A DeepSpeedGuard hooked into engine.step() (Accelerate calls it inside `accelerator.backward`), whose
    `backward` records the loss and goes through the accelerator. Made by `AccelerateGuard.create`."""

    def __init__(
        self, accelerator: Any, engine: Any, *, config: GuardConfig | None = None, loss_fn: Callable | None = None
    ):
        self.accelerator = accelerator
        super().__init__(engine, config=config, loss_fn=loss_fn, hook_step=True)

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """`record_loss(loss)` then `accelerator.backward(loss)`: pass the loss before any division."""
        self.record_loss(loss)
        self.accelerator.backward(loss, **kwargs)
