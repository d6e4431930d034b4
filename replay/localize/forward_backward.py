"""Localise in forward and backward: which module / ATen op / parameter first goes non-finite, in which phase.

* Forward (`localize_forward`): module hooks keep a stack of running modules; a TorchDispatchMode
  checks every ATen op's output and names the first one that produces NaN/Inf (-inf made by mask
  ops such as masked_fill / where / full is allowed by default). Ops run outside every module (a
  custom loss taking log(0)) are attributed to `LOSS_MODULE`; ops of the root module's own forward
  (e.g. a Hugging Face model computing its loss) to `ROOT_MODULE`.
* Backward (`localize_backward`): a TorchFunctionMode tags every autograd node with the module that
  created it; the step is re-run under torch.autograd.detect_anomaly(check_nan=False) with a hook on
  every node, so the first node whose gradient goes non-finite from finite incoming gradients is
  named with its module and anomaly mode's forward traceback. `parameter` is the first parameter to
  RECEIVE a non-finite gradient during backward (reverse execution order of the forward);
  `first_parameter_in_order` is the first in named_parameters() order.

The optimizer check (`localize_optimizer`) and per-layer statistics (`per_layer_stats`) live in
replay/localize/update.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from forensics.core.kinds import Phase
from forensics.core.thirdparty import TorchDispatchMode, op_schema, tree_flatten, tree_map
from forensics.replay.run.execute import SampleRef, StepRunner, all_finite, any_nonfinite

logger = logging.getLogger(__name__)

LOSS_MODULE = "<loss>"  # ops that ran outside every module (the loss function's own code)
INPUT_MODULE = "<input>"  # the batch itself: its data held NaN/Inf before any module ran
ROOT_MODULE = "<root>"  # the model's own forward, outside its submodules
_TAG = "forensics_module"

# ATen ops that legitimately make -inf: attention masks (masked_fill(mask, -inf), where(mask, x, -inf),
# full(..., -inf)) and constants. Other ops producing -inf (aten::log of 0) are flagged.
MASK_OPS = frozenset(
    {
        "aten::masked_fill",
        "aten::masked_fill_",
        "aten::where",
        "aten::full",
        "aten::full_like",
        "aten::new_full",
        "aten::fill",
        "aten::fill_",
        "aten::scalar_tensor",
        "aten::lift_fresh",
        "aten::lift_fresh_copy",
        "aten::index_put",
        "aten::index_put_",
        "aten::masked_scatter",
        "aten::masked_scatter_",
    }
)


# ATen ops whose output is uninitialised memory (may hold any bit pattern, NaN included) until written.
UNINITIALISED_OPS = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::empty_permuted",
        "aten::resize_",
        "aten::set_",
    }
)
# Ops that only move or re-view data: they pass NaN/Inf along, never make it. A non-finite weight
# reaching the first real computation through them is reported at that computation.
COPY_OPS = frozenset(
    {
        "aten::_to_copy",
        "aten::clone",
        "aten::copy_",
        "aten::detach",
        "aten::contiguous",
        "aten::to",
        "aten::_unsafe_view",
        "aten::alias",
        "aten::lift_fresh_copy",
    }
)
# Frames of these files are plumbing (module call machinery, this package) and are cut from tracebacks.
_PLUMBING = (
    "torch/nn/modules/module.py",
    "replay/localize/forward_backward.py",
    "replay/localize/update.py",
    "replay/run/execute.py",
    "torch/utils/_python_dispatch.py",
    "torch/overrides.py",
)


def module_label(name: str) -> str:
    """A module's report name: its qualified name, ROOT_MODULE for the model itself."""
    return name if name else ROOT_MODULE


def float_tensors(tree: Any) -> list[torch.Tensor]:
    """The non-empty floating-point tensors among the leaves of `tree` (args, outputs...)."""
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0]


def _kinds(tensors: list[torch.Tensor]) -> set[str]:
    """Which of "nan", "+inf", "-inf" any of `tensors` holds."""
    kinds: set[str] = set()
    for t in tensors:
        if all_finite(t):
            continue
        if bool(torch.isnan(t).any()):
            kinds.add("nan")
        if bool(torch.isposinf(t).any()):
            kinds.add("+inf")
        if bool(torch.isneginf(t).any()):
            kinds.add("-inf")
    return kinds


