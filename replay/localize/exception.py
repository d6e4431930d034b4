"""Where a step that raised raises: the module and ATen op, and for out-of-range indices the offending values.

The step is re-run under a ModuleTracker (the innermost module still running when the exception passes is
where it was raised: its forward hook never ran) and a TorchDispatchMode that notes the ATen op whose
call raised. For the ops that index with data — embedding, index_select, gather, nll_loss /
cross_entropy targets — the index tensor is searched for the values out of range, and their position is
mapped back to the sample: "token id 300 >= vocabulary size 64 at position 5 of sample 's3-1-2'".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from forensics.core.kinds import Phase
from forensics.core.thirdparty import TorchDispatchMode, op_schema
from forensics.replay.localize.forward_backward import ModuleTracker
from forensics.replay.run.execute import SampleRef, StepRunner

logger = logging.getLogger(__name__)


@dataclass
class ExceptionFinding:
    """Where the replayed step raised, and why (report block `exception`)."""

    type: str
    message: str
    module: str | None
    op: str | None
    micro_batch: int | None
    phase: Phase
    detail: str | None = None
    """Plain words about the data that made the op raise (the out-of-range values), or None."""
    bad_values: list[dict] = field(default_factory=list)
    """[{"value", "limit", "sample_id", "micro_batch", "index", "position"}] for out-of-range indices."""
    context_limit: int | None = None
    """A position embedding ran out of positions: the model's context length (a sample longer than it)."""
    op_call: tuple[Any, tuple, dict] | None = field(default=None, repr=False)  # (op, args, kwargs)
    """(ATen overload, args, kwargs) of the op that raised in the forward: `forensics repro` calls it again."""


class _RaisingOp(TorchDispatchMode):
    """Notes the first ATen op whose call raised, with its arguments (for the index analysis)."""

    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker = tracker
        self.found: dict | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception:
            if self.found is None:
                self.found = {
                    "op": f"aten::{op_schema(func).name.split('::')[-1]}",
                    "module": self.tracker.current,
                    "args": args,
                    "call": (func, args, kwargs),
                }
            raise


def localize_exception(runner: StepRunner, samples: list[SampleRef] | None = None) -> ExceptionFinding | None:
    """Re-runs the step (or `samples`) and names where it raises; None when it does not raise."""
    session = runner.session
    state: dict[str, Any] = {}
    with ModuleTracker(runner.model) as tracker:

        def forward_context(index: int):
            state["micro_batch"] = index
            mode = _RaisingOp(tracker)
            state["mode"] = mode
            return mode

        result = runner.run(samples, forward_context=forward_context)
    raised = result.raised
    if raised is None:
        return None
    mode = state.get("mode")
    found = mode.found if mode is not None and raised["phase"] == Phase.FORWARD else None
    index = raised["micro_batch"]
    rows = _rows_run(samples, index, len(session.sample_ids[index]) if index < len(session.sample_ids) else 0)
    bad = _out_of_range(found, [session.sample_ids[index][r] for r in rows], rows, index) if found else []
    detail, context = None, None
    if bad and bad[0]["what"] == "position":
        context = bad[0]["limit"]
        detail = (
            f"position {bad[0]['value']} \u2265 the model's {context} positions (its context length): the "
            f"micro-batch is {bad[0]['length']} tokens long"
        )
    elif bad:
        first = bad[0]
        bound = {"token id": "vocabulary size", "label": "number of classes"}.get(first["what"], "size")
        value = (
            f"{first['what']} {first['value']} < 0"
            if first["value"] < 0
            else f"{first['what']} {first['value']} \u2265 {bound} {first['limit']}"
        )
        detail = f"{value} at position {first['position']}"
        if len(bad) > 1:
            detail += f" ({len(bad)} such values in this micro-batch)"
    return ExceptionFinding(
        type=raised["type"],
        message=raised["message"],
        module=found["module"] if found else None,
        op=found["op"] if found else None,
        micro_batch=index,
        phase=Phase.BACKWARD if raised["phase"] == Phase.BACKWARD else Phase.FORWARD,
        detail=detail,
        bad_values=bad,
        context_limit=context,
        op_call=found.get("call") if found else None,
    )


def _positions(indices: Any) -> bool:
    """Index values that count 0, 1, 2, ... along the last dimension in every row: position ids (a position
    embedding), not token ids."""
    if (
        not isinstance(indices, torch.Tensor)
        or indices.is_floating_point()
        or indices.dim() < 1
        or indices.shape[-1] < 2
    ):
        return False
    rows = indices.reshape(-1, indices.shape[-1])
    steps = torch.arange(rows.shape[-1], device=rows.device, dtype=rows.dtype)
    return bool(((rows - rows[:, :1]) == steps).all())


def _rows_run(samples: list[SampleRef] | None, micro_batch: int, size: int) -> list[int]:
    """The rows of the micro-batch that ran, in batch order (a subset when bisecting)."""
    if samples is None:
        return list(range(size))
    return sorted(r.index for r in samples if r.micro_batch == micro_batch)


def _out_of_range(found: dict, sample_ids: list, rows: list[int], micro_batch: int) -> list[dict]:
    """The index values out of range in the op's arguments, mapped to samples (rows of the batch)."""
    op, args = found["op"], found["args"]
    checks: list[tuple[torch.Tensor, int, str, int]] = []  # (indices, limit, what, batch dim)
    if op == "aten::embedding" and len(args) >= 2:
        checks.append((args[1], args[0].shape[0], "position" if _positions(args[1]) else "token id", 0))
    elif op == "aten::index_select" and len(args) >= 3:
        checks.append((args[2], args[0].shape[args[1]], "index", -1))
    elif op in ("aten::nll_loss_forward", "aten::nll_loss2d_forward", "aten::nll_loss_nd") and len(args) >= 2:
        checks.append((args[1], args[0].shape[-1], "label", -1))
    elif op == "aten::gather" and len(args) >= 3:
        checks.append((args[2], args[0].shape[args[1]], "index", 0))
    out = []
    for indices, limit, what, batch_dim in checks:
        if not isinstance(indices, torch.Tensor) or indices.is_floating_point():
            continue
        if what == "position":  # the same positions for every sample: the micro-batch's length, no one row
            last = indices.reshape(-1, indices.shape[-1])[0]
            over = (last >= limit).nonzero().reshape(-1).tolist()
            if over:
                out.append(
                    {
                        "what": what,
                        "value": int(last[over[0]]),
                        "limit": int(limit),
                        "sample_id": None,
                        "micro_batch": micro_batch,
                        "index": None,
                        "position": over[0],
                        "length": int(indices.shape[-1]),
                    }
                )
            continue
        mask = (indices < 0) | (indices >= limit)
        if what == "label":
            mask &= indices != -100  # the ignore index
        positions = mask.nonzero().tolist()[:20]
        for position in positions:
            row = position[0] if batch_dim == 0 and indices.dim() > 1 else None
            sample = sample_ids[row] if row is not None and row < len(sample_ids) else None
            out.append(
                {
                    "what": what,
                    "value": int(indices[tuple(position)]),
                    "limit": int(limit),
                    "sample_id": sample,
                    "micro_batch": micro_batch,
                    "index": rows[row] if row is not None and row < len(rows) else None,
                    "position": position[1] if row is not None and len(position) > 1 else position,
                }
            )
    return out
