"""The precursor monitor (GuardConfig.precursors): per-layer statistics that announce a divergence before the loss.

Large runs announce their spikes: attention logits and output logits drift up (Wortsman et al. 2023), one layer's
gradient norm or update/weight ratio grows for tens of steps, Adam's second moment vanishes so that updates jump
(Molybog et al. 2023). The monitor measures, for each repeated block of the model (found generically:
`find_blocks`, the largest ModuleList / ModuleDict / Sequential of one class), on every `PrecursorConfig.every`-th step
(forensics.core.kinds.PrecursorStatistic; capture/precursors/statistics.py computes them):

* block output RMS and abs-max (a forward hook on the block; the forward statistics are of the sampled step's
  first micro-batch);
* attention-logit bound: max|q| x max|k| / sqrt(head_dim), from hooks on the block's query and key projections
  (children of one attention module: `q_proj` / `k_proj`, `query` / `key`, torchtitan's `wq` / `wk` and the others of
  precursor_stats.QK_PROJECTIONS, or GPT-2's fused `c_attn`; the head size the attention module states, else the
  config's). It is an upper bound of max |q.k|/sqrt(d) —
  rotary embeddings keep each head's norm, so it holds for RoPE models too — and not the logit itself;
* output-logit abs-max (a hook on the model's output projection: `get_output_embeddings()`, else a direct child named
  `lm_head`, `output` or `head`);
* gradient norm of the block's weight matrices (its trainable parameters of >= 2 dimensions: biases and norm gains
  left out, `precursor_stats.block_weights`; at check(), before the optimizer step);
* update/weight ratio ||lr x update|| / ||W|| and the Adam second-moment floor (min of exp_avg_sq) of the same
  weight matrices, at check() from the optimizer state the previous step left: the update is Adam's bias-corrected m
  / (sqrt(v) + eps) (weight decay left out) or SGD's momentum buffer / gradient, at the learning rate of the step
  being checked; other optimizers give neither.

With several ranks each rank judges its own view: its micro-batches' forward statistics and, with sharded parameters
(FSDP2, tensor parallel: DTensors), its local shards' gradient / update statistics — no collective is added. A firing
dumps the rank's step alone when its dump holds the whole state (DDP); when it would not (a state sharded over the
ranks), the next check()'s all-reduce, which every step makes anyway, carries one more number and every rank dumps
that step together (the firing rank's trigger names the layer, the others' have local false).
No host sync of its own: a sampled step's values end in one device row, queued after that step's check() transfer
(so its device work overlaps the optimizer step and the next forward) and read with the next check()'s own
device->host transfer (capture/detection/sync.py; with several ranks, one small read after the step's all-reduce, of a row
done long since). A statistic is thus judged, and a precursor dumped, one step after the sampled step. On the other
steps the hooks return after one flag check. `RobustTrend` judges each statistic on the host over the sampled steps:
its log against the running median of the recent healthy values, in robust standard deviations (1.4826 x MAD),
sustained for a few sampled steps (forensics/core/trend.py, which replay uses to rank them too). When one fires, the
Guard dumps the step (TriggerKind.PRECURSOR, policy 'continue') and the job goes on; the statistics of the last
`history` sampled steps travel in the dump as `precursors.json` (capture/recording/window.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from forensics.capture.config import PrecursorConfig
from forensics.capture.precursors.statistics import StepStatistics
from forensics.capture.recording.history import History
from forensics.capture.recording.incident import Incident, StepRecord, Trigger
from forensics.capture.recording.window import FlightRecorder
from forensics.capture.state.source import StateSource
from forensics.core import headroom
from forensics.core.headroom import LimitWatch
from forensics.core.kinds import Policy, PrecursorRule, PrecursorStatistic, TriggerKind
from forensics.core.trend import TINY, RobustTrend

log = logging.getLogger(__name__)

NEVER = 1 << 62  # `every` of a monitor turned off: no step is sampled again


@dataclass
class Firing:
    """One statistic that left its baseline for `sustained` steps."""

    layer: str
    statistic: PrecursorStatistic
    step: int
    started: int
    """The first step of the excursion."""
    value: float
    baseline: float
    """The median of the healthy values before it."""
    z: float
    rule: PrecursorRule = PrecursorRule.GROWTH
    """Which rule fired: the relative growth (above), or the dtype's limit (forensics/core/headroom.py: then `baseline`
    is the threshold it crossed and `words` says how close to the limit it is)."""
    words: str = ""

    def as_dict(self) -> dict:
        return {
            "layer": self.layer,
            "statistic": self.statistic.value,
            "step": self.step,
            "started": self.started,
            "value": self.value if math.isfinite(self.value) else None,
            "baseline": self.baseline,
            "z": self.z,
            "rule": self.rule.value,
            **({"words": self.words} if self.words else {}),
        }

    @property
    def detail(self) -> str:
        if self.rule is not PrecursorRule.GROWTH:
            return self.words
        direction = "above" if self.statistic.rising else "below"
        ratio = self.value / self.baseline if self.statistic.rising else self.baseline / max(self.value, TINY)
        return (
            f"{self.statistic.words} of {self.layer} has stayed {direction} its baseline since step "
            f"{self.started}: {self.value:.4g} vs median {self.baseline:.4g} ({ratio:.3g}x, robust z {self.z:.1f})"
        )


class PrecursorMonitor:
    """The precursor monitor of one Guard (GuardConfig.precursors): which steps are sampled, the host-side trends
    and what fired. The statistics themselves are capture/precursors/statistics.py's."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: PrecursorConfig, scaler: Any = None
    ):
        self.config = config
        self.every = config.every
        self.stats = StepStatistics(model, optimizer, config.attention, config.optimizer, scaler)
        if not self.stats.blocks:
            log.warning(
                "forensics: precursors: the model has no ModuleList / ModuleDict / Sequential of repeated "
                "blocks; only the output logits are watched"
            )
        self.handles = self.stats.handles
        self.columns: list[tuple[str, PrecursorStatistic]] = self.stats.columns
        """What each value of a row is: (layer, statistic)."""
        self.trends = [
            RobustTrend(
                config.window,
                config.warmup_samples,
                config.sustained,
                config.z_threshold,
                config.min_growth,
                stat.rising,
            )
            for _, stat in self.columns
        ]
        self.limits: dict[int, LimitWatch] = {}
        """Per column measured in a low-precision dtype (known from the first sampled step): its headroom and
        trend against that dtype's limit (forensics/core/headroom.py)."""
        self._limit_fired: set[tuple[int, PrecursorRule]] = set()  # each column's limit rules fire once per run
        self._unhealthy: set[int] = set()
        """Recent steps the Guard did not find healthy (their statistics' overflow is that step's own incident)."""
        self.meta = self.describe()
        """`precursors.json`'s columns and settings, kept by the flight recorder: each column's dtype and limit
        are added once known."""
        self._checks = 0
        self.stats.active = True  # the first step is sampled
        self._fired: dict[tuple[str, PrecursorStatistic], int] = {}
        self._pending: list[Firing] = []
        self.deferred: Firing | None = None
        """A firing read at a step that was an incident of its own (a spike, a skipped step): dumped at the next
        healthy step instead."""
        self.awaiting: Firing | None = None
        """A firing this rank chose to dump while its state is sharded: the next check()'s all-reduce tells every
        rank, and all dump that step together (`agreed_trigger`)."""
        self._launched: tuple[int, torch.Tensor] | None = None
        """(step, row) of the last sampled step, queued on the device, not yet read."""
        self.recorder: FlightRecorder | None = None
        """The Guard's flight recorder (capture/recording/window.py), which keeps the rows read from the device."""
        self.dumps = 0
        self.firings: list[Firing] = []
        """Every firing of the run, dumped or not."""

    # -- at check(): the transfer reads the row launched at an earlier check(), then this step's is launched ------
    def pending_row(self) -> torch.Tensor | None:
        """The row of the last sampled step, launched after that step's transfer and done on the device long since:
        it travels with this check()'s one transfer. None when there is none to read."""
        return self._launched[1] if self._launched is not None else None

    def launch_row(self, step: int) -> None:
        """After check()'s transfer: when `step` was sampled, queues its row on the device (gradients and optimizer
        state as they are before the optimizer step, whose kernels come later in stream order) to be read by the
        next check(); arms the hooks for the next step. Launched here rather than before the transfer, its device
        work overlaps the optimizer step and the next forward instead of lengthening the wait for the transfer.
        Never raises: a failure turns the monitor off."""
        sampled, self._checks = self.stats.active, self._checks + 1
        self.stats.active = False
        if self.stats.failed:  # a hook failed during the step (and logged why)
            self.off()
            return
        if sampled:
            try:
                self._launched = (step, self.stats.row())
            except Exception:  # a statistic is a convenience; the job goes on
                log.exception("forensics: precursors: the statistics failed; the monitor is off for this run")
                self.off()
                return
        self.stats.active = self._checks % self.every == 0

    def receive(self, values: list[float | None]) -> None:
        """The host values of `pending_row()`: recorded and judged under the step they were measured at; what fired
        waits for `take_firings`. Never raises (it runs inside check(), before the step's own detectors)."""
        if self._launched is None:
            return
        step, self._launched = self._launched[0], None
        try:
            self._judge(step, values)
        except Exception:  # a statistic is a convenience; the job goes on
            log.exception("forensics: precursors: step %d could not be judged; the monitor is off", step)
            self.off()

    def _judge(self, step: int, values: list[float | None]) -> None:
        clean = [v if v is not None and math.isfinite(v) else None for v in values]
        if self.recorder is not None:
            self.recorder.note_precursors(step, clean)
        fired = []
        for (layer, stat), trend, value in zip(self.columns, self.trends, clean):
            found = trend.observe(step, value)
            if found is not None:
                fired.append(Firing(layer, stat, step, found.started, found.value, found.baseline, found.z))
        fired += self._judge_limits(step, values)
        # the dtype's limit first (the hard evidence), then the earliest start
        fired.sort(key=lambda f: (f.rule is PrecursorRule.GROWTH, f.started, -f.z))
        self.firings += fired
        self._pending = fired

    def _judge_limits(self, step: int, values: list[float | None]) -> list[Firing]:
        """The headroom / trend / non-finite rules (forensics/core/headroom.py) of the columns measured in a
        low-precision dtype; a column's watch starts once a sampled step has shown its dtype."""
        fired = []
        healthy = step not in self._unhealthy
        for j, ((layer, stat), value) in enumerate(zip(self.columns, values)):
            watch = self.limits.get(j)
            if watch is None:
                if stat not in headroom.LIMITED or (layer, stat) not in self.stats.dtypes:
                    continue
                dtype = headroom.known_dtype_name(self.stats.dtypes[(layer, stat)])
                limit = headroom.limit_of(stat, dtype, self.stats.measured_head_dim)
                self.meta["columns"][j]["dtype"] = dtype
                if limit is None:
                    continue
                watch = self.limits[j] = LimitWatch(limit, self.config.warmup)
                self.meta["columns"][j]["limit"] = limit.value
                self.meta["columns"][j]["limit_words"] = limit.words
            value = None if value is None or float(value) == -math.inf else float(value)  # -inf: not measured
            alarm = watch.observe(step, value, healthy)
            if alarm is None or (j, alarm.rule) in self._limit_fired:
                continue
            self._limit_fired.add((j, alarm.rule))
            if alarm.rule is not PrecursorRule.NONFINITE:  # once close to the limit, only an overflow says more
                self._limit_fired.update({(j, PrecursorRule.HEADROOM), (j, PrecursorRule.TREND)})
            started = step - (alarm.span or 0)
            baseline = {
                PrecursorRule.HEADROOM: headroom.HEADROOM * alarm.limit.value,
                PrecursorRule.TREND: alarm.value / (alarm.growth or 1.0),
            }.get(alarm.rule, alarm.limit.value)
            fired.append(
                Firing(
                    layer,
                    stat,
                    step,
                    started,
                    alarm.value,
                    baseline,
                    0.0,
                    alarm.rule,
                    headroom.describe_alarm(alarm, f"the {stat.words} of {layer}"),
                )
            )
        return fired

    def note_step(self, step: int, healthy: bool) -> None:
        """check()'s verdict on `step`: the statistics of a step that was itself an incident (or skipped) do not
        fire the non-finite rule."""
        if not healthy:
            self._unhealthy.add(step)
            if len(self._unhealthy) > 64:
                self._unhealthy = {s for s in self._unhealthy if s > step - 64}

    def take_firings(self) -> list[Firing]:
        """What fired when this check() read the last sampled step's row (once; [] when it read none)."""
        fired, self._pending = self._pending, []
        return fired

    def off(self) -> None:
        """No step is sampled again; the hooks are removed."""
        self.every = NEVER
        for handle in self.handles:
            handle.remove()

    def describe(self) -> dict:
        """The columns and settings `precursors.json` states (docs/DUMP_FORMAT.md)."""
        c = self.config
        return {
            "columns": [{"layer": layer, "statistic": stat.value} for layer, stat in self.columns],
            "config": {
                "every": c.every,
                "window": c.window,
                "warmup": c.warmup,
                "sustained": c.sustained,
                "z_threshold": c.z_threshold,
                "min_growth": c.min_growth,
                "head_dim": self.stats.measured_head_dim,
            },
        }

    def to_dump(self, firings: list[Firing], step: int) -> Firing | None:
        """The firing to dump at `step` (None: none may): the earliest-starting one whose (layer, statistic) did
        not fire within min_gap steps, within max_dumps (counted where a dump is made: `watch`, `agreed_trigger`).
        Every firing of the step is marked as seen."""
        chosen = None
        for firing in firings:
            key = (firing.layer, firing.statistic)
            last = self._fired.get(key)
            if last is not None and step - last < self.config.min_gap:
                continue
            self._fired[key] = step
            if chosen is None:
                chosen = firing
        if chosen is None or self.dumps >= self.config.max_dumps:
            return None
        return chosen