def _largest_abs(tensors: list[torch.Tensor]) -> float | None:
    """Largest |x| over the tensors (NaN if any NaN, inf if any inf), or None without tensors."""
    if not tensors:
        return None
    values = torch.stack([t.detach().abs().max().float().to(tensors[0].device) for t in tensors])
    if bool(torch.isnan(values).any()):
        return float("nan")
    return float(values.max())


# --------------------------------------------------------------------------------------------
# module stack
# --------------------------------------------------------------------------------------------
class ModuleTracker:
    """Forward pre/post hooks on every module: the stack of running modules, plus optional callbacks.

    on_exit(name, module, args, kwargs, output) runs when a module's forward returns (leaves
    before their parents). Use as a context manager; hooks are removed on exit.
    """

    def __init__(
        self, model: torch.nn.Module, on_exit: Callable[[str, torch.nn.Module, tuple, dict, Any], None] | None = None
    ):
        self.model = model
        self.stack: list[str] = []
        self.on_exit = on_exit
        self._handles: list[Any] = []

    @property
    def current(self) -> str:
        return module_label(self.stack[-1]) if self.stack else LOSS_MODULE

    def __enter__(self) -> "ModuleTracker":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stack.clear()

    def _pre(self, name: str):
        def hook(module, args):
            self.stack.append(name)

        return hook

    def _post(self, name: str):
        def hook(module, args, kwargs, output):
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if self.on_exit is not None:
                self.on_exit(name, module, args, kwargs, output)

        return hook


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------
@dataclass
class ForwardFinding:
    """Where the forward pass first produced NaN/Inf."""

    module: str | None
    """The module running when the first bad op ran (deepest), else the first module whose output
    was non-finite; LOSS_MODULE for the loss function's own code."""
    op: str | None
    """e.g. "aten::log"; None when only a module output was seen (no op produced it)."""
    micro_batch: int | None
    op_inputs_finite: bool | None
    """True: the op made NaN/Inf out of finite inputs (the origin). False: an input already held
    them (see nonfinite_inputs)."""
    nonfinite_inputs: list[str] = field(default_factory=list)
    """Parameters (by name) among the op's inputs that were already non-finite."""
    first_nonfinite_module: str | None = None
    """First module, in completion order, whose output held NaN/Inf."""
    stats: dict = field(default_factory=lambda: {"inputs_absmax": None, "outputs_absmax": None, "params_absmax": None})
    op_stats: dict = field(default_factory=dict)
    output_kinds: list[str] = field(default_factory=list)
    phase: Phase = Phase.FORWARD
    op_call: tuple[Any, tuple, dict] | None = None  # (op, args, kwargs)
    """With keep_op_inputs: (the ATen OpOverload, args, kwargs) of that op, tensors copied as they went in
    (replay/repro.py writes them out as a standalone reproduction)."""


