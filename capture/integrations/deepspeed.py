"""Guard for DeepSpeed engines (ZeRO 0-3, fp32 / bf16 / fp16 with loss scaling): full, name-keyed state in every rank's dump.

On a trigger every rank gathers the full pre-step state through DeepSpeed's public API
(`deepspeed.zero.GatheredParameters` for ZeRO-3 weights, `deepspeed.utils.safe_get_full_optimizer_state`
and `safe_get_full_fp32_param` for the optimizer), one parameter at a time straight to host memory,
so each rank's dump replays alone on one GPU. Those calls are collectives: all ranks make them, in the
same order, on the step they agreed on; none is made after the local write starts.

fp16: DeepSpeed's own overflow-and-skip steps are normal. They are recorded in the history
(`skipped`, `loss_scale`) and trigger nothing; a non-finite loss does, and so does an overflow once
the loss scale has fallen to DeepSpeed's `min_loss_scale`.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable

import torch

from forensics.capture.config import GuardConfig
from forensics.capture.integrations.ddp import DistributedGuard
from forensics.capture.state import sharding, snapshot
from forensics.capture.state.snapshot import HostCopy  # `snapshot` is also a method name in the class below
from forensics.capture.state.source import StateSource
from forensics.core.errors import CaptureError
from forensics.format.shards import LocalShard
from forensics.core.kinds import Policy, StateLayout
from forensics.recipes import HUGGINGFACE_FACTORY
from forensics.core import thirdparty
from forensics.core.thirdparty import zero_dp_group, zero_fragment, zero_linked

log = logging.getLogger(__name__)

MASTER_KEY = "fp32_master"
"""Optimizer-state key holding the fp32 master weight of a bf16/fp16 parameter (absent in fp32 training)."""


class LossScaleView:
    """DeepSpeed's fp16 loss scaler seen through the two things the Guard reads from a GradScaler."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def is_enabled(self) -> bool:
        return True

    @property
    def _scale(self) -> torch.Tensor:
        return torch.tensor(thirdparty.loss_scale(self.optimizer))

    def min_scale(self) -> float:
        scaler = thirdparty.loss_scaler(self.optimizer)
        if scaler is not None and getattr(scaler, "dynamic", True) and hasattr(scaler, "min_scale"):
            return float(scaler.min_scale)
        return 0.0  # a static scale never collapses

    def state_dict(self) -> dict:
        scaler = thirdparty.loss_scaler(self.optimizer)
        state = {"scale": thirdparty.loss_scale(self.optimizer)}
        for name in (
            "dynamic",
            "min_scale",
            "scale_factor",
            "scale_window",
            "cur_hysteresis",
            "delayed_shift",
            "cur_iter",
            "last_overflow_iter",
            "consecutive_hysteresis",
        ):
            value = getattr(scaler, name, None)
            if isinstance(value, (bool, int, float)):
                state[name] = value
        return state


