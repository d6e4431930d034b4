"""Weights that are already non-finite before the step: which parameters, how much of them, which slices, and
which samples of the step touch those slices.

A weight broken in a few places (one embedding row, one output channel) fails only the samples that use
them; "every forward fails whatever the data" is said only when every sample fails. For an embedding the
bad rows are token ids, and the samples that touch them are those whose input holds one of those ids (seen
by a forward pre-hook on the embedding); for other layers, the samples whose own replay is non-finite
(the per-sample table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from forensics.replay.run.execute import SampleRef, StepRunner

MAX_LISTED = 20  # slices named per parameter (the count covers all of them)


@dataclass(frozen=True)
class CorruptedWeight:
    """A pre-step parameter holding NaN/Inf: one entry of the report's `weights.parameters` (as_dict)."""

    name: str
    shape: tuple[int, ...]
    module_type: str | None
    """The class of the module that owns it (None: not found)."""
    bad_elements: int
    elements: int
    nan: int
    pos_inf: int
    neg_inf: int
    slice_kind: str | None = None
    """What a dim-0 slice is ("token ids", "output channels", "elements", "rows (dim 0)"); None for a 0-d tensor."""
    bad_rows: tuple[int, ...] = ()
    """The first MAX_LISTED bad dim-0 slices."""
    bad_row_count: int = 0

    def as_dict(self) -> dict:
        entry: dict[str, Any] = {
            "name": self.name,
            "shape": list(self.shape),
            "module_type": self.module_type,
            "bad_elements": self.bad_elements,
            "elements": self.elements,
            "nan": self.nan,
            "pos_inf": self.pos_inf,
            "neg_inf": self.neg_inf,
        }
        if self.slice_kind is not None:
            entry.update(slice_kind=self.slice_kind, bad_rows=list(self.bad_rows), bad_row_count=self.bad_row_count)
        return entry


def corrupted_weights(runner: StepRunner) -> list[CorruptedWeight]:
    """One entry per pre-step parameter holding NaN/Inf: name, module type, element counts, bad slices."""
    runner.reset()
    model = runner.model
    modules = dict(model.named_modules())
    out = []
    for name in runner.nonfinite_params:
        param = model.get_parameter(name)
        values = param.detach()
        bad = ~torch.isfinite(values)
        owner = modules.get(name.rpartition(".")[0])
        slices: dict[str, Any] = {}
        if values.dim() >= 1:
            rows = bad.reshape(values.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
            slices = {
                "slice_kind": _slice_kind(owner, values.dim()),
                "bad_rows": tuple(rows[:MAX_LISTED]),
                "bad_row_count": len(rows),
            }
        out.append(
            CorruptedWeight(
                name=name,
                shape=tuple(values.shape),
                module_type=type(owner).__name__ if owner is not None else None,
                bad_elements=int(bad.sum()),
                elements=values.numel(),
                nan=int(torch.isnan(values).sum()),
                pos_inf=int((values == float("inf")).sum()),
                neg_inf=int((values == float("-inf")).sum()),
                **slices,
            )
        )
    return out


def _slice_kind(owner: Any, dims: int) -> str:
    if isinstance(owner, torch.nn.Embedding):
        return "token ids"
    if isinstance(owner, torch.nn.Linear) and dims == 2:
        return "output channels"
    if dims == 1:
        return "elements"
    return "rows (dim 0)"


def samples_touching_embeddings(
    runner: StepRunner, corrupted: list[CorruptedWeight]
) -> dict[str, list[SampleRef]] | None:
    """For each corrupted embedding weight: the samples whose input ids hold one of its bad rows. None when
    no corrupted parameter belongs to an embedding."""
    model = runner.model
    targets = {}
    for entry in corrupted:
        if entry.slice_kind == "token ids" and entry.bad_row_count:
            owner = model.get_submodule(entry.name.rpartition(".")[0])
            rows = list(entry.bad_rows) if entry.bad_row_count <= MAX_LISTED else None
            targets[entry.name] = (owner, rows)
    if not targets:
        return None
    seen: dict[str, set[SampleRef]] = {name: set() for name in targets}
    state = {"micro_batch": 0}
    handles = []
    for name, (owner, rows) in targets.items():

        def hook(module, args, name=name, rows=rows):
            ids = args[0] if args else None
            if not isinstance(ids, torch.Tensor) or ids.dim() < 1:
                return
            weight = module.weight
            bad_ids = (
                (~torch.isfinite(weight.detach()).reshape(weight.shape[0], -1).all(dim=1)).nonzero().flatten()
                if rows is None
                else torch.tensor(rows, device=ids.device)
            )
            hit = torch.isin(ids, bad_ids.to(ids.device))
            hit = hit.reshape(hit.shape[0], -1).any(dim=1) if hit.dim() > 1 else hit
            for row in hit.nonzero().flatten().tolist():
                seen[name].add(SampleRef(state["micro_batch"], row))

        handles.append(owner.register_forward_pre_hook(hook))

    def forward_context(index: int):
        state["micro_batch"] = index
        return torch.no_grad()

    try:
        runner.run(backward=False, forward_context=forward_context)
    finally:
        for handle in handles:
            handle.remove()
    refs = {(r.micro_batch, r.index): r for r in runner.session.sample_refs}
    return {
        name: sorted((refs.get((r.micro_batch, r.index), r) for r in found), key=lambda r: (r.micro_batch, r.index))
        for name, found in seen.items()
    }