class _NonFiniteOpChecker(TorchDispatchMode):
    """Names the first ATen op whose output holds NaN/Inf (with the module running it)."""

    def __init__(
        self, tracker: ModuleTracker, allow_neg_inf_masks: bool, param_names: dict[int, str], keep_inputs: bool = False
    ):
        super().__init__()
        self.keep_inputs = keep_inputs
        self.tracker = tracker
        self.allow_masks = allow_neg_inf_masks
        self.param_names = param_names
        self.paused = False
        self.micro_batch: int | None = None
        self.found: dict | None = None
        self.derived: dict[int, tuple[torch.Tensor, str]] = {}  # id -> (tensor kept alive, parameter name)

    def _origin(self, tensor: torch.Tensor) -> str | None:
        """The parameter `tensor` is, or was copied / viewed from (None if neither)."""
        if id(tensor) in self.param_names:
            return self.param_names[id(tensor)]
        entry = self.derived.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused or self.found is not None or op_schema(func).name in UNINITIALISED_OPS:
            return func(*args, **kwargs)
        mutable = op_schema(func).is_mutable
        inputs = float_tensors((args, kwargs))
        pre_kinds = _kinds(inputs) if mutable else None  # in-place ops overwrite their inputs
        kept = _copy_call(args, kwargs) if self.keep_inputs and mutable else None
        out = func(*args, **kwargs)
        # Multi-output ops: only the result (output 0) is data. The rest are side values that may be
        # uninitialised or legitimately infinite (nll_loss's total_weight with reduction='none' on CUDA,
        # the logsumexp of a fully masked attention row, a norm's saved statistics).
        outputs = float_tensors(out[0] if isinstance(out, (tuple, list)) and out else out)
        if not outputs or all(all_finite(t) for t in outputs):
            return out
        out_kinds = _kinds(outputs)
        in_kinds = pre_kinds if pre_kinds is not None else _kinds(inputs)
        name = op_schema(func).name
        if name in UNINITIALISED_OPS:
            return out
        if out_kinds <= {"-inf"} and self.allow_masks and (name in MASK_OPS or "-inf" in in_kinds):
            return out  # an attention mask being built, or a mask's -inf passed along
        passes_along = name in COPY_OPS or any(r.alias_info is not None for r in op_schema(func).returns)
        origins = [self._origin(t) for t in inputs if not all_finite(t)]
        if passes_along and out_kinds <= in_kinds:
            origin = next((o for o in origins if o is not None), None)
            if origin is not None:  # remember that these outputs are (views / copies of) that weight
                for t in outputs:
                    self.derived[id(t)] = (t, origin)
            return out
        bad_params = sorted({o for o in origins if o is not None})
        self.found = {
            "op": name,
            "module": self.tracker.current,
            "micro_batch": self.micro_batch,
            "inputs_finite": not in_kinds,
            "nonfinite_inputs": bad_params,
            "output_kinds": sorted(out_kinds),
            "op_stats": {"inputs_absmax": _largest_abs(inputs), "outputs_absmax": _largest_abs(outputs)},
        }
        if self.keep_inputs:
            self.found["call"] = (func, *(kept or _copy_call(args, kwargs)))
        return out


def _copy_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An op's arguments with every tensor detached and copied (what went in, whatever the op does to it)."""

    def copy(value: Any) -> Any:
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    return tree_map(copy, args), tree_map(copy, kwargs)


def localize_forward(
    runner: StepRunner,
    samples: list[SampleRef] | None = None,
    *,
    allow_neg_inf_masks: bool = True,
    fp32: bool = False,
    keep_op_inputs: bool = False,
) -> ForwardFinding | None:
    """Re-runs the forward (no backward) and names where NaN/Inf first appears.

    Args:
        runner: the step runner.
        samples: only these samples (None: the whole step).
        allow_neg_inf_masks: -inf made by mask ops (masked_fill, where, full...) is not a finding.
        fp32: run without autocast.
        keep_op_inputs: copy the first non-finite op's inputs into ForwardFinding.op_call.
    Returns:
        ForwardFinding, or None when the forward stays finite.
    """
    bad_input = _nonfinite_batch_input(runner, samples)
    if bad_input is not None:
        return bad_input
    model = runner.model
    param_ids: dict[int, str] = {}
    first_bad_module: dict = {}
    module_stats: dict[str, dict] = {}
    checker_box: dict[str, _NonFiniteOpChecker] = {}

    def on_exit(name, module, args, kwargs, output):
        checker = checker_box.get("checker")
        if checker is not None:
            checker.paused = True
        try:
            outputs = float_tensors(output)
            label = module_label(name)
            if "name" not in first_bad_module and outputs and any(any_nonfinite(outputs)):
                first_bad_module.update(name=label, stats=_module_stats(module, args, kwargs, outputs))
            target = checker.found["module"] if checker is not None and checker.found else None
            if target == label and label not in module_stats:
                module_stats[label] = _module_stats(module, args, kwargs, outputs)
        finally:
            if checker is not None:
                checker.paused = False

    found_ops: list[dict] = []
    with ModuleTracker(model, on_exit) as tracker:
        # parameters are identified by tensor identity at dispatch (ids taken after the runner's reset)
        @contextlib.contextmanager
        def forward_context(index: int) -> Iterator[None]:
            param_ids.clear()
            param_ids.update({id(p): n for n, p in model.named_parameters()})
            if found_ops:
                yield
                return
            checker = _NonFiniteOpChecker(tracker, allow_neg_inf_masks, param_ids, keep_op_inputs)
            checker.micro_batch = index
            checker_box["checker"] = checker
            try:
                with checker:
                    yield
            finally:
                checker_box.pop("checker", None)
                if checker.found is not None:
                    found_ops.append(checker.found)

        result = runner.run(samples, fp32=fp32, backward=False, forward_context=forward_context)
    op = found_ops[0] if found_ops else None
    if op is None and "name" not in first_bad_module:
        if not result.loss_finite:
            logger.warning(
                "the loss is non-finite but no op or module output was: the loss function's result itself is odd (%s)",
                result.losses,
            )
            return ForwardFinding(module=LOSS_MODULE, op=None, micro_batch=None, op_inputs_finite=None)
        return None
    if op is not None:
        module = op["module"]
        stats = module_stats.get(module) or {
            "inputs_absmax": op["op_stats"]["inputs_absmax"],
            "outputs_absmax": op["op_stats"]["outputs_absmax"],
            "params_absmax": None,
        }
        return ForwardFinding(
            module=module,
            op=op["op"],
            micro_batch=op["micro_batch"],
            op_inputs_finite=op["inputs_finite"],
            nonfinite_inputs=op["nonfinite_inputs"],
            first_nonfinite_module=first_bad_module.get("name"),
            stats=stats,
            op_stats=op["op_stats"],
            output_kinds=op["output_kinds"],
            op_call=op.get("call"),
        )
    return ForwardFinding(
        module=first_bad_module["name"],
        op=None,
        micro_batch=None,
        op_inputs_finite=None,
        first_nonfinite_module=first_bad_module["name"],
        stats=first_bad_module["stats"],
    )


