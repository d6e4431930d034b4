"""Optimizer snapshots: the pre-step optimizer as class + groups + state keyed by parameter NAME, rebuilt fresh on demand.

DeepSpeed bf16/fp16 dumps add an `fp32_master` entry (the fp32 master weight) to each parameter's
state (docs/INTEGRATIONS.md). It is not optimizer state a torch optimizer knows: it is set aside in
`OptimizerSnapshot.masters` and never handed to `load_state_dict` (which would cast it to the
parameter's dtype and carry it along unused). The replay model keeps the dtype the job's forward used
(the dump's weights, e.g. bf16, and the recipe's `dtype`), so forward and backward match the job; the
optimizer check (`forensics.replay.localize.update.localize_optimizer`) steps that model's dtype, an
approximation of DeepSpeed's fp32 master update.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from forensics.core.errors import ReplayError
from forensics.core.thirdparty import defer_dynamo_import

logger = logging.getLogger(__name__)

READ_AHEAD = 1
"""Parameters whose optimizer state DumpOptimizerState.read_ahead holds at most (the largest is a few GB)."""

MASTER_KEY = "fp32_master"
"""Per-parameter optimizer-state key of DeepSpeed's fp32 master weight (capture/integrations/deepspeed.py)."""


class DumpOptimizerState(Mapping):
    """A dump's optimizer state by parameter name, read one parameter at a time when asked (never all at once),
    onto `device`; `read_ahead(name)` starts reading a parameter's state on a background thread, so stepping one
    parameter overlaps reading the next (a 7B model's AdamW moments are 54 GB)."""

    def __init__(self, dump: Any, scalars: dict[str, dict], device: str | torch.device = "cpu"):
        self.dump = dump
        self.scalars = scalars
        self.device = device
        self.names = list(dict.fromkeys([*scalars, *dump.optimizer_shapes()]))
        self._known, self._with_tensors = set(self.names), set(dump.optimizer_shapes())
        self._ahead: dict[str, Future] = {}
        self._reader: ThreadPoolExecutor | None = None

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensors to answer
        return name in self._known

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self._known:
            raise KeyError(name)
        ahead = self._ahead.pop(name, None)
        tensors = ahead.result() if ahead is not None else self.dump.optimizer_tensors(name, self.device)
        return {**self.scalars.get(name, {}), **tensors}

    def read_ahead(self, name: str) -> None:
        """Starts reading `name`'s tensors (the next `[name]` takes them); READ_AHEAD parameters at most are held."""
        if name in self._ahead or name not in self._with_tensors or len(self._ahead) >= READ_AHEAD:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forensics-optimizer-read")
        self._ahead[name] = self._reader.submit(self.dump.optimizer_tensors, name, self.device)

    def drop_read_ahead(self) -> None:
        """Forgets what was read ahead and not taken (an optimizer check that stopped early)."""
        ahead, self._ahead = self._ahead, {}
        for future in ahead.values():
            future.cancel()
        for future in ahead.values():
            if not future.cancelled():
                future.exception()  # waits; a read that failed here is read again, and fails, when asked for

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def shapes(self) -> dict[str, dict[str, list[int]]]:
        return self.dump.optimizer_shapes()


class _WithoutMasters(Mapping):
    """A state mapping seen without the fp32_master entries (module docstring)."""

    def __init__(self, raw: Mapping):
        self.raw = raw

    def __contains__(self, name: object) -> bool:
        return name in self.raw

    def __getitem__(self, name: str) -> dict[str, Any]:
        return {k: v for k, v in self.raw[name].items() if k != MASTER_KEY}

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


