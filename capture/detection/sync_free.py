"""The Guard's sync-free check (GuardConfig.detection.sync_free; by default wherever the dumps stay exact): a step that
must not be applied is skipped on the device, and every step is judged one step later. In one process or across
ranks (their agreement all-reduce queued on the device, capture/detection/agreement.py launch()).

The synchronous check reads the step's losses and grad norm on the host before optimizer.step(), which stalls the
host until the GPU has finished backward, so the optimizer's and the next step's kernel launches are no longer hidden
behind GPU work (~1.3 % of a nanoGPT step on an H200: BENCHMARKS.md). Here, for optimizers whose step() honours the
`found_inf` / `grad_scale` attributes GradScaler sets (`_step_supports_amp_scaling`: fused Adam / AdamW / SGD /
Adagrad):

1. start() computes on the device a 0/1 `found_inf`: "a micro-batch loss or the grad norm is non-finite, or the step
   is a spike that the synchronous check would dump (or skip / raise on)". The spike thresholds are known before the
   step (the detectors' windows hold the steps before it) and so is whether the dump budget would take a spike here
   and of what size (DumpBudget.spike_floor); the device compares the step's numbers in float64, the same numbers the
   host judges later. It sets `optimizer.found_inf`, `optimizer.grad_scale = None`: the user's plain
   optimizer.step() then skips the update on the device when the flag is 1 (the fused kernel returns early and undoes
   the step counter it had just incremented: torch/optim/adam.py `_fused_adam`). A step post-hook removes both
   attributes, as GradScaler.step does with `del`.
2. start() also queues a non-blocking copy of the step's numbers and the flag into a pinned host buffer, records a
   CUDA event and returns without waiting.
3. resolve(), at the next check() (or Guard.flush() / close(), an uncaught exception, the interpreter's exit), reads
   the numbers (the event is long complete unless the host runs more than a step ahead), feeds the history, the
   flight recorder and the detectors, and reports the step's Incident. A step the device skipped was not applied, so
   the state at that moment IS its pre-step state: it is dumped with that step's micro-batches, RNG, losses, and the
   scheduler state and optimizer hyper-parameters saved at its check. A spike the budget would not dump was applied
   and is only counted, as the synchronous check counts it.
"""

from __future__ import annotations

import logging
import math
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch

from forensics.capture.detection.agreement import Agreement, agreed_on_device, device_scalar, launch, settle
from forensics.capture.state.run_id import collective_device
from forensics.capture.detection.detectors import StepDetectors, clipped
from forensics.capture.config import GuardConfig
from forensics.capture.recording.history import History
from forensics.capture.recording.incident import Incident, Undumpable, StepRecord
from forensics.capture.recording.window import FlightRecorder, WindowStep
from forensics.capture.state import sharding, snapshot
from forensics.capture.state.source import StateSource
from forensics.core.device_sync import DeviceFence, quarantine
from forensics.core.kinds import Policy
from forensics.core.thirdparty import optimizer_honours_found_inf

log = logging.getLogger(__name__)

LATE = (
    " (sync-free check: judged one step late, at the next step's check; this step's update was skipped on the device)"
)
HELD = (
    " (sync-free check: judged one step late, at the next step's check; its update was held back on the device so that "
    "the dump holds its exact pre-step state: this one batch is not trained on)"
)
SPIKE_APPLIED = Undumpable(
    "sync-free check: its update was applied before it was judged",
    "sync_free",
    "the sync-free check does not dump a spike the dump budget had no place for when its update was applied",
)


@dataclass
class DeviceRow:
    """One process: a step's numbers on the device as the host buffer reads them, `[*losses (n), grad norm (NaN:
    none), step loss, skipped (0 / 1)]` in float64, with the views the check writes through made once. Reused step
    after step: start() writes it only after resolve() waited for the copy out of it (the last step's fence), so no
    step's copy reads the next step's numbers, whatever stream either ran on."""

    n: int
    row: torch.Tensor
    values: torch.Tensor  # [*losses, grad norm]
    losses: torch.Tensor
    norm: torch.Tensor  # 0-dim
    step_loss: torch.Tensor  # 0-dim
    skipped: torch.Tensor  # 0-dim

    @classmethod
    def make(cls, n: int, device: torch.device) -> "DeviceRow":
        row = torch.empty(n + 3, dtype=torch.float64, device=device)
        return cls(n, row, row[: n + 1], row[:n], row[n], row[n + 1], row[n + 2])


