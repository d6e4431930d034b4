"""Localise the update and the layers: which parameter a (fresh copy of the) optimizer step breaks and why; per-layer statistics.

* Optimizer (`localize_optimizer`): steps a fresh copy of the pre-step optimizer on the replayed
  gradients, one parameter at a time (so one parameter's optimizer state is in memory at a time), and
  explains each parameter the update makes non-finite (`explain_update`).
* Spikes (`per_layer_stats`, `LayerWatch`): gradient norm and output abs-max per module.

Forward and backward localisation are in replay/localize/forward_backward.py.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, TypedDict

import torch

from forensics.core.kinds import Phase
from forensics.replay.localize.forward_backward import ModuleTracker, float_tensors, module_label
from forensics.replay.run.execute import SampleRef, StepRunner, all_finite, any_nonfinite
from forensics.replay.run.update_size import relative_change

logger = logging.getLogger(__name__)


@dataclass
class OptimizerFinding:
    """Parameters a (fresh copy of the) optimizer step makes non-finite, and why."""

    parameters: list[str]
    """Finite before the step, non-finite after, in named_parameters() order."""
    parameter: str | None
    optimizer_state: str | None
    """Why, in words, for `parameter` (e.g. "exp_avg_sq is 0 and eps is 0: 0/0")."""
    explanations: dict[str, str] = field(default_factory=dict)
    optimizer_class: str | None = None
    phase: Phase = Phase.OPTIMIZER


def localize_optimizer(runner: StepRunner, samples: list[SampleRef] | None = None) -> OptimizerFinding | None:
    """Replays the step, then steps a fresh copy of the pre-step optimizer on the replayed gradients.

    Returns:
        OptimizerFinding when the update makes a finite parameter non-finite; None when it does not,
        when the gradients are already non-finite (not the optimizer's doing), or without optimizer.
    """
    session = runner.session
    if session.optimizer is None:
        return None
    with runner.keeping_gradients():
        result = runner.run(samples, keep_grads=True)
    try:
        if not (result.loss_finite and result.grads_finite):
            return None
        snapshot = session.optimizer
        broken, explanations = [], {}
        try:
            for step in step_each_parameter(runner.model, snapshot, runner=runner):
                if step.broke:
                    broken.append(step.name)
                    explanations[step.name] = explain_update(
                        step.name,
                        step.param.grad,
                        step.pre_state(),
                        dict(step.optimizer.state.get(step.param, {})),
                        snapshot.hyper_of(step.name),
                    )
        except Exception as exc:  # noqa: BLE001 - e.g. LBFGS wants a closure; the check is an extra
            logger.warning(
                "could not step a copy of %s on the replayed gradients (%s: %s); skipping the optimizer check",
                snapshot.class_path,
                type(exc).__name__,
                exc,
            )
            return None
        if not broken:
            return None
        first = broken[0]
        return OptimizerFinding(
            parameters=broken,
            parameter=first,
            optimizer_state=explanations[first],
            explanations=explanations,
            optimizer_class=snapshot.class_path,
        )
    finally:
        runner.reset()


@dataclass
class ParameterStep:
    """One parameter stepped by a fresh copy of the pre-step optimizer (step_each_parameter)."""

    name: str
    param: torch.nn.Parameter
    """A copy of the model's parameter, stepped (the model's own is untouched), its `grad` the model's."""
    snapshot: Any
    """The pre-step optimizer (OptimizerSnapshot) the step was built from."""
    optimizer: torch.optim.Optimizer
    broke: bool
    """Finite before the update, non-finite after."""
    moved_sq: float
    """|update|^2 (squared L2 norm of the change of this parameter)."""
    size_sq: float
    """|weight|^2 before the update."""

    def pre_state(self) -> dict:
        """Its optimizer state before the step, read again from the snapshot (kept by nobody while stepping: the
        largest parameter's AdamW moments are a GB on the device)."""
        return dict(self.snapshot.state[self.name]) if self.name in self.snapshot.state else {}

    @property
    def relative_change(self) -> float:
        """|update| / |weight|."""
        return relative_change(self.moved_sq, self.size_sq)


def step_each_parameter(
    model: torch.nn.Module, snapshot: Any, hyper: dict | None = None, *, runner: StepRunner | None = None
) -> Iterator[ParameterStep]:
    """Steps a fresh copy of the pre-step optimizer (with `hyper` changed, if given) on the model's current
    gradients, one parameter at a time, so only one parameter's optimizer state is in memory at a time (and the
    next one's, read ahead). Elementwise and per-tensor optimizers (Adam, AdamW, SGD, Adagrad, ...) update each
    parameter independently, so this is the whole step's update. Each step moves a copy of the parameter (the
    yielded `param`): the model's weights stay the pre-step ones, so the replay need not re-read them. With
    `runner`, the parameters and their gradients come from `runner.gradients()` (a streamed replay's blocks
    materialised one at a time: replay/run/streamed_runner.py). Raises what the optimizer's step raises."""
    stepped = {name for group in snapshot.param_groups for name in group["params"]}
    if runner is None:
        names = [name for name, param in model.named_parameters() if param.grad is not None]
        pairs: Iterator[tuple[str, torch.nn.Parameter]] = (
            (n, p) for n, p in model.named_parameters() if p.grad is not None
        )
    else:
        names, pairs = runner.gradient_names(), runner.gradients()
    order = [name for name in names if name in stepped]
    try:
        position = 0
        for name, param in pairs:
            if name not in stepped:
                continue
            position += 1
            if position < len(order):
                snapshot.read_ahead(order[position])
            yield _step_copy(name, param, snapshot, hyper)
    finally:
        snapshot.drop_read_ahead()


