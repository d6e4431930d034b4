"""A `transformers.TrainerCallback` that guards `Trainer.train()`: one line, same detectors, policies and dump.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[ForensicsTrainerCallback(GuardConfig(dump_dir="dumps"))])

How the Trainer's step is observed without changing it:
- micro-batches: a forward pre-hook on the model records each training forward's inputs (and pops the
  sample-ID field, so the model never sees it), with the RNG right before the forward;
- losses: a forward hook records `outputs.loss` per micro-batch. When the Trainer passes
  `num_items_in_batch`, that loss is already normalised over the whole accumulated step, so the
  recorded batch keeps `num_items_in_batch` (replay recomputes the same value) and the divisor is 1;
- the check: `on_pre_optimizer_step`, after clipping, before `optimizer.step()`. The 'skip' policy
  drops the step's gradients there, so `optimizer.step()` changes nothing.
Sample IDs reach the model only if the Trainer keeps the column: use `remove_unused_columns=False` and a
dataset whose items carry `GuardConfig.recording.sample_id_key` (e.g. `forensics.capture.IndexedDataset`).
In the Trainer's DeepSpeed mode `accelerator.backward` runs `engine.step()`, before
`on_pre_optimizer_step`: the guard is then a DeepSpeedGuard that checks from inside `engine.step()`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from transformers import TrainerCallback

from forensics.capture.config import GuardConfig
from forensics.capture.integrations.ddp import DistributedGuard

log = logging.getLogger(__name__)

NUM_ITEMS_KEY = "num_items_in_batch"


def _find_engine(model: torch.nn.Module) -> Any:
    """The DeepSpeed engine wrapping `model` (the Trainer does not hand it to callbacks)."""
    import gc

    from deepspeed import DeepSpeedEngine

    for holder in gc.get_referrers(model):  # the engine's `_modules` dict refers to the model
        if isinstance(holder, dict):
            for owner in gc.get_referrers(holder):
                if isinstance(owner, DeepSpeedEngine) and owner.module is model:
                    return owner
    return None


def _loss_of(output: Any) -> Any:
    if isinstance(output, dict):
        return output.get("loss")
    loss = getattr(output, "loss", None)
    if (
        loss is None
        and isinstance(output, (tuple, list))
        and output
        and isinstance(output[0], torch.Tensor)
        and output[0].dim() == 0
    ):
        loss = output[0]
    return loss


class ForensicsTrainerCallback(TrainerCallback):
    """Guards a Hugging Face Trainer run; the Guard is built at `on_train_begin`.

    Args:
        config: GuardConfig (dump_dir, policies, ...). `max_grad_norm` defaults to the Trainer's.
        loss_fn: `(model, batch) -> loss` for replay; default `model(**batch).loss`, which is what the
            Trainer computes for models that return a loss.
    Attributes:
        guard: the DistributedGuard once training has begun (its `dumps` lists what was written).
    """

    def __init__(self, config: GuardConfig | None = None, loss_fn: Callable | None = None):
        self.config = config or GuardConfig()
        self.loss_fn = loss_fn
        self.guard: DistributedGuard | None = None
        self._handles: list[Any] = []
        self._optimizer: Any = None

    # -- lifecycle -------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if model is None or optimizer is None:
            log.warning("forensics: the Trainer gave no model/optimizer to callbacks; training is not guarded")
            return
        config = self.config.replace()  # a copy: the callback adjusts it to the Trainer
        if config.detection.max_grad_norm is None and args.max_grad_norm:
            config = config.replace(max_grad_norm=float(args.max_grad_norm))
        if config.detection.loss_divisor is None:
            config = config.replace(loss_divisor=float(args.gradient_accumulation_steps))
        autocast = None
        if args.bf16 or args.fp16:
            autocast = {
                "enabled": True,
                "device_type": args.device.type,
                "dtype": "bfloat16" if args.bf16 else "float16",
            }
        self._optimizer = optimizer
        if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None):
            engine = _find_engine(model)
            if engine is None:
                log.warning(
                    "forensics: the Trainer runs DeepSpeed but its engine was not found; training is "
                    "not guarded (use DeepSpeedGuard in a custom loop)"
                )
                return
            from forensics.capture.integrations.deepspeed import DeepSpeedGuard

            # The Trainer's accelerator.backward() calls engine.step(): check from inside that call.
            self.guard = DeepSpeedGuard(engine, config=config, loss_fn=self.loss_fn, hook_step=True)
            self.guard.integration["framework"] = "transformers.Trainer+deepspeed"
        else:
            self.guard = DistributedGuard(
                model,
                getattr(optimizer, "optimizer", optimizer),
                getattr(lr_scheduler, "scheduler", lr_scheduler),
                getattr(optimizer, "scaler", None),
                config=config,
                loss_fn=self.loss_fn,
                autocast=autocast,
            )
            self.guard.integration = {"framework": "transformers.Trainer"}
        self._ids_dropped_by_trainer = bool(getattr(args, "remove_unused_columns", False))
        self._warned_no_ids = False
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Removes the model hooks and waits for background dump writes."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.guard is not None:
            self.guard.close()

    # -- per micro-batch -------------------------------------------------------------------------
    def _before_forward(self, module, args, kwargs):
        if self.guard is None or not module.training or not torch.is_grad_enabled():
            return None
        key = self.guard.config.recording.sample_id_key
        sample_ids = kwargs.get(key)
        if sample_ids is None and not self._warned_no_ids:
            self._warned_no_ids = True
            why = (
                " The Trainer removes dataset columns its model's forward does not accept: set "
                "TrainingArguments(remove_unused_columns=False) to keep them (the callback takes the ids out "
                "before the forward)."
                if self._ids_dropped_by_trainer
                else ""
            )
            log.warning(
                "forensics: the Trainer's batches carry no %r field, so dumps will name samples by their "
                "position in the step (step<N>/rank<R>/mb<M>/<i>), not by their dataset id.%s Add ids with "
                "capture.IndexedDataset(dataset).",
                key,
                why,
            )
        if args and kwargs:
            batch: Any = {"args": list(args), **kwargs}
        else:
            batch = dict(kwargs) if kwargs else list(args)
        if isinstance(batch, dict):
            batch.pop(key, None)
            if NUM_ITEMS_KEY in batch:  # the loss is normalised over the step: micro-batch losses add up
                self.guard.config.detection.loss_divisor = 1.0
        self.guard.record_batch(batch, sample_ids=sample_ids)
        if key in kwargs:
            return args, {k: v for k, v in kwargs.items() if k != key}
        return None

    def _after_forward(self, module, args, kwargs, output):
        if self.guard is None or not module.training or not torch.is_grad_enabled():
            return None
        loss = _loss_of(output)
        if loss is not None:
            self.guard.record_loss(loss)
        return None

    # -- per optimizer step ----------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.guard is None:
            return None
        if not self.guard.check(step=state.global_step):
            self._optimizer.zero_grad(set_to_none=True)  # 'skip': optimizer.step() has nothing to apply
        return None
