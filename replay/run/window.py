"""Window replay: from an earlier checkpoint, re-execute the recorded steps up to the dumped one and find the step
whose update broke the weights — then give that step the full single-step analysis.

`forensics replay DUMP --from CHECKPOINT [--from-step N]`. The dump's flight recorder (capture/recording/window.py)
holds, per step, the sample IDs of each micro-batch, the RNG before each forward, lr, divisor, loss and grad
norm; its data recipe rebuilds each micro-batch from its IDs (imported only with consent, like the model
recipe). The checkpoint is a forensics dump, a Hugging Face / Accelerate checkpoint directory, a
safetensors file or a `torch.save` file — the last loaded with `weights_only=True` only (no pickle code
runs). Each step is re-executed with its recorded RNG and learning rate and compared with the recorded
history; after each update the weights are checked. The first step whose gradients are non-finite, whose
update makes a weight non-finite, or whose update moves the weights by more than
forensics.replay.run.update_size.WRECK_RATIO of their norm is the step that broke the run: it is analysed like a dump of
that step (localisation, bisection, fp32 triage, remedies) and the report gets a `window` block.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from forensics.core.errors import DumpError, RecipeError, ReplayError
from forensics.format import spec
from forensics.core.grad_norm import total_grad_norm
from forensics.core.kinds import Phase, TriggerKind
from forensics.core.rng import restore_rng
from forensics.core.trigger import Trigger
from forensics.replay.load.recipe import import_object
from forensics.replay.load.session import ReplaySession, session_from_objects, to_device
from forensics.replay.run.update_size import WRECK_RATIO, relative_change
from forensics.replay.run.execute import any_nonfinite

logger = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    model: dict[str, torch.Tensor]
    optimizer: dict | None
    """A torch optimizer state_dict (parameters by index) or, from a forensics dump, state by parameter name."""
    by_name: bool
    step: int | None
    source: str


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Reads an earlier state: a forensics dump, a HF / Accelerate checkpoint directory, a safetensors file, or a
    torch.save file (weights_only=True: tensors and plain containers only, no code)."""
    from forensics.format.reader import is_rank_dump, rank_dirs

    path = Path(path)
    if not path.exists():
        raise DumpError(f"the checkpoint {path} does not exist")
    if path.is_dir() and (is_rank_dump(path) or any(is_rank_dump(r) for r in rank_dirs(path))):
        from forensics.format import open_dump

        dump = open_dump(path)
        return Checkpoint(dump.model_state(), dump.optimizer_state(), True, dump.step, f"forensics dump {path}")
    if path.is_dir():
        return _hf_directory(path)
    if path.suffix == ".safetensors":
        return Checkpoint(_safetensors(path), None, False, None, f"safetensors file {path}")
    return _torch_file(path)


@dataclass(frozen=True)
class SnapshotUnused:
    """The dump holds the Guard's host snapshot of `step`, but the window replay cannot start from it
    (replay/judge/verdict_context.py says what to do)."""

    step: int
    no_data_recipe: bool
    """True: the dump has no data recipe to rebuild the steps' batches; False: no consent to import it (--trust)."""


def dump_snapshot(dump: Any, enabled: bool, trust: bool) -> tuple[Checkpoint | None, SnapshotUnused | None]:
    """The Guard's host snapshot in `dump` (GuardConfig.recording.snapshot_every) as the checkpoint of a window replay, when
    the replay may use it: it is on, the dump has a data recipe, and the user allowed importing it. Otherwise
    (None, why it cannot be used) — (None, None) for a dump without a snapshot."""
    step = dump.snapshot_step
    if step is None or not enabled:
        return None, None
    if not dump.manifest.get("data_recipe"):
        return None, SnapshotUnused(step, no_data_recipe=True)
    if not trust:
        return None, SnapshotUnused(step, no_data_recipe=False)
    files = spec.SNAPSHOT_STATE
    return Checkpoint(
        dump.model_state(files),
        dump.optimizer_state(files),
        True,
        step,
        f"the Guard's host snapshot of step {step} (in the dump)",
    ), None


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from forensics.format.tensors import load_safetensors_file

    return load_safetensors_file(path, path.name)


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # an unpickler refusal or a damaged file: the user's input
        raise DumpError(
            f"cannot read {path} as a weights-only torch.save file ({type(exc).__name__}: "
            f"{str(exc)[:200]}); forensics never unpickles code: save tensors and plain containers, "
            "or a safetensors file"
        ) from exc


