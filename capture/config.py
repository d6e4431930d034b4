"""Configuration of the in-job capture, one dataclass per stage: GuardConfig holds DetectionConfig, DumpConfig,
RecordConfig and PrecursorConfig (and accepts the flat spelling of one release ago, with a FutureWarning)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from forensics.format.location import Location, StorageTimeouts
from forensics.core.kinds import Policy, StateLayout, Tracker, TriggerKind


@dataclass
class PrecursorConfig:
    """Opt-in precursor monitor: GuardConfig(precursors=PrecursorConfig()).

    Only every `every`-th step is measured, and the trend is judged over those sampled steps: `window`,
    `sustained` and `history` count sampled steps; `warmup` and `min_gap` count training steps. Defaults are
    conservative: a statistic fires only after `warmup` steps, when its log stays more than `z_threshold` robust
    standard deviations above the median of the last `window` healthy sampled values AND at least `min_growth` x
    that median, for `sustained` consecutive sampled steps (with the defaults: 2x above the median of the last 32
    steps, seen at two samples 8 steps apart). Runs with a long learning-rate warm-up should set `warmup` to its
    length.
    """

    every: int = 8
    """Steps from one measured step to the next. A measured step costs ~5 ms on an H100 for GPT-2 small, whatever
    the step's size (per-block reductions and one pass over the optimizer state: BENCHMARKS.md, precursor_overhead);
    8 brings the amortised cost under 1 % even of a short step (0.8 % of 2 x 4 x 1024 tokens) while a growth that
    builds over tens of steps is still seen tens of steps ahead (tests/capture/test_precursors.py: 20-35 steps before
    the NaN). 1: every step."""
    window: int = 4
    """Healthy sampled values per statistic in the running median / MAD: 4 x every = the last 32 steps. What fires
    is growth faster than the baseline follows, so the window's span in steps sets the sensitivity: a longer span
    also fires on the slow, healthy growth of early training (6 samples did, on the tiny GPT-2 at learning rate
    0.3; with every=1 choose about 32)."""
    warmup: int = 64
    """Training steps before a statistic may fire: early training moves every statistic (a randomly initialised
    model's attention logits grow tens of times while it learns to attend), and that is not a precursor."""
    sustained: int = 2
    """Consecutive sampled steps above the baseline before it fires (2 x every = 16 steps): one noisy sample never
    does."""
    z_threshold: float = 6.0
    """Robust z of log(value) against the baseline that counts as 'above'."""
    min_growth: float = 2.0
    """And the value must be at least this many times the baseline median (for the Adam floor: this many times
    below it): the z test alone fires on a near-constant series."""
    attention: bool = True
    """Measure the attention-logit bound where the blocks have recognisable query / key projections."""
    optimizer: bool = True
    """Measure the update/weight ratio and the Adam floor (one elementwise pass over the blocks' optimizer state
    on a sampled step: the largest part of its cost; scripts/bench/precursor_overhead.py)."""
    max_dumps: int = 1
    """Precursor dumps per run: their own budget; they never use GuardConfig.dumping.max_dumps, the crash's
    (capture/dumping/budget.py)."""
    min_gap: int = 200
    """Steps before the same (layer, statistic) may fire again."""
    history: int = 64
    """Sampled steps of statistics kept in the flight recorder and written into every dump (`precursors.json`)."""

    def __post_init__(self):
        if self.window < 4 or self.warmup < 0:
            raise ValueError(
                f"PrecursorConfig needs window >= 4 and warmup >= 0, got window={self.window}, warmup={self.warmup}"
            )
        if self.every < 1 or self.sustained < 1 or self.max_dumps < 0 or self.min_gap < 0:
            raise ValueError("PrecursorConfig needs every >= 1, sustained >= 1, max_dumps >= 0, min_gap >= 0")
        if self.z_threshold <= 0 or self.min_growth <= 1:
            raise ValueError(
                f"PrecursorConfig needs z_threshold > 0 and min_growth > 1, got {self.z_threshold}, {self.min_growth}"
            )
        if self.history < self.window:
            raise ValueError(
                f"PrecursorConfig.history ({self.history}) must be >= window ({self.window}): the dump "
                "must show the baseline the growth left"
            )

    @property
    def warmup_samples(self) -> int:
        """`warmup` in sampled steps (what a trend counts), at least 4: a baseline needs values."""
        return max(4, math.ceil(self.warmup / self.every))


@dataclass
class SpikeConfig:
    """A robust spike detector over a rolling window of recent healthy values.

    A value is a spike when it exceeds the window's median by more than `mad_factor` robust standard
    deviations (1.4826 x median absolute deviation) AND is at least `min_ratio` x the median. The MAD
    test alone would fire on a near-constant series; the ratio test alone would ignore the series'
    own noise. Defaults are conservative: a healthy LM run's loss rarely moves 1.5x its median within
    a window, and a z of 8 is essentially never reached by noise.
    """

    enabled: bool = True
    window: int = 128  # steps in the rolling window; long enough for a stable median
    warmup: int = 32  # finite values needed before the detector may fire (early training moves fast)
    mad_factor: float = 8.0
    min_ratio: float = 1.5

    def __post_init__(self):
        if self.window < 4 or self.warmup < 4 or self.warmup > self.window:
            raise ValueError(f"SpikeConfig needs 4 <= warmup <= window, got warmup={self.warmup}, window={self.window}")
        if self.mad_factor <= 0 or self.min_ratio < 1:
            raise ValueError("SpikeConfig needs mad_factor > 0 and min_ratio >= 1")


@dataclass
class SilentConfig:
    """Opt-in checks for silent data corruption (a fault that makes no NaN and no spike):
    DetectionConfig(silent=SilentConfig()). docs/GUIDE.md, "Silent corruption".

    Off by default: a GuardConfig() without it adds nothing to a step. With it, a sampled step costs a second forward
    and backward of its micro-batches (the recompute), and a replica-check step one digest pass over the parameters
    and one all-reduce of two int64 per parameter; the other steps cost nothing (BENCHMARKS.md, silent_overhead).
    """

    recompute_every: int = 1000
    """Every this many steps (and at the first step after the Guard starts, so a resumed job is checked at once),
    run the step's forward and backward a second time from the same pre-step state and RNG, before the optimizer,
    and compare digests of the loss, of every module's output and of every gradient (each rank its own). 1000: about
    0.1-0.2 % of a step's time amortised (the recompute is one more forward and backward of the step); 0: off."""
    replica_every: int = 1000
    """Every this many steps, where every rank holds the same parameters (a DistributedDataParallel model), compare
    a digest of each parameter across the ranks (one int64 per parameter, computed on the device), and name the
    rank and parameters whose copy drifted. 0: off. One process, or parameters that are not replicated: not run."""
    cross_check: bool = True
    """With replicated parameters (DDP) on a recompute step: every other rank also runs rank 0's first micro-batch
    and compares its digests with rank 0's, so a deterministic fault (one that gives the same wrong answer twice on
    its device) is caught too. Costs one more forward and backward of one micro-batch on the recompute steps."""
    on_mismatch: Policy = Policy.RAISE
    """What the Guard does after dumping a mismatch: 'raise' (stop: the device needs draining), 'skip' (check()
    returns False: the step's gradients are not applied) or 'continue'."""
    inject: Any = None
    """A capture.silent.inject.FaultSpec (or its `key=value,...` text) to inject a fault and prove the checks; the
    environment variable FORENSICS_SILENT_INJECT does the same without editing the job; a text is parsed when the Guard
    starts (a bad one raises ValueError there). None: no fault."""

    def __post_init__(self):
        if self.recompute_every < 0 or self.replica_every < 0:
            raise ValueError("SilentConfig needs recompute_every >= 0 and replica_every >= 0 (0: off)")
        try:
            self.on_mismatch = Policy(self.on_mismatch)
        except ValueError:
            raise ValueError(
                f"SilentConfig.on_mismatch must be one of {', '.join(p.value for p in Policy)}, got {self.on_mismatch!r}"
            ) from None


@dataclass
class DetectionConfig:
    """What fires, and what the Guard then does: GuardConfig(detection=DetectionConfig(...))."""

    on_nonfinite: Policy = Policy.RAISE
    """Policy for NaN/Inf loss or gradients: 'raise' (stop with TrainingFaultError), 'skip' (check()
    returns False: do not step), or 'continue'."""
    on_spike: Policy = Policy.CONTINUE
    """Policy for finite loss / grad-norm spikes."""
    loss_spike: SpikeConfig = field(default_factory=SpikeConfig)
    grad_norm_spike: SpikeConfig = field(default_factory=lambda: SpikeConfig(min_ratio=3.0))
    loss_divisor: float | None = None
    """What the loop divides each micro-batch loss by before backward; default: the number of
    micro-batches recorded in the step (the usual gradient-accumulation normalisation)."""
    max_grad_norm: float | None = None
    """The loop's clipping threshold, if any: steps whose grad norm exceeds it count as clipped."""
    min_loss_scale: float = 1.0
    """With a GradScaler, non-finite gradients are normal overflow skips; they trigger only once the
    loss scale has fallen to this value."""
    sync_free: bool | None = None
    """No device->host sync inside check(). None (default): where the dumps stay exact (a fused optimizer, no enabled
    GradScaler, no precursors / host snapshots / verify_update, no buffers the forward updates; elsewhere the
    synchronous check, silently); True: asked for (one warning where it cannot run); False: never. The step is judged
    at the next check(); a NaN step and a spike the Guard dumps are skipped on the device (held back: that batch is
    not trained on, at most max_spike_dumps per run) so their exact pre-step state is dumped. How it works and why
    holding a dumped spike back is the default: docs/GUIDE.md "The sync-free check"."""
    verify_update: bool = False
    """Debug mode: copy the state before every optimizer step and check the parameters after it, so an
    update that makes weights non-finite (e.g. Adam eps=0) is dumped with its pre-step state. Costs a
    full state copy and one extra sync per step: use it to chase an 'optimizer_update' suspicion."""
    silent: SilentConfig | None = None
    """Opt-in silent-corruption checks (SilentConfig: the recompute of a sampled step, the replica check). None
    (default): off, no cost."""

    def __post_init__(self):
        for name in ("on_nonfinite", "on_spike"):
            try:
                setattr(self, name, Policy(getattr(self, name)))
            except ValueError:
                raise ValueError(
                    f"DetectionConfig.{name} must be one of {', '.join(p.value for p in Policy)}, "
                    f"got {getattr(self, name)!r}"
                ) from None

    def policy_for(self, kind: TriggerKind) -> Policy:
        """The policy that applies to a trigger of this kind: on_spike for spikes, else on_nonfinite."""
        kind = TriggerKind(kind)
        if kind is TriggerKind.SILENT_CORRUPTION:
            return self.silent.on_mismatch if self.silent is not None else Policy.RAISE
        return self.on_spike if kind.spike else self.on_nonfinite


@dataclass
class DumpConfig:
    """How many dumps a run writes, what each holds and where it goes next: GuardConfig(dumping=DumpConfig(...))."""

    max_dumps: int = 3
    """Fault dumps per run (per rank): a non-finite loss, gradient or weight, a step that raised, a device error.
    These places are the crash's own: spike and precursor dumps never use them (they have max_spike_dumps and
    PrecursorConfig.max_dumps), so a long spiky run that ends in a NaN always dumps the NaN. 3: a job under
    'raise' stops at its first fault; under 'skip' / 'continue' the first three are kept (later ones repeat them).
    Later triggers are counted and logged once per 100 steps; the counts go into the next dump's manifest
    (`dump_budget`)."""
    max_spike_dumps: int = 3
    """Spike dumps (loss / grad-norm spikes) kept on disk per run (per rank): the run's first spike, where the trouble
    began, and the largest of the others (value / threshold). A spike larger than the smallest one kept replaces
    it: the new dump is written, then the old one deleted with its step directory. Real runs spike often and
    recover; 3 bounds the disk to three states while keeping the onset and the worst, and a run of n spikes
    rewrites only when a spike beats the ones kept (about ln n times for spikes in random order). 0: no spike
    dumps (spikes are still logged and in the history)."""
    min_spike_gap: int = 100
    """Steps between two spike dumps, so one unstable phase is not written step after step (the spikes in between
    are counted, not dumped)."""
    recheck: bool = False
    """On a trigger, recompute the failing micro-batch's forward once inside the job with the step's
    RNG (needs loss_fn) and record whether it reproduced: a mismatch points at hardware or
    non-determinism."""
    background_write: bool = True
    """Spike dumps under 'continue' are copied to host memory and written by a background thread, so the
    loop stalls only for the copy."""
    recipe: dict[str, Any] | None = None
    """Replay recipe override: {"factory": "pkg.mod:fn", "factory_kwargs": {...}, "loss": "pkg.mod:fn",
    "loss_kwargs": {...}}. Default: filled in from model.config for Hugging Face models."""
    data_recipe: dict[str, Any] | None = None
    """How replay rebuilds a micro-batch from its sample IDs, by import path (never pickled; replay imports it
    only with --trust): {"dataset": "pkg.mod:fn", "dataset_kwargs": {...}, "collate": "pkg.mod:fn" (optional;
    default torch's default_collate)}. `fn(**dataset_kwargs)` returns a map-style dataset whose items the
    recorded sample IDs index (capture.IndexedDataset records exactly those indices)."""
    state_layout: StateLayout | str = StateLayout.AUTO
    """Several ranks: "full" (every rank dumps the whole state, replayable alone), "sharded" (each rank
    writes only its part: one copy of the state in all, replay reads the step's rank dumps together) or
    "auto": sharded when the model holds DTensors (FSDP2, tensor parallel) or the state exceeds
    full_state_max_bytes, else full. One process always writes the full state."""
    full_state_max_bytes: int = 1 << 30
    """"auto" layout: the largest model + optimizer state (bytes) that every rank still writes whole."""
    shard_replicas: int = 1
    """Sharded layout: on how many ranks every part of the state is written, so that a rank (or node) that dies
    while writing loses nothing. Replicated tensors (DDP weights, HSDP's replicas) are written by that many
    ranks; a shard only one rank holds (plain FSDP / tensor parallel, ZeRO partitions) is sent point to point
    to shard_replicas - 1 buddy ranks, on other nodes first, before any rank writes (capture/state/buddy.py; only in
    dumps every rank makes — a step that raised on one rank is written without copies). 2 doubles the state's
    bytes on disk. Default 1: one copy."""
    on_dump: Callable[[Location], None] | None = None
    """Called with the rank dump's directory (a pathlib.Path, or a forensics.format.location.RemotePath when
    dump_dir is a URL) after each dump is written (in the thread that wrote it); an exception in it is logged, never
    raised into the job."""
    upload: tuple[str, ...] = ()
    """Trackers that receive each dump, packed (.tar.zst next to it): "wandb", "mlflow", "tensorboard"
    (forensics/core/uploads.py; the job's open run; optional extras). A failed upload is logged only."""
    tensorboard_dir: str | None = None
    """TensorBoard log directory for upload=("tensorboard",)."""
    storage_timeout: float = 20.0
    """dump_dir a URL: seconds one request to the store may wait to connect, and again for its reply, before it is
    retried; also how long the Guard, when it is built, waits for the store to answer at all (else fallback_dir).
    20 s: far above a healthy store's latency, so only a hung or unreachable endpoint reaches it."""
    storage_retries: int = 2
    """dump_dir a URL: attempts after the first for a request that timed out or was dropped (a request then fails
    within about 2 x storage_timeout x (storage_retries + 1) seconds: 2 minutes with the defaults)."""
    write_stall_timeout: float = 60.0
    """dump_dir a URL: a dump whose write sends nothing for this many seconds is abandoned — logged, what it wrote
    removed, no dump — and the step is handled by its policy: a hung store never holds training (or a SIGTERM
    waiting for the dump) longer than this. Progress, not the whole write, is timed: a large state that keeps
    uploading is never cut."""
    fallback_dir: str | None = "forensics_dumps"
    """dump_dir a URL whose store gives no answer when the Guard is built (storage_timeout): the local directory the
    dumps go to instead, with an error logged. None: the Guard is not built (ValueError). A URL that can never
    work (a credential in it, its filesystem package not installed) is a ValueError either way."""

    def storage_timeouts(self) -> StorageTimeouts:
        """The bounds of each request to the store (forensics.format.location.StorageTimeouts)."""
        return StorageTimeouts(self.storage_timeout, self.storage_retries)

    def __post_init__(self):
        self.upload = tuple(self.upload)
        if not (self.write_stall_timeout > 0 and math.isfinite(self.write_stall_timeout)):
            raise ValueError(f"DumpConfig.write_stall_timeout must be > 0 seconds, got {self.write_stall_timeout}")
        try:
            self.storage_timeouts()
        except ValueError as exc:
            raise ValueError(f"DumpConfig.storage_timeout / storage_retries: {exc}") from None
        unknown = [t for t in self.upload if t not in Tracker.values()]
        if unknown:
            raise ValueError(
                f"DumpConfig.upload: unknown tracker(s) {unknown}; choose from {', '.join(Tracker.values())}"
            )
        if Tracker.TENSORBOARD in self.upload and not self.tensorboard_dir:
            raise ValueError("DumpConfig.upload=('tensorboard',) needs DumpConfig.tensorboard_dir")
        try:
            self.state_layout = StateLayout(self.state_layout)
        except ValueError:
            raise ValueError(
                f"DumpConfig.state_layout must be one of {', '.join(k.value for k in StateLayout)}, "
                f"got {self.state_layout!r}"
            ) from None
        if self.data_recipe is not None and (
            not isinstance(self.data_recipe, dict) or not isinstance(self.data_recipe.get("dataset"), str)
        ):
            raise ValueError(
                "DumpConfig.data_recipe must be a dict with 'dataset': 'pkg.module:function' "
                "(and optional 'dataset_kwargs', 'collate')"
            )
        if self.shard_replicas < 1 or self.full_state_max_bytes < 0:
            raise ValueError("DumpConfig needs shard_replicas >= 1 and full_state_max_bytes >= 0")
        if self.max_dumps < 0 or self.max_spike_dumps < 0 or self.min_spike_gap < 0:
            raise ValueError("DumpConfig needs max_dumps >= 0, max_spike_dumps >= 0 and min_spike_gap >= 0")


@dataclass
class RecordConfig:
    """What the Guard keeps of each step and of the steps before it: GuardConfig(recording=RecordConfig(...))."""

    history_size: int = 512
    """Steps of loss / grad-norm / lr / loss-scale history kept (scalars only) and written to the dump."""
    sample_id_key: str = "sample_ids"
    """Batch field holding the samples' IDs (a dict batch); IDs can also be passed to record_batch."""
    window_steps: int = 32
    """Flight recorder: keep, for the last this many steps, the sample IDs of every micro-batch, the RNG before
    each forward, lr, loss scale, loss and grad norm (host memory: about 12 KB per micro-batch), and write them
    into the dump, so `forensics replay DUMP --from CHECKPOINT` can re-execute the steps that led to it.
    0 turns it off."""
    snapshot_every: int = 0
    """Host snapshots: every this many steps, copy the pre-step model + optimizer state to host memory (reused
    buffers; asynchronous from a GPU, one memcpy on CPU), and write the oldest one the flight recorder covers
    into each dump, so `forensics replay DUMP --trust` re-executes the steps from it and finds the step whose
    update broke the weights without a checkpoint of yours. Costs snapshot_count x the state in host memory
    (refused, with a warning, above half the memory available). Full-state jobs only (one process, DDP); a
    sharded state (FSDP2, DeepSpeed) and the sync_free mode take none: pass your own checkpoint with --from.
    0 (default): off."""
    snapshot_count: int = 2
    """Host snapshots kept (rotating): the oldest is up to snapshot_count x snapshot_every steps before a dump, so
    a break between the newest snapshot and the crash is still covered. snapshot_every x snapshot_count must
    not exceed window_steps (the recorder must hold every step from the oldest snapshot on)."""
    capture_exceptions: bool = True
    """A step that raises (IndexError on bad token ids, a shape error, out of memory ...) is dumped when the
    exception reaches the top of the program (the Guard chains sys.excepthook until close()); wrap the step in
    `with guard.capture_errors():` to dump it where it raises even when your code catches the exception."""
    run_log: bool = True
    """Write the run log: every step's scalars and every trigger, dump and budget decision of this rank, under
    <dump_dir>/<run_id>/runlog/ (a few MB per rank for a million steps; written by the dump writer's thread), for
    `forensics timeline`. False: none."""

    def __post_init__(self):
        if self.window_steps < 0 or self.history_size < 1:
            raise ValueError("RecordConfig needs window_steps >= 0 and history_size >= 1")
        if self.snapshot_every < 0 or self.snapshot_count < 1:
            raise ValueError("RecordConfig needs snapshot_every >= 0 and snapshot_count >= 1")
        if self.snapshot_every * self.snapshot_count > self.window_steps:
            raise ValueError(
                f"RecordConfig.snapshot_every x snapshot_count ({self.snapshot_every} x "
                f"{self.snapshot_count}) exceeds window_steps ({self.window_steps}): the flight recorder "
                "would not hold the steps from the oldest snapshot on. Raise window_steps or snapshot "
                "more often"
            )


FLAT = {
    name: group
    for group, cls in (("detection", DetectionConfig), ("dumping", DumpConfig), ("recording", RecordConfig))
    for name in cls.__dataclass_fields__
    if name != "silent"  # newer than the flat spelling
}
"""The flat spelling of one release ago, GuardConfig(max_dumps=...): each field and the group it moved to."""
_GROUP_CLASSES = {"detection": DetectionConfig, "dumping": DumpConfig, "recording": RecordConfig}


@dataclass(init=False)
class GuardConfig:
    """How the Guard watches a training loop and what it does when a step goes wrong, one group per stage.

    Example:
        >>> GuardConfig(dump_dir="dumps", detection=DetectionConfig(on_nonfinite="skip"),
        ...             dumping=DumpConfig(max_dumps=5), recording=RecordConfig(window_steps=64))  # doctest: +SKIP

    The flat spelling of one release ago (`GuardConfig(on_nonfinite="skip", max_dumps=5)`) still works, with a
    FutureWarning naming the nested one; it goes in the next release.
    """

    dump_dir: str = "forensics_dumps"
    """Where dumps go: <dump_dir>/<run_id>/step-<step>/rank-<rank>/. A directory, or an fsspec URL (s3://bucket/dumps,
    gs://..., az://...: each rank streams its files there, manifest last; `pip install 'forensics[s3]'`;
    credentials from the environment or an instance role, never in the URL). docs/GUIDE.md, "Object storage"."""
    run_id: str | None = None
    """Names the run's dump folder; default: $FORENSICS_RUN_ID, $TORCHELASTIC_RUN_ID, or a timestamp."""
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    """What fires, and the policy that applies (DetectionConfig)."""
    dumping: DumpConfig = field(default_factory=DumpConfig)
    """How many dumps, what each holds, where it goes next (DumpConfig)."""
    recording: RecordConfig = field(default_factory=RecordConfig)
    """What is kept of each step and of the steps before it (RecordConfig)."""
    precursors: PrecursorConfig | None = None
    """Opt-in precursor monitor (capture/precursors/monitor.py): per-layer statistics (block output RMS / abs-max,
    attention- and output-logit bounds, gradient norm, update/weight ratio, Adam second-moment floor) measured on
    every PrecursorConfig.every-th step (8) and read with check()'s own transfer; a statistic that keeps growing
    dumps the step once (trigger 'precursor', policy 'continue'), before the loss goes non-finite. None (default):
    off."""

    def __init__(
        self,
        dump_dir: str = "forensics_dumps",
        run_id: str | None = None,
        *,
        detection: DetectionConfig | None = None,
        dumping: DumpConfig | None = None,
        recording: RecordConfig | None = None,
        precursors: PrecursorConfig | None = None,
        **flat: Any,
    ):
        self.dump_dir, self.run_id, self.precursors = dump_dir, run_id, precursors
        given = {"detection": detection, "dumping": dumping, "recording": recording}
        unknown = sorted(set(flat) - set(FLAT))
        if unknown:
            raise TypeError(f"GuardConfig got unexpected keyword argument(s) {', '.join(unknown)}")
        if flat:
            warnings.warn(_flat_words(flat), FutureWarning, stacklevel=2)
        for name, cls in _GROUP_CLASSES.items():
            moved = {k: v for k, v in flat.items() if FLAT[k] == name}
            value = given[name]
            value = dataclasses.replace(value, **moved) if value is not None and moved else value or cls(**moved)
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name in FLAT:  # the flat spelling, read
            warnings.warn(f"GuardConfig.{name} is now GuardConfig.{FLAT[name]}.{name}", FutureWarning, stacklevel=2)
            return getattr(object.__getattribute__(self, FLAT[name]), name)
        raise AttributeError(f"'GuardConfig' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FLAT:  # the flat spelling, written
            warnings.warn(f"GuardConfig.{name} is now GuardConfig.{FLAT[name]}.{name}", FutureWarning, stacklevel=2)
            setattr(getattr(self, FLAT[name]), name, value)
        else:
            object.__setattr__(self, name, value)

    def policy_for(self, kind: TriggerKind) -> Policy:
        """The policy that applies to a trigger of this kind: on_spike for spikes, else on_nonfinite."""
        return self.detection.policy_for(kind)

    def replace(self, **changes: Any) -> "GuardConfig":
        """A copy, its groups copied too, with `changes`: fields of a group by their own name (`loss_divisor=2.0`) or
        of GuardConfig itself (`run_id="r"`). What adapters use to fill in a framework's defaults."""
        groups = {
            name: dataclasses.replace(getattr(self, name), **{k: v for k, v in changes.items() if FLAT.get(k) == name})
            for name in _GROUP_CLASSES
        }
        return dataclasses.replace(self, **groups, **{k: v for k, v in changes.items() if k not in FLAT})


def _flat_words(flat: dict[str, Any]) -> str:
    """The FutureWarning for the flat spelling: what to write instead."""
    groups: dict[str, list[str]] = {}
    for name in flat:
        groups.setdefault(FLAT[name], []).append(f"{name}=...")
    nested = ", ".join(f"{g}={_GROUP_CLASSES[g].__name__}({', '.join(names)})" for g, names in groups.items())
    return (
        f"GuardConfig({', '.join(f'{n}=...' for n in flat)}) is the flat spelling, accepted until the next "
        f"release: write GuardConfig({nested})"
    )
