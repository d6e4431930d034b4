"""Remedies over the following steps: in a window replay, each fix that made the broken step healthy is kept for
the next recorded steps (forensics.replay.run.window.FOLLOWING_STEPS, the dumped step included), which are re-executed with
their recorded data, RNG and learning rate. A fix that only postpones the failure shows it here.

What "kept" means per remedy (replay/judge/remedies.py's `setting`): dropped samples stay out of the broken step (they
do not come back in the steps after it); a hyper-parameter change (Adam eps, a lower learning rate: the same
factor on each step's recorded lr) and fp32 / a clipping norm hold for every following step; skipping applies
to the broken step only. A lower loss scale is not carried: the window replay runs without a loss scaler.
A following step is healthy under the same criteria as the broken one (forensics.replay.judge.remedies.WRECK_RATIO).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from forensics.core.errors import ReplayError
from forensics.core.kinds import RemedyKind
from forensics.replay.judge.remedies import Following, RemediesBlock, RemedyRow
from forensics.replay.run.execute import StepRunner
from forensics.replay.run.window import Followup, run_step, set_lr, to_device

logger = logging.getLogger(__name__)


def follow_remedies(block: RemediesBlock, runner: StepRunner, followup: Followup) -> None:
    """Adds `following` to each healthy row of the `remedies` block (in place), re-ranks the rows (a fix that
    holds first) and says what was tested in `following_steps`."""
    steps = [row["step"] for row, _ in followup.steps]
    if not steps:
        return
    for row in block["tested"]:
        if row.get("healthy") is not True:
            continue
        try:
            row["following"] = _follow(row, runner, followup)
        except Exception as exc:  # noqa: BLE001 - one remedy that cannot be carried over must not lose the others
            logger.warning("remedy %s could not be carried over the following steps: %s", row["kind"], exc)
            row["following"] = {"tested": False, "note": f"could not be run ({type(exc).__name__}: {str(exc)[:160]})"}
        finally:
            runner.weights_changed()  # the fix was carried over by stepping the model itself
            runner.reset()
    block["tested"].sort(
        key=lambda r: (
            r.get("healthy") is not True,
            dict(r.get("following") or {}).get("healthy") is False,
            RemedyKind(r["kind"]).rank,
        )
    )
    block["following_steps"] = (
        f"each change that made step {followup.row['step']} healthy was kept for the "
        f"recorded steps after it ({', '.join(map(str, steps))}) and they were re-executed"
    )


def _follow(row: RemedyRow, runner: StepRunner, followup: Followup) -> Following:
    session, setting = runner.session, row.get("setting") or {}
    if "loss_scale" in setting:
        return {"tested": False, "note": "not carried over: the window replay runs without a loss scaler"}
    model = session.model
    fp32 = bool(setting.get("fp32"))
    model.load_state_dict(followup.pre_model)
    if fp32:
        for tensor in model.parameters():
            tensor.data = tensor.data.float()  # runner.reset() puts the recorded dtypes back
    optimizer = session.new_optimizer()
    if optimizer is None:  # the caller notes the remedy as not carried over
        raise ReplayError("the dump holds no optimizer to carry the fix over the following steps")
    hyper = dict(setting.get("hyper") or {})
    broken_lr = followup.row.get("lr")
    lr_factor = (
        hyper.pop("lr") / broken_lr if "lr" in hyper and isinstance(broken_lr, (int, float)) and broken_lr else 1.0
    )
    for group in optimizer.param_groups:
        group.update(hyper)
    clip = setting.get("clip", followup.max_norm)
    if not setting.get("skip"):
        ids, batches, rng = _without(followup, setting.get("drop") or [], session.device)
        _set_lr_scaled(optimizer, followup.row, lr_factor)
        outcome, _ = run_step(model, optimizer, session, batches, {**followup.row, "rng": rng}, clip, fp32)
        if outcome.broke:
            return {
                "tested": True,
                "healthy": False,
                "steps": [],
                "first_unhealthy": followup.row["step"],
                "why": outcome.broke,
            }
    done = []
    for step_row, batches in followup.steps:
        _set_lr_scaled(optimizer, step_row, lr_factor)
        outcome, _ = run_step(model, optimizer, session, batches, step_row, clip, fp32)
        done.append(step_row["step"])
        if outcome.broke:
            return {
                "tested": True,
                "healthy": False,
                "steps": done,
                "first_unhealthy": step_row["step"],
                "why": outcome.broke,
            }
    return {"tested": True, "healthy": True, "steps": done, "first_unhealthy": None, "why": None}


def _set_lr_scaled(optimizer: torch.optim.Optimizer, row: dict, factor: float) -> None:
    set_lr(optimizer, row.get("lr"))
    if factor != 1.0:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor


def _without(followup: Followup, dropped: list[Any], device: torch.device) -> tuple[list, list, list]:
    """The broken step's micro-batches rebuilt without the dropped samples (a micro-batch left empty is left out,
    with its RNG state)."""
    out_ids, batches, rng = [], [], []
    gone = {repr(i) for i in dropped}
    for ids, state in zip(followup.row["sample_ids"], followup.row["rng"]):
        kept = [i for i in ids if repr(i) not in gone]
        if kept:
            out_ids.append(kept)
            batches.append(to_device(followup.data.batch(kept), device))
            rng.append(state)
    return out_ids, batches, rng
