"""FSDP2's mixed precision on one device: the step computed in the dtypes the job computed in.

FSDP2 (`fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...))`) keeps fp32
sharded parameters and, for each unit's forward and backward, casts the gathered parameters to `param_dtype`,
casts the unit's floating-point inputs to it (`cast_forward_inputs`), optionally its output to `output_dtype`,
and reduces the gradients in `reduce_dtype` onto the fp32 parameters. That is not autocast, and a replay in the
parameters' fp32 computes other numbers (a bf16-only failure would not reproduce). The Guard records each
unit's policy (manifest `precision.fsdp`); `fsdp_compute(model, units)` does the same on one device: every
parameter in the `param_dtype` of the innermost unit holding it, the units' input / output casts as forward
hooks, and on exit the fp32 parameters back with their gradients cast through `reduce_dtype`. One rank's
gradients are not reduced with the other ranks' (a one-rank replay cannot), so the losses match the job's
where the kernels are the same, the gradients only approximately.

Module names come from the dump: they are only looked up among the replay model's own modules.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from forensics.format.batch_tree import map_tensors
from forensics.replay.load.environment import dtype_from_name


@dataclass(frozen=True)
class FsdpUnit:
    """One `fully_shard` unit of the job and its mixed-precision policy."""

    module: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool

    @property
    def depth(self) -> int:
        return 0 if not self.module else self.module.count(".") + 1


def parse_units(rows: Any) -> list[FsdpUnit]:
    """The manifest's `precision.fsdp` (checked by forensics/format/manifest.py) as FsdpUnits."""

    def dtype(name: Any) -> torch.dtype | None:
        return dtype_from_name(name) if name else None

    return [
        FsdpUnit(
            str(row["module"]),
            dtype(row.get("param_dtype")),
            dtype(row.get("reduce_dtype")),
            dtype(row.get("output_dtype")),
            bool(row.get("cast_forward_inputs", True)),
        )
        for row in rows or []
    ]


def compute_dtype(units: list[FsdpUnit]) -> torch.dtype | None:
    """The lowest-precision param_dtype of the units (what 'ran under FSDP2 bf16' means), or None."""
    dtypes = [u.param_dtype for u in units if u.param_dtype is not None and u.param_dtype != torch.float32]
    return min(dtypes, key=lambda d: torch.finfo(d).bits) if dtypes else None


def _known(model: torch.nn.Module, units: list[FsdpUnit]) -> list[tuple[torch.nn.Module, FsdpUnit]]:
    modules = dict(model.named_modules())
    return sorted(((modules[u.module], u) for u in units if u.module in modules), key=lambda mu: mu[1].depth)


def parameter_units(model: torch.nn.Module, units: list[FsdpUnit]) -> dict[int, FsdpUnit]:
    """{id(parameter): the innermost unit holding it}."""
    owner: dict[int, FsdpUnit] = {}
    for module, unit in _known(model, units):  # deeper units last: a parameter belongs to the innermost unit
        for param in module.parameters():
            owner[id(param)] = unit
    return owner


@contextlib.contextmanager
def fsdp_compute(
    model: torch.nn.Module, units: list[FsdpUnit], skip: set[int] | frozenset[int] = frozenset()
) -> Iterator[None]:
    """Within: the model computes as the job's FSDP2 units did; on exit, parameters and gradients in the
    parameters' own dtype again. `skip`: ids of parameters cast by the caller (a streamed replay's blocks, cast as
    they are materialised: replay/run/streamed_runner.py)."""
    known = _known(model, units)
    owner = parameter_units(model, units)
    cast: list[tuple[torch.nn.Parameter, torch.Tensor, FsdpUnit]] = []
    hooks = []
    try:
        for param in model.parameters():
            unit = owner.get(id(param)) if id(param) not in skip else None
            if (
                unit is not None
                and unit.param_dtype is not None
                and param.is_floating_point()
                and param.dtype != unit.param_dtype
            ):
                cast.append((param, param.data, unit))
                param.data = param.data.to(unit.param_dtype)
        for module, unit in known:
            if unit.cast_forward_inputs and unit.param_dtype is not None:
                hooks.append(
                    module.register_forward_pre_hook(
                        functools.partial(_cast_inputs, unit.param_dtype), with_kwargs=True
                    )
                )
            if unit.output_dtype is not None:
                hooks.append(module.register_forward_hook(functools.partial(_cast_output, unit.output_dtype)))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for param, master, unit in cast:
            grad = param.grad
            param.data = master
            param.grad = None if grad is None else grad.to(unit.reduce_dtype or master.dtype).to(master.dtype)


def _cast(dtype: torch.dtype, value: Any) -> Any:
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _cast_inputs(dtype: torch.dtype, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return _cast(dtype, args), _cast(dtype, kwargs)


def _cast_output(dtype: torch.dtype, module: torch.nn.Module, args: Any, output: Any) -> Any:
    return _cast(dtype, output)
