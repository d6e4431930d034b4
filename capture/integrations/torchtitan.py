"""torchtitan's trainer guarded from its own configuration: a `[forensics]` config section and a Trainer subclass.

    # job.toml (torchtitan 0.2.0)
    [job]
    custom_config_module = "forensics.capture.integrations.torchtitan"   # adds the [forensics] section to JobConfig
    [forensics]
    enable = true                                              # everything else has a default

    # launch this module instead of torchtitan.train (run_train.sh: TRAIN_FILE=forensics.capture.integrations.torchtitan)
    torchrun --nproc_per_node=8 -m forensics.capture.integrations.torchtitan --job.config_file job.toml

`ForensicsTrainer` is torchtitan's `Trainer` with `__init__`, `forward_backward_step`, `train_step` and `close`
extended (each calls torchtitan's own), never its loop copied; with `enable = false` (the default) it is
torchtitan's Trainer. torchtitan 0.2.0 has no setting that names a Trainer class: its `train.py` builds `Trainer(config)` in its `__main__` block, and its own variants (experiments/flux,
experiments/torchcomms) subclass Trainer and ship that block again; `main()` below is that block.

What the Guard does to the step (`train_step` in torchtitan/train.py):
- each micro-batch (`forward_backward_step`): recorded before its forward, as `{**input_dict, "labels": labels}`,
  with its sample IDs: the `sample_ids` field of the input dict when the dataset yields one (taken out before the
  model sees it), else the record's position in this data-parallel rank's stream, `"dp<R>:<N>"` (N counts from 0
  the sequences this rank has trained on, from torchtitan's `ntokens_seen`, which its checkpoints keep);
- its loss: torchtitan's loss function before the division by the accumulation count (the `unwrapped_loss_fn` of
  its RescaleAccumulatedLoss), recorded as it is computed;
- the check: after the step's last backward, before torchtitan clips. torchtitan keeps the norm it clips with in
  a local of `train_step` (`grad_norm = dist_utils.clip_grad_norm_(...)`, read by nothing before
  `self.optimizers.step()`), and a check after clipping would judge clipped gradients; so the Guard reduces the
  same pre-clip norm itself (one fused reduction per step). The 'skip' policy drops the step's gradients (set to
  None): torchtitan's clipping and `optimizers.step()` then have nothing to apply.
Not guarded (a warning says so): pipeline parallelism (the loss is computed inside the pipeline schedule).
Replay rebuilds the model from the dump's recipe: torchtitan's model family and the model args the job ran
(`forensics.recipes:torchtitan_model`), and torchtitan's cross-entropy (`forensics.recipes:torchtitan_loss`).
"""

# No `from __future__ import annotations` here: torchtitan's ConfigManager merges this module's JobConfig by its
# fields' types, which must be classes, not strings (torchtitan/config/manager.py, _merge_configs).

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.train import Trainer

from forensics.capture.config import DetectionConfig, DumpConfig, GuardConfig, RecordConfig
from forensics.capture.integrations.ddp import DistributedGuard
from forensics.core.kinds import Policy
from forensics.recipes import torchtitan_loss, torchtitan_recipe

log = logging.getLogger(__name__)


@dataclass
class Forensics:
    """The `[forensics]` section of a torchtitan job config (`--forensics.<field>` on the command line)."""

    enable: bool = False
    """Guard the training steps (ForensicsTrainer is torchtitan's Trainer while this is false)."""
    dump_dir: str = ""
    """Where dumps go; empty: `<job.dump_folder>/forensics`, next to torchtitan's checkpoints."""
    run_id: str = ""
    """Names the run's dump folder; empty: $FORENSICS_RUN_ID, $TORCHELASTIC_RUN_ID (torchrun's), or a timestamp."""
    on_nonfinite: str = Policy.RAISE.value
    """A NaN/Inf loss or gradient: raise after the dump (the job fails), skip the step, or continue (a Policy)."""
    on_spike: str = Policy.CONTINUE.value
    """A loss or grad-norm spike (GuardConfig's detectors): dumped; then this (a Policy)."""
    max_dumps: int = 3
    """Fault dumps per run (DumpConfig.max_dumps)."""
    sample_id_key: str = "sample_ids"
    """Field of the dataloader's input dict that carries sample IDs; without it a record's position names it."""
    replay_loss: str = ""
    """`module:function` (model, batch) -> loss that replay computes; empty: torchtitan's cross-entropy
    (forensics.recipes:torchtitan_loss). Name yours when the train spec's loss is another one."""

    def __post_init__(self):
        policies = [p.value for p in Policy]
        for name in ("on_nonfinite", "on_spike"):
            if getattr(self, name) not in policies:
                raise ValueError(f"forensics.{name} must be one of {policies}, got {getattr(self, name)!r}")
        if self.max_dumps < 0:
            raise ValueError(f"forensics.max_dumps must be >= 0, got {self.max_dumps}")
        if self.replay_loss and ":" not in self.replay_loss:
            raise ValueError(f"forensics.replay_loss must be 'module:function', got {self.replay_loss!r}")


@dataclass
class JobConfig:
    """What `job.custom_config_module = "forensics.capture.integrations.torchtitan"` adds to torchtitan's JobConfig."""

    forensics: Forensics = field(default_factory=Forensics)