@dataclass
class Pending:
    """A step whose numbers are on their way to the host."""

    step: int
    record: StepRecord
    n_losses: int
    has_norm: bool
    buffer: torch.Tensor  # [*losses, grad norm, step loss, skipped] (float64) once `landed` is passed
    landed: DeviceFence  # passed once `buffer` holds the values (CPU: at once, the copy was synchronous)
    lr: float | None
    scheduler: dict | None
    hyper: list[dict]
    divisor: float
    sharded_norm: bool | None = None  # several ranks: `buffer` is agreement.launch()'s vector, then skipped; the
    # grad norm is a shard's (assembled by the all-reduce) when True
    pinned: bool = False  # `buffer` is pinned memory (a CUDA device's copy)
    overridden: bool = False  # another found_inf (a GradScaler the Guard was not given) replaced this step's flag


def held_back_notice(config: GuardConfig) -> str | None:
    """What the sync-free check does to the run's spike steps, said once at the first check (None: it holds none back:
    spikes skip or raise by the user's policy, or spike dumps are off)."""
    dumping = config.dumping
    if config.detection.on_spike is not Policy.CONTINUE or dumping.max_spike_dumps == 0:
        return None
    return (
        f"the sync-free check (a fused optimizer: no device->host read per step) holds back up to "
        f"{dumping.max_spike_dumps} spike steps per run to dump their exact pre-step state (DumpConfig."
        f"max_spike_dumps; after that only a spike larger than those kept, never two within "
        f"DumpConfig.min_spike_gap={dumping.min_spike_gap} steps): such a step's update is not applied, like a "
        "GradScaler overflow step, and each is logged when it happens. "
        "GuardConfig(detection=DetectionConfig(sync_free=False)) to apply every update (one device->host read "
        "per step)"
    )


def unsupported(config: GuardConfig, state: StateSource) -> str | None:
    """Why the sync-free check cannot run for this state and configuration (None: it can)."""
    optimizer, scaler = state.optimizer, state.scaler
    if not optimizer_honours_found_inf(optimizer):
        return (
            f"{type(optimizer).__name__} does not honour found_inf (only fused optimizers do, e.g. AdamW(fused=True))"
        )
    if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
        return "a GradScaler is enabled (it sets found_inf itself)"
    if config.detection.verify_update:
        return "verify_update copies the state before every step"
    if state.ranks.multi_rank:
        param = next((p for group in optimizer.param_groups for p in group["params"]), None)
        collective = collective_device()
        if param is not None and param.device.type != collective.type:
            return (
                f"the ranks agree over {collective.type} while the parameters are on {param.device.type}: "
                "reading across them would wait for the device"
            )
    return None


def not_by_default(config: GuardConfig, state: StateSource) -> str | None:
    """Why the default (DetectionConfig.sync_free None) keeps the synchronous check (None: it runs sync-free): what
    unsupported() says, or a setting whose behaviour the sync-free check would change."""
    reason = unsupported(config, state)
    if reason is not None:
        return reason
    if config.detection.on_nonfinite is Policy.CONTINUE:
        return "on_nonfinite='continue' applies a non-finite update, which the sync-free check would skip"
    if config.precursors is not None:
        return "the precursor monitor reads its statistics at check()"
    if config.recording.snapshot_every:
        return "host snapshots are taken at check()"
    if config.dumping.recheck:
        return "the in-job recheck runs at check()"
    if state.buffers.tracks_any():
        return (
            "the model has persistent buffers its forward may update (e.g. BatchNorm statistics): the next "
            "step's forward would reach them before the step is judged"
        )
    return None