def _torch_file(path: Path) -> Checkpoint:
    data = _torch_load(path)
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        step = data.get("step")
        return Checkpoint(
            dict(data["model"]),
            data.get("optimizer"),
            False,
            int(step) if isinstance(step, int) else None,
            f"torch.save file {path}",
        )
    if isinstance(data, dict) and all(isinstance(v, torch.Tensor) for v in data.values()):
        return Checkpoint(dict(data), None, False, None, f"torch.save file {path}")
    raise DumpError(f"{path} holds neither a state dict nor {{'model': state_dict, 'optimizer': ...}}")


def _hf_directory(path: Path) -> Checkpoint:
    weights = next(
        (path / n for n in ("model.safetensors", "pytorch_model.bin", "model.pt") if (path / n).is_file()), None
    )
    if weights is None:
        raise DumpError(
            f"{path} is not a checkpoint directory forensics reads: no model.safetensors, "
            "pytorch_model.bin or model.pt (nor a forensics dump)"
        )
    model = _safetensors(weights) if weights.suffix == ".safetensors" else _torch_load(weights)
    optimizer = next((path / n for n in ("optimizer.pt", "optimizer.bin") if (path / n).is_file()), None)
    step = None
    state = path / "trainer_state.json"
    if state.is_file():
        try:
            step = int(json.loads(state.read_text())["global_step"])
        except (ValueError, KeyError, TypeError):
            step = None
    return Checkpoint(
        dict(model), _torch_load(optimizer) if optimizer else None, False, step, f"checkpoint directory {path}"
    )


@dataclass
class DataRecipe:
    dataset: Any
    collate: Callable[[list], Any]

    def batch(self, ids: list) -> Any:
        try:
            return self.collate([self.dataset[i] for i in ids])
        except Exception as exc:  # the user's dataset on recorded ids
            raise RecipeError(
                f"the data recipe could not rebuild a micro-batch from sample ids {ids[:8]}: "
                f"{type(exc).__name__}: {str(exc)[:200]}"
            ) from exc


def data_recipe(
    recipe: dict | None, trust: bool, sys_path: list[str], job_dirs: tuple[str, ...] | list[str] = ()
) -> DataRecipe:
    """The dump's data recipe (trust only); `sys_path` (--path) in front of sys.path, `job_dirs` (the job's recorded
    directories) served after every other way to import (forensics.replay.load.recipe)."""
    if not recipe:
        raise RecipeError(
            "the dump has no data recipe, so the recorded steps' micro-batches cannot be rebuilt: "
            "set GuardConfig(dumping=DumpConfig(data_recipe={'dataset': 'pkg.mod:make_dataset', ...})) in the job"
        )
    if not trust:
        raise RecipeError(
            f"the dump's data recipe imports {recipe.get('dataset')!r}"
            + (f" and {recipe.get('collate')!r}" if recipe.get("collate") else "")
            + "; pass --trust to allow it (it runs that code)"
        )
    make = import_object(recipe["dataset"], "data recipe", sys_path, job_dirs)
    collate = (
        import_object(recipe["collate"], "collate function", sys_path, job_dirs)
        if recipe.get("collate")
        else torch.utils.data.default_collate
    )
    return DataRecipe(make(**(recipe.get("dataset_kwargs") or {})), collate)


@dataclass
class StepOutcome:
    step: int
    recorded_loss: float | None
    replayed_loss: float | None
    recorded_grad_norm: float | None
    replayed_grad_norm: float | None
    weights_finite: bool | None
    relative_change: float | None
    broke: str | None = None
    """Why this step broke the run (None: it did not)."""
    raised: dict | None = None
    """The step raised: the exception, in the manifest's `exception` form."""

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "raised"}