def guard_config(job_config: Any, recipe: dict | None) -> GuardConfig:
    """The GuardConfig a torchtitan job's `[forensics]` section (and its clipping norm) describes."""
    section: Forensics = job_config.forensics
    dumping = DumpConfig(max_dumps=section.max_dumps, recipe=recipe)
    return GuardConfig(
        dump_dir=section.dump_dir or os.path.join(job_config.job.dump_folder, "forensics"),
        run_id=section.run_id or None,
        detection=DetectionConfig(
            on_nonfinite=Policy(section.on_nonfinite),
            on_spike=Policy(section.on_spike),
            max_grad_norm=float(job_config.training.max_norm) or None,
        ),
        dumping=dumping,
        recording=RecordConfig(sample_id_key=section.sample_id_key),
    )


class ForensicsTrainer(Trainer):
    """torchtitan's Trainer, its steps guarded when the job config says `[forensics] enable = true`.

    Attributes:
        forensics_guard: the Guard (None when not enabled); its `dumps` lists what was written.
    """

    def __init__(self, job_config: Any):
        self.forensics_guard: DistributedGuard | None = None
        self._micro_batch = 0
        super().__init__(job_config)
        section = getattr(job_config, "forensics", None)
        if section is None or not section.enable:
            return
        if self.parallel_dims.pp_enabled or len(self.model_parts) != 1:
            log.warning("forensics: pipeline parallelism is not guarded (the loss is computed inside the schedule)")
            return
        try:
            self.forensics_guard = self._build_guard(job_config, section)
        except Exception:  # forensics' own failure never stops a healthy job
            log.exception("forensics: the Guard could not be built; training is not guarded")

    def _build_guard(self, job_config: Any, section: Forensics) -> DistributedGuard:
        model = self.model_parts[0]
        recipe = torchtitan_recipe(model, self.model_args)
        if recipe is None:
            log.warning(
                "forensics: %s is not one of torchtitan's model families; name a replay factory with "
                "--factory at replay",
                type(model).__name__,
            )
        elif section.replay_loss:
            recipe["loss"] = section.replay_loss
        autocast = None
        if isinstance(self.maybe_enable_amp, torch.autocast):  # torchtitan's AMP (no FSDP): around forward and loss
            autocast = {
                "enabled": True,
                "device_type": self.device.type,
                "dtype": job_config.training.mixed_precision_param,
            }
        [optimizer] = self.optimizers.optimizers  # one model part: one torch optimizer
        guard = DistributedGuard(
            model,
            optimizer,
            self.lr_schedulers.schedulers[0],
            config=guard_config(job_config, recipe),
            loss_fn=torchtitan_loss,
            autocast=autocast,
        )
        guard.integration = {
            "framework": "torchtitan",
            "model": job_config.model.name,
            "flavor": job_config.model.flavor,
            "fsdp": bool(self.parallel_dims.fsdp_enabled),
        }
        self._record_losses(guard)
        return guard

    def _record_losses(self, guard: DistributedGuard) -> None:
        """Wraps the loss torchtitan divides by the accumulation count: each training loss is recorded as computed."""
        rescaled = self.loss_fn
        inner = rescaled.unwrapped_loss_fn

        def recorded_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = inner(*args, **kwargs)
            if torch.is_grad_enabled() and not rescaled.skip_rescale:  # not validation (no_rescale, no_grad)
                guard.record_loss(loss)
            return loss

        rescaled.unwrapped_loss_fn = recorded_loss

    # -- torchtitan's extension points ---------------------------------------------------------------
    def forward_backward_step(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        guard = self.forensics_guard
        if guard is None:
            return super().forward_backward_step(input_dict, labels)
        sample_ids: Any = input_dict.pop(guard.config.recording.sample_id_key, None)  # the model never sees them
        if sample_ids is None:
            sample_ids = self._positions(labels, guard)
        guard.record_batch({**input_dict, "labels": labels}, sample_ids=sample_ids)
        loss = super().forward_backward_step(input_dict, labels)
        self._micro_batch += 1
        if self._micro_batch == self.gradient_accumulation_steps:  # the step's last backward: check before clipping
            self._micro_batch = 0
            if not guard.check(step=self.step):
                self.optimizers.zero_grad(set_to_none=True)  # 'skip': nothing for clipping and the optimizer
        return loss

    def train_step(self, data_iterator: Any) -> None:
        self._micro_batch = 0  # a step starts with its first micro-batch, whatever the last one did
        super().train_step(data_iterator)

    def _positions(self, labels: torch.Tensor, guard: DistributedGuard) -> list[str]:
        """`dp<R>:<N>` for each row of the micro-batch: N counts the sequences this data-parallel rank has trained on,
        from torchtitan's own `ntokens_seen` (which `batch_generator` has already advanced by this micro-batch, and
        which torchtitan's checkpoints save: the count goes on after a resume)."""
        rank = getattr(self.dataloader, "dp_rank", guard.rank)
        per_row = max(1, labels[0].numel()) if labels.dim() else 1
        first = (self.ntokens_seen - labels.numel()) // per_row
        return [f"dp{rank}:{first + row}" for row in range(int(labels.shape[0]) if labels.dim() else 1)]

    def close(self) -> None:
        guard, self.forensics_guard = self.forensics_guard, None
        try:
            if guard is not None:
                guard.close()
        finally:
            super().close()


def main(args: list[str] | None = None) -> None:
    """torchtitan's `train.py` entry point with ForensicsTrainer: parse the config, build, train, close."""
    import sys

    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    config = ConfigManager().parse_args(sys.argv[1:] if args is None else args)
    trainer: ForensicsTrainer | None = None
    try:
        trainer = ForensicsTrainer(config)
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")


if __name__ == "__main__":
    # Run as `-m forensics.capture.integrations.torchtitan`: the classes the config names are the package module's, not
    # __main__'s copies.
    from forensics.capture.integrations.torchtitan import main as package_main

    package_main()