class DeepSpeedState(StateSource):
    """The state of a DeepSpeed engine: ZeRO's flat partitions read by parameter name, its loss scale, its grad norm.

    Args:
        engine: what `deepspeed.initialize` returned first; the rest as for StateSource (the Guard passes them).
    """

    def __init__(self, engine: Any, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.engine = engine
        self.zero_stage = int(engine.zero_optimization_stage())
        self.sharded = self.zero_stage >= 1 or _has_hp_mapping(self.model)
        self.sharded_grad_norm = self.sharded
        self.lp_dtype = next((p.dtype for p in self.model.parameters()), torch.float32)
        basic = _basic(self.optimizer)
        self.integration = {
            "framework": "deepspeed",
            "zero_stage": self.zero_stage,
            "optimizer_class": _class_path(basic),
            "precision": "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32",
        }
        self._warned_no_grads = False

    def grad_norm(self) -> Any:
        """Norm of the (unscaled) gradients this rank holds: its ZeRO shard, or all of them (ZeRO-0)."""
        try:
            tensors = self._shard_grads()
        except Exception:  # an internal layout this version does not know
            log.debug("forensics: reading DeepSpeed gradient shards failed", exc_info=True)
            tensors = None
        if tensors is not None and not tensors and self.sharded:
            return torch.zeros(())  # this rank's shard holds no gradient: it adds nothing to the norm
        if not tensors:
            if not self._warned_no_grads:
                log.warning(
                    "forensics: cannot read gradients from this DeepSpeed optimizer (%s); detection "
                    "uses the loss only and the history's grad_norm is 0",
                    type(self.optimizer).__name__,
                )
                self._warned_no_grads = True
            return 0.0
        squares = torch.stack([torch.linalg.vector_norm(t.detach(), dtype=torch.float32) ** 2 for t in tensors])
        norm = squares.sum().sqrt()
        self.own_norm_unscaled = self.scaler is not None
        if self.scaler is not None:
            norm = norm / thirdparty.loss_scale(self.optimizer)
        return norm

    def _shard_grads(self) -> list[torch.Tensor] | None:
        """The gradient tensors this rank holds before the step; None where their layout is unknown."""
        if self.sharded:
            return thirdparty.zero_gradient_partitions(self.optimizer)
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    # -- state ---------------------------------------------------------------------------------
    def collect(self, copy: snapshot.HostCopy) -> dict:
        """Pre-step weights and optimizer state keyed by parameter name. ZeRO (partitioned state): in the sharded
        layout each rank's own partitions, no communication; in the full layout, gathered (a collective)."""
        if self.sharded and self._zero_layout() is StateLayout.SHARDED:
            self.layout_used = StateLayout.SHARDED
            local = {"model": self._local_weights(), "optimizer": self._optimizer_state(self._local_value)}
            parts, table = sharding.shard_state(
                local, self.ranks.rank, self.ranks.world_size, self.config.dumping.shard_replicas, copy
            )
            return {**parts, "layout": table}
        self.layout_used = StateLayout.FULL
        if not self.sharded:
            if self.optimizer is _basic(self.optimizer) or not thirdparty.fp16_optimizer_masters(self.optimizer)[0]:
                return super().collect(copy)  # ZeRO-0 fp32: DeepSpeed steps the torch optimizer itself
            return {"model": self._full_weights(copy), "optimizer": self._replicated_optimizer_state(copy)}
        return {"model": self._full_weights(copy), "optimizer": self._optimizer_state(self._full_value)}

    def snapshot(self) -> tuple[dict | None, str | None]:
        """DeepSpeed keeps the state in its engine (flat fp32 partitions): no host snapshot; pass a checkpoint."""
        return None, "DeepSpeed's state lives in its engine; pass your checkpoint to --from"

    def _zero_layout(self) -> StateLayout:
        """ZeRO partitions its state: sharded unless DumpConfig.state_layout says "full" (every rank gathers)."""
        numel = sum(math.prod(thirdparty.full_shape(p)) for p in self.model.parameters())
        state_bytes = numel * (torch.tensor([], dtype=self.lp_dtype).element_size() + 12)  # + fp32 master, 2 moments
        ranks = self.ranks
        return sharding.choose_layout(
            StateLayout(self.config.dumping.state_layout),
            ranks.world_size if ranks.multi_rank else 1,
            True,
            state_bytes,
            self.config.dumping.full_state_max_bytes,
        )

    def _local_weights(self) -> dict[str, Any]:
        """This rank's weights: ZeRO-3 partitions as flat shards; replicated weights (ZeRO-1/2) whole (the ranks
        split their writing)."""
        state: dict[str, Any] = {}
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if thirdparty.zero3_partitioned(tensor):
                state[key] = _zero3_shard(tensor, thirdparty.zero3_partition(tensor)[0])
            else:
                state[key] = tensor.detach()
        state.update({name: value for name, value in self.buffers.before().items() if name in state})
        return state

    def _full_weights(self, copy: HostCopy) -> dict[str, torch.Tensor]:
        state, gathered = {}, {}
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if thirdparty.zero3_partitioned(tensor):  # a ZeRO-3 partitioned parameter: gather it (collective)
                if id(tensor) not in gathered:
                    gathered[id(tensor)] = _gather_zero3(tensor)
                state[key] = gathered[id(tensor)]
            else:
                state[key] = copy(tensor)
        state.update({name: copy(value) for name, value in self.buffers.before().items() if name in state})
        return state

    def _full_value(self, param: torch.nn.Parameter, key: str | None) -> torch.Tensor | None:
        """The whole optimizer state `key` (None: the fp32 master) of `param`, gathered (a collective)."""
        value = _full_zero3(param, key) if self.zero_stage == 3 else self._full_hp(param, key)
        return None if value is None else _to_host(value).reshape(thirdparty.full_shape(param))

    def _local_value(self, param: torch.nn.Parameter, key: str | None) -> LocalShard | None:
        """This rank's partition of the optimizer state `key` (None: the fp32 master) of `param`, as a flat shard
        (None when this rank holds none of it). No communication."""
        if self.zero_stage == 3:
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            value = safe_get_local_fp32_param(param) if key is None else safe_get_local_optimizer_state(param, key)
            return None if value is None else _zero3_shard(param, value)
        mapping = zero_fragment(param)
        if mapping is None:  # this rank holds none of it: an empty part keeps the parameter in the state's table
            return LocalShard(torch.zeros(0), tuple(param.shape), (0,), flat=True)
        source, lp = self._hp_source(mapping, key), mapping.lp_fragment_address
        if source is None:
            return None
        return LocalShard(source.detach().reshape(-1).float(), tuple(param.shape), (int(lp.start),), flat=True)

    def _optimizer_state(self, fetch: Callable[[torch.nn.Parameter, str | None], Any]) -> dict:
        """Optimizer state by parameter name; `fetch(param, key)` gives each value (whole, or this rank's part)."""
        optimizer = self.optimizer
        basic = _basic(optimizer)
        names = snapshot.parameter_names(self.model)
        entries = [s for s in basic.state.values() if s]
        # Every rank steps the same groups of flat shards, so whether state exists and its keys agree on
        # all ranks: the collectives below are made by all of them or by none, in the same order.
        keys = (
            sorted(k for k, v in entries[0].items() if isinstance(v, torch.Tensor) and v.dim() > 0) if entries else []
        )
        step = _step_value(entries[0] if entries else {}, basic)
        if self.zero_stage == 3:
            flats = thirdparty.zero3_master_partitions(optimizer)
            keys = [k for k in keys if all(k in basic.state.get(flat, {}) for flat in flats)]
        groups, state = [], {}
        for group_index, params in self._lp_groups():
            group_names = []
            for param in params:
                name = names.get(id(param), f"<unnamed group {group_index}>")
                group_names.append(name)
                entry: dict[str, Any] = {}
                for key in keys:
                    value = fetch(param, key)
                    if value is not None:
                        entry[key] = value
                if entries and self.lp_dtype != torch.float32:
                    master = fetch(param, None)
                    if master is not None:
                        entry[MASTER_KEY] = master
                if entry and step is not None:
                    entry["step"] = torch.tensor(step, dtype=torch.float32)
                if entry:
                    state[name] = entry
            hyper = basic.param_groups[group_index] if group_index < len(basic.param_groups) else {}
            groups.append(
                {
                    **{k: snapshot.plain(v) for k, v in hyper.items() if k not in ("params", "step")},
                    "params": group_names,
                }
            )
        return {"class": _replay_class(basic), "param_groups": groups, "state": state}

    def _full_hp(self, param: torch.nn.Parameter, key: str | None) -> torch.Tensor | None:
        """ZeRO-1/2 (and DeepSpeed's bf16 optimizer): the full fp32 master (key None) or optimizer state
        `key` of one parameter, assembled from the ranks' flat shards with one all-reduce.

        Reads the optimizer's current state rather than DeepSpeed's cached links
        (`safe_get_full_optimizer_state`), which in DeepSpeed 0.19 miss every parameter group but
        the first: they are made when the first group steps, before the others have any state.
        """
        if not zero_linked(param):
            return None
        mapping, group = zero_fragment(param), zero_dp_group(param)
        buffer = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        if mapping is not None:
            source, lp = self._hp_source(mapping, key), mapping.lp_fragment_address
            if source is not None:
                buffer.narrow(0, lp.start, lp.numel).copy_(source.reshape(-1).float())
        torch.distributed.all_reduce(buffer, group=group)
        return buffer.view(param.shape)

    def _hp_source(self, mapping: Any, key: str | None) -> torch.Tensor | None:
        """This rank's fragment of a ZeRO-1/2 parameter (DeepSpeed's `_hp_mapping`): the fp32 master (key None) or
        optimizer state `key`, flat; None when the state has no such key yet."""
        if key is None:
            return mapping.hp_fragment
        hp = mapping.hp_fragment_address
        flat = thirdparty.zero_master_partition(self.optimizer, mapping.param_group_index)
        value = _basic(self.optimizer).state.get(flat, {}).get(key) if flat is not None else None
        return value.narrow(0, hp.start, hp.numel) if isinstance(value, torch.Tensor) else None

    def _replicated_optimizer_state(self, copy: HostCopy) -> dict:
        """ZeRO-0 with bf16/fp16: every rank holds fp32 masters and their optimizer state, unsharded.

        DeepSpeed's unfused wrapper keeps one fp32 master per parameter; the fused one a flat fp32
        buffer per group, laid out in parameter order.
        """
        basic = _basic(self.optimizer)
        names = snapshot.parameter_names(self.model)
        lp_groups, per_param, flats = thirdparty.fp16_optimizer_masters(self.optimizer)
        groups, state = [], {}
        for group_index, params in enumerate(lp_groups):
            offset = 0
            for position, param in enumerate(params):
                if per_param:
                    master = per_param[group_index][position]
                    entries = dict(basic.state.get(master, {}))
                    pieces = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
                else:
                    if flats is None:
                        raise CaptureError(
                            f"DeepSpeed's {type(self.optimizer).__name__} has neither fp32_groups nor "
                            "fp32_groups_flat: this version's fp32 masters cannot be read"
                        )
                    flat = flats[group_index]
                    entries = dict(basic.state.get(flat, {}))
                    numel = param.numel()
                    master = flat.narrow(0, offset, numel).view(param.shape)
                    pieces = {
                        k: v.narrow(0, offset, numel).view(param.shape)
                        for k, v in entries.items()
                        if isinstance(v, torch.Tensor) and v.dim() > 0
                    }
                    offset += numel
                entry = {k: copy(v) for k, v in pieces.items()}
                if entry:
                    entry[MASTER_KEY] = copy(master)
                    step = _step_value(entries, basic)
                    if step is not None:
                        entry["step"] = torch.tensor(step, dtype=torch.float32)
                    state[names.get(id(param), f"<unnamed group {group_index}>")] = entry
            hyper = basic.param_groups[group_index] if group_index < len(basic.param_groups) else {}
            groups.append(
                {
                    **{k: snapshot.plain(v) for k, v in hyper.items() if k not in ("params", "step")},
                    "params": [names.get(id(p), f"<unnamed group {group_index}>") for p in params],
                }
            )
        return {"class": _replay_class(basic), "param_groups": groups, "state": state}

    def _lp_groups(self) -> list[tuple[int, list[torch.nn.Parameter]]]:
        """The model's parameters in each of the user's optimizer groups, in DeepSpeed's order."""
        return thirdparty.zero_param_groups(self.optimizer) or [
            (0, [p for p in self.model.parameters() if p.requires_grad])
        ]

    @property
    def is_collective(self) -> bool:
        return self.sharded and self._zero_layout() is StateLayout.FULL

    @property
    def needs_every_rank(self) -> bool:
        """ZeRO partitions the state: each rank writes its partitions, or all gather them (a collective)."""
        return self.ranks.multi_rank if self.sharded else super().needs_every_rank

    def recipe(self) -> dict:
        recipe = super().recipe()
        if recipe.get("factory") == HUGGINGFACE_FACTORY and self.lp_dtype != torch.float32:
            # DeepSpeed casts the model itself (no autocast): replay must build it in that dtype.
            recipe.setdefault("factory_kwargs", {})["dtype"] = str(self.lp_dtype).removeprefix("torch.")
        return recipe


class DeepSpeedGuard(DistributedGuard):
    """Watches a DeepSpeed engine; on NaN/Inf or a spike every rank dumps the full pre-step state.

    Call `check()` after `engine.backward(loss)` and before `engine.step()` on every micro-batch (it does
    nothing until the accumulation boundary), or pass `hook_step=True` to have `engine.step()` run it
    (needed where the framework calls `engine.step()` for you, e.g. Accelerate); explicit `check()`
    calls are then no-ops.

    Args:
        engine: what `deepspeed.initialize` returned first.
        config: GuardConfig. Filled in from the engine when left at their defaults: `loss_divisor`
            (gradient_accumulation_steps), `max_grad_norm` (gradient_clipping), `min_loss_scale` (fp16).
        loss_fn: `(model, batch) -> loss`, as for Guard.
        hook_step: wrap `engine.step` so that it calls `check()` first; `close()` unwraps it.
    Example:
        >>> engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())  # doctest: +SKIP
        >>> guard = DeepSpeedGuard(engine, config=GuardConfig(dump_dir="dumps"))                           # doctest: +SKIP
        >>> for batch in loader:                                                                              # doctest: +SKIP
        ...     guard.record_batch(batch)
        ...     loss = engine(**inputs).loss; guard.record_loss(loss)
        ...     engine.backward(loss)
        ...     guard.check()
        ...     engine.step()

    The 'skip' policy cannot stop `engine.step()`; DeepSpeed itself skips steps whose gradient norm is
    non-finite in fp16 and fp32 (and in bf16 with `"check_grad_overflow": true` in zero_optimization).
    """

    def __init__(
        self,
        engine: Any,
        *,
        config: GuardConfig | None = None,
        loss_fn: Callable | None = None,
        hook_step: bool = False,
    ):
        self.engine = engine
        self.zero_stage = int(engine.zero_optimization_stage())
        optimizer = engine.optimizer
        scaler = LossScaleView(optimizer) if engine.fp16_enabled() else None
        config = config or GuardConfig()
        defaults = GuardConfig()
        changes: dict[str, Any] = {}
        if config.detection.loss_divisor is None:
            changes["loss_divisor"] = float(engine.gradient_accumulation_steps())
        if config.detection.max_grad_norm is None and engine.gradient_clipping():
            changes["max_grad_norm"] = float(engine.gradient_clipping())
        if scaler is not None and config.detection.min_loss_scale == defaults.detection.min_loss_scale:
            changes["min_loss_scale"] = scaler.min_scale()
        if config.detection.verify_update:
            log.warning(
                "forensics: verify_update is not supported under DeepSpeed (its optimizer steps flat "
                "shards); it is turned off"
            )
            changes["verify_update"] = False
        if config.dumping.recheck and self.zero_stage == 3:
            log.warning("forensics: recheck is off under ZeRO-3: a forward on one rank alone would hang")
            changes["recheck"] = False
        if config.detection.on_nonfinite == Policy.SKIP:
            log.warning(
                "forensics: the 'skip' policy cannot stop engine.step() under DeepSpeed; faults are "
                "dumped and training goes on"
            )
        config = config.replace(**changes)
        super().__init__(
            engine.module,
            optimizer,
            getattr(engine, "lr_scheduler", None),
            scaler,
            config=config,
            loss_fn=loss_fn,
            state=functools.partial(DeepSpeedState, engine),
        )
        self._in_step_hook = False
        self._unhook_step = thirdparty.call_before(engine, "step", self._check_in_step) if hook_step else None

    # -- adapter hooks (forensics.capture.guard.Guard) ---------------------------------------------------
    def at_step_boundary(self) -> bool:
        """At DeepSpeed's accumulation boundary; when hooked into engine.step(), only from inside that call."""
        if self._unhook_step is not None and not self._in_step_hook:
            return False  # hooked: engine.step() runs the check itself, at the right moment
        return bool(self.engine.is_gradient_accumulation_boundary())

    def step_number(self) -> int | None:
        return int(self.engine.global_steps)

    # -- engine.step hook ------------------------------------------------------------------------
    def _check_in_step(self) -> None:
        self._in_step_hook = True
        try:
            self.check()
        finally:
            self._in_step_hook = False

    def close(self, timeout: float | None = None) -> None:
        if self._unhook_step is not None:
            self._unhook_step()  # engine.step is DeepSpeed's own again
            self._unhook_step = None
        super().close(timeout)


def _basic(optimizer: Any) -> Any:
    """The torch optimizer DeepSpeed's wrapper steps (its `optimizer`), or the optimizer itself."""
    return getattr(optimizer, "optimizer", optimizer)


def _has_hp_mapping(model: torch.nn.Module) -> bool:
    return any(zero_fragment(p) is not None or thirdparty.zero3_partitioned(p) for p in model.parameters())


def _full_zero3(param: torch.nn.Parameter, key: str | None) -> torch.Tensor | None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)