def replay_window(
    session: ReplaySession,
    dump: Any,
    checkpoint: Checkpoint,
    start: int,
    data: DataRecipe,
    progress: Callable[[str], None],
    through_dumped: bool = False,
) -> tuple[list[StepOutcome], ReplaySession | None]:
    """Re-executes steps start .. dump.step - 1 from the checkpoint (.. dump.step itself with `through_dumped`: a
    dump without pre-step state, whose step is rebuilt from its sample IDs). Returns each step's outcome and, for
    the step that broke the run (the last outcome, with `broke` set), a ReplaySession of that step from its
    pre-step state; None when no step broke (with `through_dumped`: the dumped step's session, whatever it did)."""
    rows = {row["step"]: row for row in dump.window()}
    needed = list(range(start, dump.step))
    if through_dumped:
        rows[dump.step] = dumped_row(dump)
        needed.append(dump.step)
    missing = [s for s in needed if s not in rows]
    if missing:
        held = f"steps {min(rows)}..{max(rows)}" if rows else "no steps"
        raise DumpError(
            f"the dump's flight recorder holds {held}; replaying from step {start} needs steps "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}. Use a checkpoint taken later, or "
            "raise GuardConfig.recording.window_steps"
        )
    model = session.model
    _load_weights(model, checkpoint)
    optimizer = _optimizer(session, checkpoint)
    max_norm = (dump.manifest.get("window") or {}).get("max_grad_norm")
    outcomes: list[StepOutcome] = []
    for step in needed:
        row = rows[step]
        progress(f"window replay: step {step} ({step - start + 1} of {len(needed)})")
        batches = [to_device(data.batch(ids), session.device) for ids in _ids(row, step)]
        pre_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
        pre_optimizer = copy.deepcopy(optimizer.state_dict())
        set_lr(optimizer, row.get("lr"))
        outcome, grads_ok = run_step(model, optimizer, session, batches, row, max_norm)
        outcomes.append(outcome)
        if outcome.broke or step == dump.step:
            model.load_state_dict(pre_model)
            optimizer.load_state_dict(pre_optimizer)
            set_lr(optimizer, row.get("lr"))  # load_state_dict put back the lr of before this step's set_lr
            broken = _step_session(
                session,
                model,
                optimizer,
                batches,
                row,
                outcome,
                outcomes,
                grads_ok,
                dump.trigger if step == dump.step else None,
            )
            broken.followup = Followup(
                row, data, max_norm, pre_model, _following_steps(dump, rows, step, data, session.device)
            )
            return outcomes, broken
    return outcomes, None


def dumped_row(dump: Any) -> dict:
    """The dumped step as a flight-recorder row: its sample IDs and RNG from the dump, its lr from the history."""
    history = dump.history()
    steps, rates = history.get("step") or [], history.get("lr") or []
    lr = rates[-1] if steps and steps[-1] == dump.step and len(rates) == len(steps) else None
    loss = dump.manifest.get("loss") or {}
    return {
        "step": dump.step,
        "sample_ids": [dump.sample_ids(i) or None for i in range(dump.num_micro_batches)],
        "rng": [dump.rng_state(i) for i in range(dump.num_micro_batches)],
        "lr": lr,
        "divisor": loss.get("divisor"),
        "loss": loss.get("step_loss"),
        "grad_norm": loss.get("grad_norm"),
    }


FOLLOWING_STEPS = 3
"""How many recorded steps after the broken one a remedy is carried over (replay/judge/remedy_followup.py)."""


@dataclass
class Followup:
    """What carrying a remedy over the steps after the broken one needs (replay/judge/remedy_followup.py)."""

    row: dict
    """The broken step's flight-recorder row."""
    data: DataRecipe
    max_norm: float | None
    pre_model: dict[str, torch.Tensor]
    """The broken step's pre-step weights and buffers."""
    steps: list[tuple[dict, list]]
    """The next recorded steps (at most FOLLOWING_STEPS, the dumped step included): (row, micro-batches)."""


def _following_steps(
    dump: Any, rows: dict[int, dict], broke: int, data: DataRecipe, device: torch.device
) -> list[tuple[dict, list]]:
    """Up to FOLLOWING_STEPS steps after `broke`: from the flight recorder, then the dumped step itself (its
    micro-batches and RNG are in the dump; its lr is the history's last)."""
    out = []
    for step in range(broke + 1, min(broke + 1 + FOLLOWING_STEPS, dump.step)):
        out.append((rows[step], [to_device(data.batch(ids), device) for ids in _ids(rows[step], step)]))
    if len(out) < FOLLOWING_STEPS and broke < dump.step and not dump.state_missing:
        out.append((dumped_row(dump), [to_device(dump.micro_batch(i), device) for i in range(dump.num_micro_batches)]))
    return out