def _nonfinite_batch_input(runner: StepRunner, samples: list[SampleRef] | None) -> ForwardFinding | None:
    """The batch's own float data holding NaN/Inf (an `inputs_embeds` already broken): then the input is the
    source, not the first module that passes it on. Named by its field path, e.g. `<input>.inputs_embeds`."""
    from forensics.format.batch_tree import tensor_leaves
    from forensics.replay.load.samples import select_samples

    session = runner.session
    chosen = None if samples is None else {(r.micro_batch, r.index) for r in samples}
    for index, batch in enumerate(session.micro_batches):
        if chosen is not None:
            rows = [i for mb, i in sorted(chosen) if mb == index]
            if not rows:
                continue
            batch = select_samples(batch, rows)
        for path, tensor in tensor_leaves(batch):
            if tensor.is_floating_point() and tensor.numel() and not all_finite(tensor):
                field = path or "batch"
                value = tensor.detach().float()
                return ForwardFinding(
                    module=f"{INPUT_MODULE}.{field}",
                    op=None,
                    micro_batch=index,
                    op_inputs_finite=False,
                    nonfinite_inputs=[field],
                    first_nonfinite_module=None,
                    stats={
                        "inputs_absmax": _largest_abs([value]),  # nan when it holds NaN
                        "outputs_absmax": None,
                        "params_absmax": None,
                    },
                )
    return None