def _zero3_shard(param: Any, local: torch.Tensor) -> LocalShard:
    """A ZeRO-3 partition (`local`: this rank's flat, padded slice of the flattened parameter) as a flat shard
    (empty when the partition is all padding)."""
    _, numel, _, group = thirdparty.zero3_partition(param)
    partition = local.numel()
    start = torch.distributed.get_rank(group=group) * partition
    valid = max(0, min(partition, numel - start))
    return LocalShard(local.detach().reshape(-1)[:valid], tuple(thirdparty.full_shape(param)), (start,), flat=True)


def _gather_zero3(param: Any) -> torch.Tensor:
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.data.detach().to("cpu", copy=True)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _step_value(entry: dict, basic: Any) -> float | None:
    value = entry.get("step")
    if value is None:  # DeepSpeed's FusedAdam keeps the step count per group
        value = next((g.get("step") for g in basic.param_groups if g.get("step") is not None), None)
    if isinstance(value, torch.Tensor):
        value = value.item()
    return None if value is None else float(value)


def _class_path(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _replay_class(basic: Any) -> str:
    """The torch optimizer a one-GPU replay rebuilds: DeepSpeed's Adam kernels do torch's Adam / AdamW math."""
    path = _class_path(basic)
    if path.startswith("deepspeed.ops.adam."):
        decoupled = getattr(basic, "adam_w_mode", getattr(basic, "adamw_mode", True))
        return "torch.optim.adamw.AdamW" if decoupled else "torch.optim.adam.Adam"
    return path