def _step_copy(name: str, param: torch.nn.Parameter, snapshot: Any, hyper: dict | None) -> ParameterStep:
    """One parameter's update, on a copy of it (step_each_parameter)."""
    before = param.detach()
    copy = torch.nn.Parameter(before.clone(), requires_grad=param.requires_grad)
    copy.grad = param.grad
    finite_before = not any_nonfinite([before])[0]
    optimizer = snapshot.build({name: copy}, [name], hyper)
    optimizer.step()
    after = copy.detach()
    broke = finite_before and any_nonfinite([after])[0]
    moved = float(torch.linalg.vector_norm((after - before).float())) ** 2
    size = float(torch.linalg.vector_norm(before.float())) ** 2
    return ParameterStep(name, copy, snapshot, optimizer, broke, moved, size)


def _has_bad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not all_finite(value)
    return isinstance(value, float) and not math.isfinite(value)


def explain_update(name: str, grad: torch.Tensor | None, pre: dict, post: dict, hyper: dict) -> str:
    """Says in words why an optimizer update made parameter `name` non-finite."""
    bad_hyper = [
        k for k, v in hyper.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v)
    ]
    if bad_hyper:
        return f"hyper-parameter {bad_hyper[0]} is {hyper[bad_hyper[0]]}"
    bad_pre = [k for k, v in pre.items() if _has_bad(v)]
    if bad_pre:
        return f"{bad_pre[0]} already held NaN/Inf before the step (corrupted optimizer state)"
    eps = hyper.get("eps")
    sq = post.get("exp_avg_sq")
    if isinstance(sq, torch.Tensor) and eps is not None and float(eps) == 0.0 and bool((sq == 0).any()):
        zeros = int((sq == 0).sum())
        return (
            f"exp_avg_sq is 0 and eps is 0: 0/0 ({zeros} of {sq.numel()} entries of exp_avg_sq are 0, "
            "e.g. where the gradient is 0); set eps > 0 (e.g. 1e-8)"
        )
    bad_post = [k for k, v in post.items() if _has_bad(v)]
    if bad_post:
        return f"{bad_post[0]} became non-finite during the step (overflow in the optimizer state)"
    if isinstance(sq, torch.Tensor) and eps is not None and float(eps) == 0.0:
        return "eps is 0: the update divides by sqrt(exp_avg_sq) with no floor; a tiny exp_avg_sq overflows it"
    lr = hyper.get("lr")
    return (
        f"the update overflowed the parameter (lr={lr}, weight_decay={hyper.get('weight_decay')}); "
        "look at the learning rate and the size of the gradient"
    )


# --------------------------------------------------------------------------------------------
# spikes: per-layer statistics
# --------------------------------------------------------------------------------------------
class LayerRow(TypedDict):
    """One module of the report's `per_layer` table."""

    module: str
    grad_norm: float | None
    """Of the module's own parameters (not its children's); None: it has none with a gradient."""
    output_absmax: float | None


class LayerWatch:
    """Output abs-max per module while a pass runs (a ModuleTracker), and each module's own gradient norms read after
    it: the per-layer table of the pass it watched. The reproduce pass carries one (replay/stages.py), so the table
    costs no pass of its own (a streamed replay: no walk over the blocks)."""

    def __init__(self, runner: StepRunner):
        self.runner = runner
        model = runner.model
        self.modules = {
            name: m
            for name, m in model.named_modules()
            if not any(True for _ in m.children()) or any(True for _ in m.parameters(recurse=False))
        }
        self.absmax: dict[str, torch.Tensor] = {}
        self._tracker = ModuleTracker(model, self._on_exit)

    def __enter__(self) -> "LayerWatch":
        self.absmax.clear()
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tracker.__exit__(*exc)

    def _on_exit(self, name, module, args, kwargs, output) -> None:
        if name not in self.modules:
            return
        outputs = float_tensors(output)
        if not outputs:
            return
        value = torch.stack([t.detach().abs().max().float().to(outputs[0].device) for t in outputs])
        value = value.max() if not bool(torch.isnan(value).any()) else torch.tensor(float("nan"))
        previous = self.absmax.get(name)
        self.absmax[name] = value if previous is None else torch.maximum(previous.to(value.device), value)

    def rows(self) -> list[LayerRow]:
        """The table of the pass watched last, its gradients still on the runner (run(keep_grads=True))."""
        rows: list[LayerRow] = []
        for name, module in self.modules.items():
            norms = self.runner.own_grad_norms(module)
            norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else None
            value = self.absmax.get(name)
            rows.append(
                {
                    "module": module_label(name),
                    "grad_norm": norm,
                    "output_absmax": float(value) if value is not None else None,
                }
            )
        return rows


def per_layer_stats(
    runner: StepRunner, samples: list[SampleRef] | None = None, *, fp32: bool = False
) -> list[LayerRow]:
    """Gradient norm and output abs-max per module (leaf modules and modules owning parameters), from a pass of
    their own (`LayerWatch` reads them from a pass that runs anyway).

    Returns:
        [{"module": name, "grad_norm": float|None, "output_absmax": float|None}], in named_modules()
        order; grad_norm covers the module's own parameters (not its children's).
    """
    watch = LayerWatch(runner)
    with watch:
        runner.run(samples, fp32=fp32, keep_grads=True)
    try:
        return watch.rows()
    finally:
        runner.reset()


__all__ = ["LayerRow", "LayerWatch", "OptimizerFinding", "localize_optimizer", "explain_update", "per_layer_stats"]