def _module_stats(module: torch.nn.Module, args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> dict:
    params: list[torch.Tensor] = [p for p in module.parameters() if p.is_floating_point() and p.numel()]
    return {
        "inputs_absmax": _largest_abs(float_tensors((args, kwargs))),
        "outputs_absmax": _largest_abs(outputs),
        "params_absmax": _largest_abs(params),
    }


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------
@dataclass
class BackwardFinding:
    """Where the backward pass first produced NaN/Inf."""

    parameter: str | None
    """First parameter to receive a non-finite gradient during backward (reverse forward order)."""
    first_parameter_in_order: str | None
    """First parameter in named_parameters() order whose gradient is non-finite."""
    module: str | None
    """Module whose forward created the autograd node that first produced a non-finite gradient."""
    op: str | None
    """Forward op of that node, derived from its name (SqrtBackward0 -> aten::sqrt)."""
    backward_node: str | None
    traceback: str | None
    """Forward traceback of that op, recorded by anomaly mode."""
    micro_batch: int | None = None
    phase: Phase = Phase.BACKWARD


def _camel_to_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def node_to_op(node_name: str) -> str | None:
    """ "SqrtBackward0" -> "aten::sqrt"; "NativeLayerNormBackward0" -> "aten::native_layer_norm"."""
    match = re.match(r"^(?:torch::autograd::)?([A-Za-z0-9]+?)Backward\d*$", node_name)
    return f"aten::{_camel_to_snake(match.group(1))}" if match else None


def _tag_graph(roots: list[Any], label: str) -> None:
    stack = [n for n in roots if n is not None]
    while stack:
        node = stack.pop()
        meta = node.metadata
        if _TAG in meta:
            continue
        meta[_TAG] = label
        stack.extend(child for child, _ in node.next_functions if child is not None)


class _GraphTagger(TorchFunctionMode):
    """Tags each new autograd node with the module running when it was created."""

    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten(out)
        roots = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if roots:
            _tag_graph(roots, self.tracker.current)
        return out


def _all_nodes(root: Any) -> list[Any]:
    seen, order, stack = set(), [], [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return order


def _internal_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where frames that are not the user's code live: forensics' own package (the one this file belongs to:
    forensics/replay/localize/ -> forensics/, capture and replay included, their symlinked sources resolved), click
    and torch; and the Python standard library (runpy, threading), whose site-packages are not part of it."""
    import sysconfig

    import click

    package = Path(__file__).parent.parent.parent  # forensics/ (replay/localize/forward_backward.py inside it)
    own = [package, *(child for child in package.iterdir() if child.is_dir())]  # the symlinks, resolved
    packages = [str(p.resolve()) + os.sep for p in own]
    packages += [str(Path(str(m.__file__)).resolve().parent) + os.sep for m in (click, torch)]
    paths = sysconfig.get_paths()
    stdlib = {str(Path(paths[k]).resolve()) + os.sep for k in ("stdlib", "platstdlib") if k in paths}
    return tuple(dict.fromkeys(packages)), tuple(sorted(stdlib))


def _internal(path: str, roots: tuple[tuple[str, ...], tuple[str, ...]]) -> bool:
    """A frame of forensics, click, torch or the standard library; not one of the user's (their script, their
    model, an installed package such as transformers)."""
    packages, stdlib = roots
    if path.startswith(packages):
        return True
    parts = Path(path).parts
    return path.startswith(stdlib) and "site-packages" not in parts and "dist-packages" not in parts


_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line \d+')


def _clean_traceback(frames: Any) -> str | None:
    """Anomaly mode's forward stack as the user needs it (one string, innermost last): the frames of the user's own
    code (the training script, the model, its loss) only; module-call plumbing is cut and the frames of forensics'
    own code, click, torch and the standard library are folded into one line (issue 50: ~20 lines of internals)."""
    if not frames:
        return None
    if isinstance(frames, str):  # a warning's text: split into frames
        head, _, rest = frames.partition('  File "')
        frames = [head] + ['  File "' + part for part in rest.split('\n  File "')] if rest else [frames]
        frames = [f if f.endswith("\n") else f + "\n" for f in frames if f.strip()]
    roots = _internal_roots()
    paths = [str(Path(m.group("path")).resolve()) if (m := _FRAME.match(f)) else None for f in frames]
    # what called forensics (the CLI, a test runner, the user's script calling run_replay) is not where the op ran:
    # the user's frames are those after forensics' outermost own frame (forensics called into them)
    own = [i for i, path in enumerate(paths) if path is not None and path.startswith(roots[0][:-2])]
    start = own[0] if own else 0
    kept, folded = [], start - sum(1 for p in paths[:start] if p is None)
    kept += [f for f, path in zip(frames[:start], paths[:start]) if path is None]  # headings
    for frame, path in zip(frames[start:], paths[start:]):
        if path is None:  # a heading ("Traceback of forward call that caused the error:")
            kept.append(frame)
        elif any(p in frame for p in _PLUMBING) or _internal(path, roots):
            folded += 1
        else:
            kept.append(frame)
    if not any(_FRAME.match(f) for f in kept):
        return "".join(frames)  # nothing of the user's: the whole stack rather than none
    note = f"  ({folded} frames of the caller, forensics, torch and Python internals folded)\n" if folded else ""
    return note + "".join(kept)


@contextlib.contextmanager
def _recomputing(tracker: ModuleTracker, block: str) -> Iterator[None]:
    """A streamed block recomputed for its backward: its nodes tagged with the modules running, the block first."""
    tracker.stack.append(block)
    try:
        with _GraphTagger(tracker):
            yield
    finally:
        if tracker.stack and tracker.stack[-1] == block:
            tracker.stack.pop()


def localize_backward(
    runner: StepRunner, samples: list[SampleRef] | None = None, *, fp32: bool = False, anomaly: bool = True
) -> BackwardFinding | None:
    """Re-runs forward + backward with node tagging, node/parameter hooks and anomaly mode.

    Anomaly mode runs with check_nan=False: it records every op's forward traceback but does not abort
    the backward, so the hooks also see which parameters receive non-finite gradients.

    Returns:
        BackwardFinding, or None when every gradient is finite.
    """
    model = runner.model
    state: dict[str, Any] = {"node": None, "param": None, "micro_batch": None}
    handles: list[Any] = []

    def param_hook(name: str):
        def hook(grad):
            if state["param"] is None and grad is not None and not all_finite(grad):
                state["param"] = name

        return hook

    def node_hook(node):
        def hook(grad_inputs, grad_outputs):
            if state["node"] is not None:
                return
            outs = [g for g in grad_inputs if isinstance(g, torch.Tensor) and g.is_floating_point()]
            if not outs or all(all_finite(g) for g in outs):
                return
            incoming = [g for g in grad_outputs if isinstance(g, torch.Tensor) and g.is_floating_point()]
            if incoming and not all(all_finite(g) for g in incoming):
                return  # propagated, not made here
            meta = node.metadata
            trace = meta.get("traceback_")
            state["node"] = {
                "name": node.name(),
                "module": meta.get(_TAG),
                "traceback": _clean_traceback(trace),
                "micro_batch": state["micro_batch"],
            }

        return hook

    def watch(roots: list[Any], label: str) -> None:
        _tag_graph(roots, label)
        for root in roots:
            for node in _all_nodes(root):
                if "AccumulateGrad" not in node.name():
                    handles.append(node.register_hook(node_hook(node)))

    def on_loss(index: int, loss: torch.Tensor) -> None:
        state["micro_batch"] = index
        if loss.grad_fn is not None:
            watch([loss.grad_fn], LOSS_MODULE)

    with ModuleTracker(model) as tracker:

        @contextlib.contextmanager
        def forward_context(index: int) -> Iterator[None]:
            with _GraphTagger(tracker):
                yield

        param_handles = [p.register_hook(param_hook(n)) for n, p in model.named_parameters() if p.requires_grad]
        streamer = getattr(runner, "streamer", None)  # a streamed replay: each block's graph exists only while its
        if streamer is not None:  # recomputation's backward runs (replay/run/streamed_runner.py); watch it there
            streamer.recompute_context = lambda index: _recomputing(tracker, streamer.plan.blocks[index].name)
            streamer.after_recompute = lambda outputs: watch(
                [t.grad_fn for t in outputs if t.grad_fn is not None], LOSS_MODULE
            )
        try:
            result = runner.run(
                samples,
                fp32=fp32,
                anomaly=anomaly,
                anomaly_check_nan=False,
                forward_context=forward_context,
                on_loss=on_loss,
            )
        finally:
            if streamer is not None:
                streamer.recompute_context = streamer.after_recompute = None
            for handle in param_handles + handles:
                handle.remove()
    if result.grads_finite and result.error is None and state["node"] is None:
        return None
    node = state["node"] or {}
    traceback = node.get("traceback")
    if not traceback:
        traceback = next((w for w in result.anomaly_warnings if "Traceback of forward call" in w), None)
    return BackwardFinding(
        parameter=state["param"],
        first_parameter_in_order=result.nonfinite_grad_params[0] if result.nonfinite_grad_params else None,
        module=node.get("module"),
        op=node_to_op(node["name"]) if node.get("name") else None,
        backward_node=node.get("name"),
        traceback=traceback,
        micro_batch=node.get("micro_batch"),
    )


__all__ = [
    "ForwardFinding",
    "BackwardFinding",
    "ModuleTracker",
    "localize_forward",
    "localize_backward",
    "node_to_op",
    "float_tensors",
    "module_label",
    "LOSS_MODULE",
    "ROOT_MODULE",
    "INPUT_MODULE",
    "MASK_OPS",
]