def agreed_trigger(monitor: PrecursorMonitor | None, agreement: Any, other: bool) -> Trigger | None:
    """check()'s precursor step on ranks whose state is sharded: when the step's all-reduce says some rank's
    precursor fired at its last check (`PrecursorMonitor.awaiting`) and no other trigger fired, the trigger every
    rank dumps this step with (policy 'continue'): the firing rank's names the layer, the others' say another rank's
    fired (local false) — a rank whose monitor could not be set up included, as a collective write needs every rank.
    The waiting firing is cleared either way. Never raises."""
    firing = None
    if monitor is not None:
        firing, monitor.awaiting = monitor.awaiting, None
    if other or agreement is None or not getattr(agreement, "precursor", False):
        return None
    if monitor is not None:
        monitor.dumps += 1
    if firing is not None:
        return Trigger(TriggerKind.PRECURSOR, firing.value, firing.baseline, None, firing.detail)
    return Trigger(
        TriggerKind.PRECURSOR,
        None,
        None,
        None,
        "another rank's per-layer statistics kept growing (its dump names the layer)",
        local=False,
    )


def judge(
    monitor: PrecursorMonitor,
    step: int,
    record: StepRecord,
    *,
    healthy: bool,
    dumped: bool,
    state: StateSource,
    history: History,
    report: Callable[[Incident], Any],
) -> None:
    """Guard.check()'s precursor step: when a statistic fired in the row this check() read (the last sampled
    step's: this step's or one before it) on a `healthy` step, `report`s the Incident that dumps this step under
    policy 'continue' — unless it was `dumped` already for an incident of its own (the next step then) or one rank's
    dump would not hold the whole state (sharded over the ranks: FSDP2, ZeRO, tensor parallel, DumpConfig.state_layout
    "sharded"): the firing then waits (`awaiting`), the next check()'s all-reduce tells every rank, and all dump
    that step together (`agreed_trigger`). Never raises."""
    try:
        incident = _incident(monitor, step, record, healthy, dumped, state, history)
        if incident is not None:
            report(incident)
    except Exception:  # capture must never stop a healthy job
        log.exception("forensics: precursors: step %d could not be judged", step)


