"""Optimizer snapshots: the pre-step optimizer as class + groups + state keyed by parameter NAME, rebuilt fresh on demand.

DeepSpeed bf16/fp16 dumps add an `fp32_master` entry (the fp32 master weight) to each parameter's
state (docs/INTEGRATIONS.md). It is not optimizer state a torch optimizer knows: it is set aside in
`OptimizerSnapshot.masters` and never handed to `load_state_dict` (which would cast it to the
parameter's dtype and carry it along unused). The replay model keeps the dtype the job's forward used
(the dump's weights, e.g. bf16, and the recipe's `dtype`), so forward and backward match the job; the
optimizer check (`replay.localize_update.localize_optimizer`) steps that model's dtype, an
approximation of DeepSpeed's fp32 master update.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from forensics.errors import ReplayError

logger = logging.getLogger(__name__)

MASTER_KEY = "fp32_master"
"""Per-parameter optimizer-state key of DeepSpeed's fp32 master weight (capture/integrations/deepspeed.py)."""


@dataclass
class OptimizerSnapshot:
    """The pre-step optimizer, keyed by parameter name (docs/DUMP_FORMAT.md 'Optimizer state').

    `build(model)` returns a NEW optimizer over `model`'s parameters holding a deep copy of the
    pre-step state, so stepping it never changes the snapshot.
    """

    cls: type
    param_groups: list[dict]  # hyper-parameters + "params": [parameter names]
    state: dict[str, dict[str, Any]]  # name -> {key: tensor | number}
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> fp32 master weight (DeepSpeed bf16/fp16 dumps), taken out of `state` (module docstring)."""

    def __post_init__(self) -> None:
        state = {}
        for name, entries in self.state.items():
            entries = dict(entries)
            master = entries.pop(MASTER_KEY, None)
            if isinstance(master, torch.Tensor):
                self.masters.setdefault(name, master)
            state[name] = entries
        self.state = state
        if self.masters:
            logger.info("optimizer state holds fp32 master weights for %d parameters; the replay keeps the "
                        "dtype the forward used and does not load them into %s", len(self.masters),
                        self.class_path)

    @property
    def class_path(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        named = dict(model.named_parameters())
        groups, saved_groups, saved_state, index = [], [], {}, 0
        for group in self.param_groups:
            names = [n for n in group["params"] if n in named]
            hyper = {k: _hyper_value(v) for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": [named[n] for n in names]})
            ids = []
            for name in names:
                if name in self.state:
                    saved_state[index] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                          for k, v in self.state[name].items()}
                ids.append(index)
                index += 1
            saved_groups.append({**hyper, "params": ids})
        optimizer = self._construct(groups, saved_groups)
        optimizer.load_state_dict({"state": saved_state, "param_groups": saved_groups})
        return optimizer

    def _construct(self, groups: list[dict], saved_groups: list[dict]) -> torch.optim.Optimizer:
        try:
            return self.cls(groups)
        except TypeError:  # optimizers whose constructor insists on an explicit lr
            return self.cls(groups, lr=groups[0].get("lr", 1e-3))
        except RuntimeError as exc:  # e.g. fused=True recorded on CUDA, replaying on CPU
            logger.warning("rebuilding %s as recorded failed (%s); retrying without fused/foreach",
                           self.class_path, exc)
            for group in groups + saved_groups:
                group.pop("fused", None)
                group.pop("foreach", None)
            return self.cls(groups)

    def check(self, model: torch.nn.Module) -> None:
        """Fails now, with a clear error, when this state cannot rebuild the optimizer for `model` — without
        copying any state (build() copies it; the replay builds the optimizer only for its optimizer check):
        every per-parameter state tensor must have its parameter's shape, and the class must accept the
        hyper-parameters (tried on a one-element stand-in parameter).

        Raises:
            ValueError / TypeError / RuntimeError: what is wrong.
        """
        named = dict(model.named_parameters())
        for name, entries in self.state.items():
            param = named.get(name)
            if param is None:
                continue
            for key, value in entries.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"optimizer state {key} of {name} has shape {tuple(value.shape)}, the "
                                     f"parameter {tuple(param.shape)}")
        groups = [{**{k: _hyper_value(v) for k, v in group.items() if k not in ("params", "param_names")},
                   "params": [torch.nn.Parameter(torch.zeros(1))]} for group in self.param_groups]
        self._construct(groups, [dict(g) for g in groups])

    @classmethod
    def from_live(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> "OptimizerSnapshot":
        """Snapshot of a live optimizer (deep copy), naming its parameters through `model`."""
        names = {id(p): n for n, p in model.named_parameters()}
        groups, state = [], {}
        for group in optimizer.param_groups:
            hyper = {k: copy.deepcopy(v) for k, v in group.items() if k not in ("params", "param_names")}
            group_names = []
            for p in group["params"]:
                if id(p) not in names:
                    raise ReplayError("the optimizer holds a parameter that is not in the model")
                group_names.append(names[id(p)])
                if p in optimizer.state and optimizer.state[p]:
                    state[names[id(p)]] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                           for k, v in optimizer.state[p].items()}
            groups.append({**hyper, "params": group_names})
        return cls(type(optimizer), groups, state)

    def hyper_of(self, name: str) -> dict:
        """Hyper-parameters of the group holding parameter `name` ({} when none does)."""
        for group in self.param_groups:
            if name in group["params"]:
                return {k: v for k, v in group.items() if k != "params"}
        return {}


def _hyper_value(value: Any) -> Any:
    # JSON turns tuples (Adam's betas) into lists; optimizers expect tuples.
    return tuple(value) if isinstance(value, list) else value



__all__ = ["OptimizerSnapshot", "MASTER_KEY"]
