"""The state source: what the training state is, and how a dump, a host snapshot and the grad norm read it.

The Guard builds one and hands it to the checks, the dump path and the dump of a step that raised; none of them
reads the Guard. `StateSource` is the plain one (a whole model on each rank: one process, DDP), `DTensorState` a
model holding DTensors (FSDP2, tensor parallel: each rank writes its local shards), and the DeepSpeed adapter
specialises it for ZeRO's flat partitions (capture/integrations/deepspeed.py). What each returns:

    collect(copy)        the name-keyed pre-step state a dump writes (docs/DUMP_FORMAT.md), full or sharded
    snapshot()           the state a host snapshot copies, or None and why not
    is_collective        reading the state is a collective (a step that raised on one rank is then not dumped)
    needs_every_rank     one rank's dump would not hold the whole state (a precursor is then dumped by all)
    recipe()             the manifest's `recipe`
    distribution()       the manifest's `distributed` section (None: omitted)
    grad_norm()          the step's gradient norm when the loop passed none
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from forensics.capture.config import GuardConfig
from forensics.capture.state import sharding, snapshot
from forensics.capture.state.buffers import PreForwardBuffers
from forensics.capture.state.recipe import build_recipe
from forensics.core import thirdparty
from forensics.core.grad_norm import total_grad_norm
from forensics.core.kinds import StateLayout

log = logging.getLogger(__name__)


def distributed() -> bool:
    """True when torch.distributed is initialised in this process."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@dataclass(frozen=True)