def _incident(
    monitor: PrecursorMonitor,
    step: int,
    record: StepRecord,
    healthy: bool,
    dumped: bool,
    state: StateSource,
    history: History,
) -> Incident | None:
    if not healthy:
        monitor.note_step(step, healthy=False)
    firings = monitor.take_firings()
    deferred, monitor.deferred = monitor.deferred, None
    if not firings and deferred is None:
        return None
    for firing in firings:
        log.warning("forensics: step %d: precursor: %s", step, firing.detail)
    chosen = monitor.to_dump(firings, step) if firings else None
    recorder = monitor.recorder
    for firing in firings:
        if recorder is not None:
            recorder.note_precursor_firing({**firing.as_dict(), "dumped": firing is chosen})
    chosen = chosen or deferred
    if chosen is None or monitor.dumps >= monitor.config.max_dumps:
        return None
    if dumped:  # dumped already for an incident of its own: the next step then
        monitor.deferred = chosen
        return None
    if state.needs_every_rank:  # this rank's dump alone would not hold the state: all dump the next step
        monitor.awaiting = chosen  # counted by every rank when they do (agreed_trigger): the counts stay equal
        log.warning("forensics: precursor at step %d: every rank dumps the next step", step)
        return None
    monitor.dumps += 1
    trigger = Trigger(TriggerKind.PRECURSOR, chosen.value, chosen.baseline, None, chosen.detail)
    losses = [
        float(v.float().mean()) if isinstance(v, torch.Tensor) else float(v) for v in record.losses
    ]  # a few scalars, read only when a precursor fires
    norm = history.to_dict()["grad_norm"][-1] if len(history) else None
    return Incident(
        trigger, step, record, losses, norm, record.divisor(state.config.detection.loss_divisor), Policy.CONTINUE
    )


def attach(
    model: torch.nn.Module,
    optimizer: Any,
    scaler: Any,
    config: PrecursorConfig | None,
    *,
    sync_free: bool,
    window: FlightRecorder,
    add_hook: Callable[[Any], None],
) -> PrecursorMonitor | None:
    """The monitor for GuardConfig.precursors (None: off, or refused with a warning); its hooks go to `add_hook`
    (the Guard removes them) and its rows to the flight recorder `window`."""
    if config is None:
        return None
    if sync_free:
        log.warning("forensics: precursors are off in the sync_free mode (their statistics are read at check())")
        return None
    try:
        monitor = PrecursorMonitor(model, optimizer, config, scaler)
    except Exception:
        log.exception("forensics: precursors: the monitor could not be set up; it is off")
        return None
    for handle in monitor.handles:
        add_hook(handle)
    monitor.recorder = window
    window.watch_precursors(monitor.meta, config.history)
    return monitor