class SyncFree:
    """Guard.check without a device->host sync; falls back to the synchronous check where it cannot run (one warning
    when it was asked for).

    `resolve()` judges the step started last and `start()` launches this one's; the Guard dumps the Incident resolve()
    returns and applies its policy.

    Args:
        config: the Guard's configuration; detectors: its StepDetectors; history, window: the recorders this check
            feeds; spike_floor: the dump budget's DumpBudget.spike_floor (capture/dumping/budget.py): the size a spike at
            a step must exceed to be dumped, asked before the step so the device knows whether its update must wait.
        state: the state source (optimizer, scheduler, grad norm, the pre-step state of a skipped step).
        add_hook: keeps the optimizer step hook this mode installs (the Guard removes it at close()).
    """

    def __init__(
        self,
        config: GuardConfig,
        detectors: StepDetectors,
        state: StateSource,
        history: History,
        window: FlightRecorder,
        spike_floor: Callable[[int], float | None],
        add_hook: Callable[[Any], None],
    ):
        self.config, self.detectors, self.state, self.history, self.window = config, detectors, state, history, window
        self.spike_floor, self.add_hook = spike_floor, add_hook
        self.pending: Pending | None = None
        self._active: bool | None = None  # decided at the first check
        self._flag: torch.Tensor | None = None  # the found_inf this check handed the optimizer for its next step
        self._row: DeviceRow | None = None  # one process: the device row start() writes the step's numbers into
        self._buffer: tuple[torch.Tensor, bool] | None = None
        """(pinned or not) The host buffer of the step judged last, free again (resolve() read it): the next step's copy reuses it
        instead of allocating pinned memory every step."""

    def active(self) -> bool:
        """Whether this Guard runs sync-free (decided once, at the first check; one warning if it was asked for and
        cannot)."""
        if self._active is None:
            asked = self.config.detection.sync_free is True
            reason = unsupported(self.config, self.state) if asked else not_by_default(self.config, self.state)
            self._active = reason is None
            if reason is None:
                self.add_hook(self.state.optimizer.register_step_post_hook(self._after_step))
                notice = held_back_notice(self.config)
                if notice is not None and self.state.ranks.rank == 0:
                    log.warning("forensics: %s", notice)
            elif asked:
                log.warning(
                    "forensics: GuardConfig.detection.sync_free is ignored: %s; using the synchronous check", reason
                )
            else:
                log.info("forensics: the synchronous check (one device->host read per step): %s", reason)
        return self._active

    def start(self, record: StepRecord, grad_norm: Any, step: int) -> None:
        """This step's half of the check (call only when active(), after resolve())."""
        state, optimizer = self.state, self.state.optimizer
        sharded = False
        if grad_norm is None:
            grad_norm, sharded = state.grad_norm(), state.sharded_grad_norm
        grad_norm = sharding.host_norm(grad_norm)
        param = next((p for group in optimizer.param_groups for p in group["params"]), None)
        device = param.device if param is not None else torch.device("cpu")
        n, has_norm = len(record.losses), grad_norm is not None
        divisor = record.divisor(self.config.detection.loss_divisor)
        if state.ranks.multi_rank:
            parts, skip = self._agreed_numbers(record, grad_norm, divisor, sharded, step)
            found_inf = skip.float()
            numbers = torch.cat([*parts, found_inf.reshape(1)])  # cat promotes the flag to float64 (no cast operator)
        else:
            numbers, skipped = self._own_numbers(record, grad_norm, divisor, device, step)
            found_inf = skipped.float()
        optimizer.found_inf = self._flag = found_inf  # the fused step skips the update (and undoes its count) when 1
        optimizer.grad_scale = None
        device = numbers.device
        pinned = device.type == "cuda"
        free, self._buffer = self._buffer, None
        if free is not None and free[1] == pinned and free[0].shape == numbers.shape:
            buffer = free[0]
        else:
            buffer = torch.empty(numbers.shape, dtype=torch.float64, pin_memory=pinned)
        buffer.copy_(numbers, non_blocking=pinned)
        hyper = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups
        ]
        self.pending = Pending(
            step,
            record,
            n,
            has_norm,
            buffer,
            DeviceFence([device] if pinned else []),
            snapshot.current_lr(optimizer),
            snapshot.scheduler_state(state.scheduler),
            hyper,
            divisor,
            sharded if state.ranks.multi_rank else None,
            pinned,
        )

    def _own_numbers(
        self, record: StepRecord, grad_norm: Any, divisor: float, device: torch.device, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One process: `[*losses, grad norm, step loss, skipped]` (float64, on the parameters' device), written into
        the row this check keeps (DeviceRow: no allocation, no view and no cat per step), and its skip flag (a view)."""
        n, has_norm = len(record.losses), grad_norm is not None
        row = self._row
        if row is None or row.n != n or row.row.device != device:
            row = self._row = DeviceRow.make(n, device)
        values = torch.stack([device_scalar(v, device) for v in [*record.losses, grad_norm if has_norm else None]])
        row.values.copy_(values)  # to float64, in place
        if n:
            torch.sum(row.losses, 0, out=row.step_loss)
            row.step_loss.div_(divisor)
        else:
            row.step_loss.zero_()
        skip = torch.isnan(((row.values if has_norm else row.losses) * 0).sum())  # a value not finite makes its
        # product with 0 NaN (3 operators, where ~isfinite(x).any() is 6: torch.isfinite is four)
        spike = self._spike_to_hold(row.step_loss if n else None, row.norm if has_norm else None, step)
        if spike is None:
            row.skipped.copy_(skip)
        else:
            torch.logical_or(skip, spike, out=row.skipped)
        return row.row, row.skipped

    def _agreed_numbers(
        self, record: StepRecord, grad_norm: Any, divisor: float, sharded: bool, step: int
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Several ranks: the agreement all-reduce queued (capture/detection/agreement.py launch(): `[*losses, grad norm,
        loss scale, *summed statistics]`) and the skip flag from the agreed numbers, identical on every rank."""
        launched = launch(
            [*record.losses, grad_norm, None],
            len(record.losses),
            divisor=divisor,
            min_loss_scale=self.config.detection.min_loss_scale,
            sharded_grad_norm=sharded,
        )
        fault, step_loss, norm = agreed_on_device(launched, sharded)  # NaN where no rank had one: no spike fires
        spike = self._spike_to_hold(step_loss, norm, step)
        return [launched], fault | spike if spike is not None else fault

    def _spike_to_hold(
        self, step_loss: torch.Tensor | None, norm: torch.Tensor | None, step: int
    ) -> torch.Tensor | None:
        """A device flag: the step is a spike whose update must wait for its judgment, because its dump needs the
        pre-step state (the budget takes it) or the policy skips or raises. Mirrors StepDetectors.detect: a loss spike
        is judged first; a grad-norm spike only when the loss did not spike. A NaN value (no rank had it) never fires.
        None: no spike can be held."""
        if self.config.detection.on_spike is Policy.CONTINUE:
            floor = self.spike_floor(step)  # None: the budget would dump no spike at this step
            if floor is None:
                return None
        else:
            floor = -math.inf
        detectors = self.detectors
        loss_limit, norm_limit = detectors.loss.threshold(), detectors.grad_norm.threshold()
        held = loss_fires = None
        if step_loss is not None and loss_limit is not None:
            loss_fires = step_loss > loss_limit
            held = _held(loss_fires, step_loss, loss_limit, floor)
        if norm is not None and norm_limit is not None:
            norm_held = _held(norm > norm_limit, norm, norm_limit, floor)
            if loss_fires is not None and floor != -math.inf:  # (any spike held: a loss spike is held itself, so
                norm_held = norm_held & ~loss_fires  # `held | norm_held & ~loss_fires` is `held | norm_held`)
            held = norm_held if held is None else held | norm_held
        return held

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step post-hook: the attributes apply to one step only (GradScaler deletes its own the same way). A flag
        that is not this check's means a GradScaler stepped the optimizer with its own found_inf: this step was not
        held back, and the check turns synchronous (said once) after judging it."""
        flag, self._flag = self._flag, None
        if flag is None:
            return
        if getattr(optimizer, "found_inf", None) is flag:
            for name in ("found_inf", "grad_scale"):
                if hasattr(optimizer, name):
                    delattr(optimizer, name)
        elif self.pending is not None:
            self.pending.overridden = True

    def quarantine(self) -> None:
        """A CUDA error poisoned the context: the pending step's pinned buffer is never freed (see
        forensics.core.device_sync.quarantine) and the step is not judged (its values can no longer be read)."""
        self._buffer = None  # (a buffer already read: no copy into it is pending)
        if self.pending is not None:
            quarantine([self.pending.buffer])
            self.pending = None

    def resolve(self, step: int) -> Incident | None:
        """Judges the pending step, if any (`step`: the one being checked now): history, flight recorder and
        detectors fed, its Incident returned when a detector fired."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.landed.wait()
        numbers = pending.buffer.tolist()
        self._buffer = pending.buffer, pending.pinned  # read: the next step's copy may reuse it
        n, skipped = pending.n_losses, numbers[-1] > 0 and not pending.overridden
        if pending.overridden:
            self._active = False
            log.warning(
                "forensics: step %d: the optimizer was stepped with another found_inf (a GradScaler the Guard "
                "was not given: Guard(model, optimizer, scaler=scaler)); the Guard could not hold a failing "
                "step back on the device and now reads each step before optimizer.step()",
                pending.step,
            )
        if pending.sharded_norm is None:
            norm = numbers[n] if pending.has_norm else None
            return self._judge(pending, numbers[:n], norm, numbers[n + 1] if n else None, skipped)
        shape = [0.0] * n + [0.0 if pending.has_norm else None, None]  # which values were None (settle() keeps them)
        host, agreed = settle(numbers[:-1], shape, n, pending.sharded_norm)
        losses = cast("list[float]", host[:n])
        return self._judge(pending, losses, host[n], sum(losses) / pending.divisor if losses else None, skipped, agreed)

    def _judge(
        self,
        pending: Pending,
        losses: list[float],
        norm: float | None,
        step_loss: float | None,
        skipped: bool,
        agreed: Agreement | None = None,
    ) -> Incident | None:
        detection = self.config.detection
        trigger = self.detectors.detect(losses, norm, step_loss, None, agreed)
        was_clipped = clipped(norm, detection.max_grad_norm)
        self.history.append(
            pending.step,
            step_loss,
            norm,
            pending.lr,
            None,
            was_clipped,
            skipped,
            self.detectors.note_suppressed(pending.step, fault=trigger is not None),
        )
        self.window.append(
            WindowStep(
                pending.step,
                list(pending.record.sample_ids),
                list(pending.record.rng),
                pending.lr,
                None,
                pending.divisor,
                step_loss,
                norm,
                was_clipped,
            )
        )
        if trigger is None:
            return None
        policy = self.config.policy_for(trigger.kind)
        incident = Incident(
            trigger,
            pending.step,
            pending.record,
            losses,
            norm,
            pending.divisor,
            policy,
            scheduler=pending.scheduler,
            hyper=pending.hyper,
            agreed=agreed is not None,
        )
        if not skipped and trigger.kind.spike:  # applied before it was judged: the budget had no place for it (asked
            # before the step), or a GradScaler's found_inf replaced the flag (it skips a non-finite step itself)
            floor = self.spike_floor(pending.step)
            limit = trigger.threshold if trigger.threshold is not None else math.inf  # a spike always has one
            if floor is None or policy is Policy.CONTINUE and not _larger(trigger.value, limit, floor):
                return incident  # the budget refuses it now too, and counts why, as for the synchronous check
            return dataclasses.replace(incident, undumpable=SPIKE_APPLIED)  # never a dump of the state after it
        late = HELD if trigger.kind.spike else LATE
        return dataclasses.replace(incident, trigger=dataclasses.replace(trigger, detail=trigger.detail + late))


def _larger(value: Any, limit: float, floor: float) -> Any:
    """Whether a spike of `value` (a float64 device scalar, or its host number) over `limit` is larger than `floor` by
    the dump budget's measure (capture/dumping/budget.py spike_size): the same float64 division on either side."""
    size = value / limit if limit > 0 else value
    return size > floor


def _held(fires: torch.Tensor, value: torch.Tensor, limit: float, floor: float) -> torch.Tensor:
    """`fires`, and the spike larger than `floor` (no operator when any spike is held)."""
    return fires if floor == -math.inf else fires & _larger(value, limit, floor)