class Ranks:
    """Who this process is among the job's ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def here(cls) -> "Ranks":
        """This process's rank, world size and local rank; from the environment before init_process_group."""
        if distributed():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        return cls(rank, world, int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def multi_rank(self) -> bool:
        """Several ranks under an initialised process group (each step then agrees across ranks)."""
        return self.world_size > 1 and distributed()


class StateSource:
    """The state of a model every rank holds whole (one process, DDP), with its optimizer, scheduler and scaler.

    Args:
        model: the unwrapped module; optimizer, scheduler, scaler: as given to the Guard.
        config: the Guard's configuration (state layout, recipe, sample-ID key); a source may turn off what its state
            cannot do (`config` then differs from the one given: the Guard takes it).
        ranks: who this process is.
        loss_fn: the loss the recipe names and the in-job re-check calls.
    """

    dtensors = False
    """The model holds DTensors (DTensorState)."""
    sharded_grad_norm = False
    """True when grad_norm() is the norm of this rank's shard only (ZeRO, DTensor models): the agreement all-reduce
    assembles the global norm. A norm the loop passes to check() is the global one."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        scaler: Any,
        config: GuardConfig,
        ranks: Ranks,
        loss_fn: Callable | None = None,
    ):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.config, self.ranks, self.loss_fn = config, ranks, loss_fn
        self.buffers = PreForwardBuffers(model)
        """The model's buffers before the step's first forward (capture/state/buffers.py): dumped, restored on skip."""
        self.fsdp_units: list[dict] = []
        """FSDP2 units and their mixed-precision policies (the manifest's precision.fsdp)."""
        self.own_norm_unscaled = False
        """The last grad_norm() divided the loss scale out of gradients a scaler still held scaled."""
        self.layout_used: StateLayout | None = None
        """The state layout of the last collect() (GuardConfig.dumping.state_layout resolved)."""
        self.integration: dict | None = None
        """A framework adapter's `{"framework": ...}`: the manifest's `distributed` section names it (even on one
        rank). None: the section is written only with several ranks."""

    # -- the gradient norm -----------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor | float | None:
        """The gradient norm of this step when the loop passed none (None: no gradients). Always unscaled:
        gradients a GradScaler still holds scaled (check() before `scaler.unscale_`) are measured divided by its
        scale (its device tensor, no sync), and `own_norm_unscaled` says so (the manifest's
        `loss.grad_norm_unscaled_by`)."""
        norm = self._norm_of([p.grad for p in self.model.parameters() if p.grad is not None])
        scale = thirdparty.grads_scaled_by(self.scaler, self.optimizer)  # before scaler.unscale_: grads x scale
        self.own_norm_unscaled = False
        if scale is not None and norm is not None:  # one unit everywhere: the norm clip_grad_norm_ sees after unscale_
            self.own_norm_unscaled = True
            norm = norm / scale.reshape(()).to(norm.device) if isinstance(norm, torch.Tensor) else norm / float(scale)
        return norm

    def _norm_of(self, grads: list[torch.Tensor]) -> torch.Tensor | float | None:
        return total_grad_norm(grads)

    # -- the state a dump writes -----------------------------------------------------------------
    def collect(self, copy: snapshot.HostCopy) -> dict:
        """Name-keyed pre-step state: `{"model": {name: tensor}, "optimizer": {...}}` (docs/DUMP_FORMAT.md), the
        full state, or, in the sharded layout (DumpConfig.state_layout), this rank's part of it plus `"layout"`,
        the table of the complete state. Tensors go through `copy` (a no-op unless the dump is written in the
        background)."""
        full_form = self.references()
        self.layout_used = self._layout(full_form)
        if self.layout_used is StateLayout.SHARDED:
            state, table = sharding.shard_state(
                full_form, self.ranks.rank, self.ranks.world_size, self.config.dumping.shard_replicas, copy
            )
            return {**state, "layout": table}
        return sharding.full_state(full_form, copy)

    def references(self) -> dict:
        """The state as references (DTensors as they are): nothing copied or gathered yet."""
        model = snapshot.model_state(self.model, torch.Tensor.detach)
        model.update({name: value for name, value in self.buffers.before().items() if name in model})
        return {"model": model, "optimizer": snapshot.optimizer_state(self.optimizer, self.model, torch.Tensor.detach)}

    def snapshot(self) -> tuple[dict | None, str | None]:
        """The state a host snapshot copies (references, full layout), or (None, why a snapshot is not taken)."""
        full_form = self.references()
        if self._layout(full_form) is StateLayout.SHARDED:
            return None, "the state is written sharded across ranks (GuardConfig.dumping.state_layout)"
        return full_form, None

    def _layout(self, full_form: dict) -> StateLayout:
        dumping, ranks = self.config.dumping, self.ranks
        return sharding.choose_layout(
            StateLayout(dumping.state_layout),
            ranks.world_size if ranks.multi_rank else 1,
            self.dtensors,
            sharding.state_bytes(full_form),
            dumping.full_state_max_bytes,
        )

    @property
    def is_collective(self) -> bool:
        """True when collect() is a collective (ZeRO gathers, DTensors written whole): then a step that raised on one
        rank is not dumped (the other ranks would never join the gather)."""
        return False

    @property
    def needs_every_rank(self) -> bool:
        """True when one rank's dump would not hold the whole state: several ranks, and a state each writes its part
        of (sharded layout) or one gathered by a collective. A dump this rank alone decides on (a precursor) is then
        made by every rank at the same step, through the step's all-reduce (capture/precursors/monitor.py)."""
        return self.ranks.multi_rank and self._layout(self.references()) is StateLayout.SHARDED

    # -- what the manifest says about it ---------------------------------------------------------
    def recipe(self) -> dict:
        """The manifest's `recipe`: import paths of the model factory and loss, never executed here."""
        return build_recipe(self.model, self.loss_fn, self.config.recording.sample_id_key, self.config.dumping.recipe)

    def distribution(self) -> dict | None:
        """The manifest's optional `distributed` section (None: omitted): the adapter's framework, or with several
        ranks the world size and how the state was written."""
        if self.integration is not None:
            return {**self.integration, "world_size": self.ranks.world_size, "state": self.words()}
        if not self.ranks.multi_rank:
            return None
        return {
            "framework": "torch",
            "world_size": self.ranks.world_size,
            "dtensor": self.dtensors,
            "state": self.words(),
        }

    def words(self) -> str:
        """How the last dump's state was written, in words (the `distributed.state` field)."""
        return sharding.layout_words(self.layout_used)


class DTensorState(StateSource):
    """A model holding DTensors (FSDP2, tensor parallel): each rank holds shards; the state is written from them."""

    dtensors = True
    sharded_grad_norm = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fsdp_units = sharding.fsdp_units(self.model)
        if self.config.dumping.recheck:  # the Guard takes this config
            log.warning(
                "forensics: recheck is off for a DTensor (FSDP2 / tensor-parallel) model: a forward on the "
                "ranks that saw the fault alone would wait forever for the others"
            )
            self.config = self.config.replace(recheck=False)

    def _norm_of(self, grads: list[torch.Tensor]) -> torch.Tensor | float | None:
        return sharding.shard_grad_norm(grads)

    def references(self) -> dict:
        """FSDP2 reshards first (local, no communication): a step that raised mid-forward leaves some modules'
        parameters gathered, and the dump holds each rank's shards."""
        sharding.reshard(self.model)
        return super().references()

    def snapshot(self) -> tuple[dict | None, str | None]:
        return None, "the model is sharded (FSDP2 / tensor parallel)"

    @property
    def is_collective(self) -> bool:
        if not self.ranks.multi_rank:
            return False
        full_form = self.references()
        return self._layout(full_form) is StateLayout.FULL or sharding.needs_collective(full_form)

    @property
    def needs_every_rank(self) -> bool:
        """Written sharded, or gathered whole by a collective: either way every rank takes part."""
        return self.ranks.multi_rank


def state_source(model: torch.nn.Module, *args: Any, **kwargs: Any) -> StateSource:
    """The state source for `model`: DTensorState when it holds DTensors, else StateSource (same arguments)."""
    return (DTensorState if sharding.has_dtensors(model) else StateSource)(model, *args, **kwargs)