def _ids(row: dict, step: int) -> list[list]:
    ids = row["sample_ids"]
    if any(i is None for i in ids):
        raise DumpError(
            f"step {step} of the flight recorder has micro-batches without sample IDs (the loop passed "
            "none and the batch had no 'sample_ids' field): its data cannot be rebuilt"
        )
    return ids


def run_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    session: ReplaySession,
    batches: list,
    row: dict,
    max_norm: float | None,
    fp32: bool = False,
) -> tuple[StepOutcome, bool]:
    """One recorded step: forward / backward of each micro-batch with its RNG, clipping, the update; the outcome
    says whether (and why) it broke the run, and the flag whether the gradients were finite."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    losses = []
    dtype = None if fp32 else session.autocast_dtype
    try:
        for batch, rng in zip(batches, row["rng"]):
            restore_rng(
                rng, session.source_cuda_device, session.device.index if session.device.type == "cuda" else None
            )
            autocast = (
                torch.autocast(session.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
            )
            with autocast:
                loss = session.loss_fn(model, batch)
            losses.append(float(loss.detach()))
            (loss / float(row.get("divisor") or len(batches))).backward()
    except Exception as exc:  # noqa: BLE001 - a recorded step that raises is what broke the run (the user's code)
        outcome = StepOutcome(row["step"], row.get("loss"), None, row.get("grad_norm"), None, None, None)
        outcome.broke = f"it raises {type(exc).__name__} ({str(exc).splitlines()[0][:160] if str(exc) else ''})"
        outcome.raised = _raised(exc)
        return outcome, False
    step_loss = sum(losses) / float(row.get("divisor") or len(batches))
    norm = total_grad_norm(p.grad for p in model.parameters() if p.grad is not None)
    grad_norm = float(norm) if norm is not None else None
    outcome = StepOutcome(row["step"], row.get("loss"), step_loss, row.get("grad_norm"), grad_norm, None, None)
    if not math.isfinite(step_loss) or grad_norm is None or not math.isfinite(grad_norm):
        outcome.broke = "its loss or gradients are non-finite"
        return outcome, False
    if isinstance(max_norm, (int, float)) and max_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    params = list(model.parameters())
    outcome.weights_finite = not any(any_nonfinite(p.detach() for p in params))
    moved = sum(float((p.detach() - b).float().pow(2).sum()) for p, b in zip(params, before))
    size = sum(float(b.float().pow(2).sum()) for b in before)
    outcome.relative_change = relative_change(moved, size)
    if not outcome.weights_finite:
        outcome.broke = "its update made weights non-finite"
    elif outcome.relative_change > WRECK_RATIO:
        outcome.broke = f"its update moved the weights by {outcome.relative_change:.0%} of their norm"
    return outcome, True


def _raised(exc: BaseException) -> dict:
    """A step that raised during a window replay, in the manifest's `exception` form (what its replay compares)."""
    frames = traceback.extract_tb(exc.__traceback__)[-40:]
    return {
        "type": type(exc).__name__,
        "message": str(exc)[:4000],
        "during": Phase.FORWARD.value,
        "frames": [{"file": f.filename, "line": f.lineno, "function": f.name} for f in frames],
    }


