"""Fault injection, to prove that the silent-corruption checks catch what they claim (Megatron's
`error_injection_rate` is the reference): flip one bit in, or zero, one module's output, one gradient or one weight,
on a chosen rank, at a chosen step or at random with a rate.

Configured by `SilentConfig(inject=FaultSpec(...))`, or by the environment (`FORENSICS_SILENT_INJECT`, read when
the Guard starts, so a job is proved without editing it):

    FORENSICS_SILENT_INJECT="target=output:blocks.3.mlp,rank=1,step=40,bit=2"

Keys: `target` (`output:<module name>`, `grad:<parameter name>` or `weight:<parameter name>`; '' for the model's own
output), `rank`, `step`, `rate` (instead of `step`: a fault at each step with this probability, from a generator
seeded by `seed`), `mode` (`flip` or `zero`), `bit` (0 = the lowest mantissa bit: a flip that makes no NaN and no
spike), `element` (the flat index of the value hit) and `stuck` (1: the fault repeats at every call from `step` on,
the Guard's recompute included — a deterministic stuck-at fault; 0: it hits the step's first call only, the job's own
computation — a transient).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, fields
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV = "FORENSICS_SILENT_INJECT"
TARGETS = ("output", "grad", "weight")
MODES = ("flip", "zero")


@dataclass(frozen=True)
class FaultSpec:
    """One injected fault (module docstring)."""

    target: str
    """`output:<module name>`, `grad:<parameter name>` or `weight:<parameter name>`."""
    rank: int = 0
    """The rank whose computation is hit."""
    step: int | None = None
    """The Guard's step at which it is hit (the first, with `stuck`); None: at random, with `rate`."""
    rate: float = 0.0
    """With no `step`: the probability that a step is hit."""
    mode: str = "flip"
    """`flip` one bit, or `zero` the value."""
    bit: int = 0
    """The bit flipped, 0 = the lowest (a low mantissa bit of a float: no NaN, no spike)."""
    element: int = 0
    """The flat index of the value hit (modulo the tensor's size)."""
    stuck: bool = False
    """Hit at every call from `step` on (the recompute too); else only the step's first call."""
    seed: int = 0
    """Seeds the generator that `rate` draws from."""

    def __post_init__(self):
        kind, _, _ = self.target.partition(":")
        if kind not in TARGETS or ":" not in self.target:
            raise ValueError(
                f"FaultSpec.target must be output:<module>, grad:<parameter> or weight:<parameter>, got {self.target!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"FaultSpec.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.step is None and not 0 < self.rate <= 1:
            raise ValueError("FaultSpec needs a step, or a rate in (0, 1]")
        if self.bit < 0 or self.element < 0 or self.rank < 0:
            raise ValueError("FaultSpec needs bit >= 0, element >= 0 and rank >= 0")

    @property
    def kind(self) -> str:
        return self.target.partition(":")[0]

    @property
    def name(self) -> str:
        return self.target.partition(":")[2]

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """`key=value,key=value` (the environment variable's form) as a FaultSpec; ValueError names a bad key."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key not in known:
                raise ValueError(f"{ENV}: unknown key {key!r}; known: {', '.join(known)}")
            if key in ("target", "mode"):
                values[key] = value
            elif key == "rate":
                values[key] = float(value)
            elif key == "stuck":
                values[key] = value.lower() in ("1", "true", "yes")
            else:
                values[key] = int(value)
        if "target" not in values:
            raise ValueError(f"{ENV} needs target=output:<module> (or grad:/weight:<parameter>)")
        return cls(**values)

    @classmethod
    def from_environment(cls) -> "FaultSpec | None":
        text = os.environ.get(ENV, "").strip()
        return cls.parse(text) if text else None


def corrupt(tensor: torch.Tensor, spec: FaultSpec) -> torch.Tensor:
    """A copy of `tensor` with one element's bit `spec.bit` flipped (or the element zeroed)."""
    out = tensor.detach().clone()
    flat = out.view(-1)
    index = spec.element % max(flat.numel(), 1)
    if spec.mode == "zero":
        flat[index] = 0
        return out
    if flat.is_floating_point():
        ints = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
        ints[index] ^= 1 << min(spec.bit, 8 * flat.element_size() - 2)
    else:
        flat[index] ^= 1 << spec.bit
    return out


def _keeping_graph(output: torch.Tensor, spec: FaultSpec) -> torch.Tensor:
    """`output` corrupted, gradients still flowing through it: output + (corrupted - output), exact in floating point
    (the two differ in one element by one bit or by the whole value: Sterbenz's lemma makes both differences exact)."""
    return output + (corrupt(output, spec) - output.detach())


class Injector:
    """Applies a FaultSpec on its rank: a forward hook (output), a gradient hook (grad) or an in-place change of the
    weight at the start of the step (weight). `begin_step(step)` is called by the Guard's silent check when a step's
    first micro-batch is recorded. `injected` lists the steps hit."""

    def __init__(self, model: torch.nn.Module, spec: FaultSpec, rank: int, add_hook: Any):
        self.spec, self.active, self.calls = spec, False, 0
        self.injected: list[int] = []
        self.step: int | None = None
        self._random = random.Random(spec.seed)
        self._param: torch.nn.Parameter | None = None
        if rank != spec.rank:
            return
        if spec.kind == "output":
            modules = dict(model.named_modules())
            module = modules.get(spec.name) if spec.name else model
            if module is None:
                raise ValueError(f"FaultSpec: the model has no module {spec.name!r}")
            add_hook(module.register_forward_hook(self._output))
        else:
            params = dict(model.named_parameters())
            if spec.name not in params:
                raise ValueError(f"FaultSpec: the model has no parameter {spec.name!r}")
            self._param = params[spec.name]
            if spec.kind == "grad":
                add_hook(self._param.register_hook(self._grad))
        log.warning("forensics: fault injection armed on rank %d: %s", rank, spec)

    def begin_step(self, step: int) -> None:
        """A new step starts (its first micro-batch was recorded): decide whether it is hit."""
        spec, self.step, self.calls = self.spec, step, 0
        if spec.step is not None:
            self.active = step >= spec.step if spec.stuck else step == spec.step
        else:
            self.active = self._random.random() < spec.rate
        if self.active and spec.kind == "weight" and self._param is not None:
            with torch.no_grad():
                self._param.copy_(corrupt(self._param, spec))
            self._hit()

    def _hits_now(self) -> bool:
        self.calls += 1
        return self.active and (self.spec.stuck or self.calls == 1)

    def _hit(self) -> None:
        if self.step is not None and (not self.injected or self.injected[-1] != self.step):
            self.injected.append(self.step)

    def _output(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not self._hits_now():
            return None
        self._hit()
        if isinstance(output, torch.Tensor):
            return _keeping_graph(output, self.spec)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (_keeping_graph(output[0], self.spec), *output[1:])
        return None

    def _grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if not self._hits_now():
            return None
        self._hit()
        return corrupt(grad, self.spec)