@dataclass
class OptimizerSnapshot:
    """The pre-step optimizer, keyed by parameter name (docs/DUMP_FORMAT.md 'Optimizer state').

    `build(model)` returns a NEW optimizer over `model`'s parameters holding a copy of the pre-step state, so
    stepping it never changes the snapshot; `build(model, names)` one over those parameters only (the replay
    steps the optimizer a parameter at a time, holding one parameter's state at a time). `state` may be a
    lazy mapping (DumpOptimizerState): entries are read when a parameter is built.
    """

    cls: type
    param_groups: list[dict]  # hyper-parameters + "params": [parameter names]
    state: Mapping[str, dict[str, Any]]  # name -> {key: tensor | number}

    def __post_init__(self) -> None:
        self._raw = self.state
        self.state = _WithoutMasters(self.state)

    @property
    def masters(self) -> dict[str, torch.Tensor]:
        """name -> fp32 master weight (DeepSpeed bf16/fp16 dumps), kept out of `state` (module docstring)."""
        masters = {}
        for name in self._raw:
            master = self._raw[name].get(MASTER_KEY)
            if isinstance(master, torch.Tensor):
                masters[name] = master
        return masters

    @property
    def class_path(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def build(
        self,
        model: torch.nn.Module | Mapping[str, torch.nn.Parameter],
        names: list[str] | None = None,
        hyper: dict[str, Any] | None = None,
    ) -> torch.optim.Optimizer:
        """`model`: the module whose parameters the optimizer steps, or {name: parameter} (stand-ins of the
        module's parameters: forensics.replay.localize.update steps copies). `hyper`: hyper-parameters to change in every
        group (a counterfactual: {"lr": ...}, {"eps": 1e-8})."""
        named = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else dict(model)
        wanted = set(named) if names is None else set(names)
        groups, saved_groups, saved_state, index = [], [], {}, 0
        for group in self.param_groups:
            members = [n for n in group["params"] if n in named and n in wanted]
            if names is not None and not members:
                continue
            settings = {k: _hyper_value(v) for k, v in group.items() if k not in ("params", "param_names")}
            settings.update(hyper or {})
            groups.append({**settings, "params": [named[n] for n in members]})
            ids = []
            for name in members:
                if name in self.state:  # a dump's state is read afresh for each build: no copy needed
                    fresh = isinstance(self._raw, DumpOptimizerState)
                    saved_state[index] = {
                        k: (v.clone() if isinstance(v, torch.Tensor) and not fresh else v)
                        for k, v in self.state[name].items()
                    }
                ids.append(index)
                index += 1
            saved_groups.append({**settings, "params": ids})
        optimizer = self._construct(groups, saved_groups)
        optimizer.load_state_dict({"state": saved_state, "param_groups": saved_groups})
        return optimizer

    def _construct(self, groups: list[dict], saved_groups: list[dict]) -> torch.optim.Optimizer:
        defer_dynamo_import(self.cls)  # an optimizer's first add_param_group would import torch._dynamo (~1 s)
        try:
            return self.cls(groups)
        except TypeError:  # optimizers whose constructor insists on an explicit lr
            return self.cls(groups, lr=groups[0].get("lr", 1e-3))
        except RuntimeError as exc:  # e.g. fused=True recorded on CUDA, replaying on CPU
            logger.warning(
                "rebuilding %s as recorded failed (%s); retrying without fused/foreach", self.class_path, exc
            )
            for group in groups + saved_groups:
                group.pop("fused", None)
                group.pop("foreach", None)
            return self.cls(groups)

    def check(self, model: torch.nn.Module) -> None:
        """Fails now, with a clear error, when this state cannot rebuild the optimizer for `model` — without
        copying any state (build() copies it; the replay builds the optimizer only for its optimizer check):
        every per-parameter state tensor must have its parameter's shape (read from the file's header: no
        tensor is read), and the class must accept the hyper-parameters (tried on a one-element stand-in).

        Raises:
            ValueError / TypeError / RuntimeError: what is wrong.
        """
        named = dict(model.named_parameters())
        shapes = (
            self._raw.shapes()
            if isinstance(self._raw, DumpOptimizerState)
            else {
                name: {k: list(v.shape) for k, v in entries.items() if isinstance(v, torch.Tensor)}
                for name, entries in self._raw.items()
            }
        )
        for name, entries in shapes.items():
            param = named.get(name)
            if param is None:
                continue
            for key, shape in entries.items():
                if key != MASTER_KEY and len(shape) > 0 and tuple(shape) != tuple(param.shape):
                    raise ValueError(
                        f"optimizer state {key} of {name} has shape {tuple(shape)}, the parameter {tuple(param.shape)}"
                    )
        groups = [
            {
                **{k: _hyper_value(v) for k, v in group.items() if k not in ("params", "param_names")},
                "params": [torch.nn.Parameter(torch.zeros(1))],
            }
            for group in self.param_groups
        ]
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
                    state[names[id(p)]] = {
                        k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in optimizer.state[p].items()
                    }
            groups.append({**hyper, "params": group_names})
        return cls(type(optimizer), groups, state)

    def read_ahead(self, name: str) -> None:
        """Starts reading parameter `name`'s state in the background, when it comes from a dump (a later build of
        it takes it); nothing for a state in memory."""
        if isinstance(self._raw, DumpOptimizerState):
            self._raw.read_ahead(name)

    def drop_read_ahead(self) -> None:
        if isinstance(self._raw, DumpOptimizerState):
            self._raw.drop_read_ahead()

    def hyper_of(self, name: str) -> dict:
        """Hyper-parameters of the group holding parameter `name` ({} when none does)."""
        for group in self.param_groups:
            if name in group["params"]:
                return {k: v for k, v in group.items() if k != "params"}
        return {}


def _hyper_value(value: Any) -> Any:
    # JSON turns tuples (Adam's betas) into lists; optimizers expect tuples.
    return tuple(value) if isinstance(value, list) else value


__all__ = ["DumpOptimizerState", "OptimizerSnapshot", "MASTER_KEY"]