def _step_session(
    session: ReplaySession,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list,
    row: dict,
    outcome: StepOutcome,
    outcomes: list[StepOutcome],
    grads_ok: bool,
    dumped_trigger: Trigger | None = None,
) -> ReplaySession:
    """A ReplaySession of the step that broke the run (or of the dumped step, with its own `dumped_trigger`), from
    its pre-step state (model and optimizer as they were)."""
    exception = None
    if dumped_trigger is not None:
        trigger = dumped_trigger
        exception = session.exception
    elif outcome.raised is not None:
        trigger = Trigger(TriggerKind.EXCEPTION)
        exception = outcome.raised
    elif not grads_ok:
        trigger = Trigger(
            TriggerKind.NONFINITE_LOSS
            if not math.isfinite(outcome.replayed_loss or math.nan)
            else TriggerKind.NONFINITE_GRAD,
            outcome.replayed_loss,
        )
    elif not outcome.weights_finite:
        trigger = Trigger(TriggerKind.NONFINITE_PARAM, math.nan)
    else:
        earlier = sorted(o.replayed_grad_norm for o in outcomes[:-1] if o.replayed_grad_norm is not None)
        typical = earlier[len(earlier) // 2] if earlier else (outcome.replayed_grad_norm or 1.0) / 10
        trigger = Trigger(
            TriggerKind.GRAD_NORM_SPIKE,
            outcome.replayed_grad_norm,
            3 * typical,
            update_change=outcome.relative_change if outcome.broke else None,
        )
    if outcome.broke:
        trigger = dataclasses.replace(trigger, detail=f"window replay: step {outcome.step}: {outcome.broke}")
    step_session = session_from_objects(
        model,
        batches,
        session.loss_fn,
        optimizer,
        device=session.device,
        sample_ids=[list(ids) for ids in row["sample_ids"]],
        rng_states=row["rng"],
        loss_divisor=float(row.get("divisor") or len(batches)),
        autocast=session.autocast,
        trigger=trigger,
        recorded_losses=[None] * len(batches),
        recorded_grad_norm=outcome.recorded_grad_norm,
    )
    step_session.capture_environment = session.capture_environment
    step_session.warnings = list(session.warnings)
    step_session.exception = exception
    return step_session


def _load_weights(model: torch.nn.Module, checkpoint: Checkpoint) -> None:
    state = model.state_dict()
    missing = [n for n, _ in model.named_parameters() if n not in checkpoint.model]
    if missing:
        raise RecipeError(
            f"the checkpoint ({checkpoint.source}) has no weights for {missing[:5]}: it is not a "
            "checkpoint of this model"
        )
    with torch.no_grad():
        for name, tensor in checkpoint.model.items():
            if name in state:
                if tuple(state[name].shape) != tuple(tensor.shape):
                    raise RecipeError(
                        f"the checkpoint's {name} is {tuple(tensor.shape)}, the model's {tuple(state[name].shape)}"
                    )
                state[name].copy_(tensor)


def _optimizer(session: ReplaySession, checkpoint: Checkpoint) -> torch.optim.Optimizer:
    """The dump's optimizer class and hyper-parameters, with the checkpoint's state (fresh state, with a warning,
    when the checkpoint holds none)."""
    from forensics.replay.load.optimizer_state import OptimizerSnapshot

    snapshot = session.optimizer
    if snapshot is None:
        raise ReplayError("the dump holds no optimizer state, so the recorded updates cannot be re-applied")
    if checkpoint.optimizer is not None and checkpoint.by_name:
        return OptimizerSnapshot(snapshot.cls, snapshot.param_groups, checkpoint.optimizer["state"]).build(
            session.model
        )
    optimizer = OptimizerSnapshot(snapshot.cls, snapshot.param_groups, {}).build(session.model)
    if checkpoint.optimizer is None:
        session.warnings.append(
            "the checkpoint holds no optimizer state: the window replay starts the optimizer "
            "afresh (Adam moments at zero), so its trajectory only approximates the job's"
        )
        return optimizer
    try:
        optimizer.load_state_dict(checkpoint.optimizer)
    except Exception as exc:  # a state dict of another optimizer layout
        raise RecipeError(
            f"the checkpoint's optimizer state does not fit a {snapshot.class_path} over this model "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc
    return optimizer


def set_lr(optimizer: torch.optim.Optimizer, lr: Any) -> None:
    """The recorded lr of the step (the first group's; other groups keep their ratio to it)."""
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not optimizer.param_groups:
        return
    base = optimizer.param_groups[0].get("lr")
    for group in optimizer.param_groups:
        ratio = group["lr"] / base if isinstance(base, (int, float)) and base else 1.0
        group["lr"] = lr * ratio


def window_block(outcomes: list[StepOutcome], start: int, dumped_step: int, checkpoint: Checkpoint) -> dict:
    broke = outcomes[-1] if outcomes and outcomes[-1].broke else None
    return {
        "checkpoint": checkpoint.source,
        "from_step": start,
        "dumped_step": dumped_step,
        "broke_at": broke.step if broke else None,
        "why": broke.broke if broke else None,
        "steps_before_crash": dumped_step - broke.step if broke else None,
        "steps": [o.as_dict() for o in outcomes],
    }
