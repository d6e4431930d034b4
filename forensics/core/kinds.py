"""The named kinds every stage shares: what fired (TriggerKind), where it broke (Phase), what the replay
concluded (VerdictKind), the loss-curve shape before it (HistoryPattern), what the Guard does about it
(Policy), how the ranks write the state (StateLayout), the fixes replay tries (RemedyKind) and how the CLI
ends (ExitCode).

Each kind carries its properties here, so that capture, replay, report and CLI ask the kind instead
of comparing strings: adding a trigger kind is one member below plus its detector (capture) and its
replayed quantity (replay/run/execute.py); adding a verdict kind is one member below plus its rule
(replay/judge/verdict.py). tests/forensics/test_kinds.py ties every kind to its label, exit code and
renderer.

Every kind is a `str` Enum: its value is what dumps and reports store, it compares equal to that
string, and json writes it as that string.
"""

from __future__ import annotations

import enum
from typing import Any
from dataclasses import dataclass


class _Kind(str, enum.Enum):
    """A str Enum whose str() and format() are its value (as stored in dumps and reports)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every member's value, as dumps and reports store them."""
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value: object, default: "_Kind | None" = None):
        """The member whose value is `value`; `default` (or ValueError when None) for anything else."""
        try:
            return cls(value)
        except ValueError:
            if default is not None:
                return default
            raise ValueError(f"unknown {cls.__name__} {value!r}; expected one of {', '.join(cls.values())}") from None


class ExitCode(enum.IntEnum):
    """The one exit-code table of the CLI (README "Exit codes" copies it)."""

    OK = 0
    """Success; for `replay`, a verdict that names a culprit."""
    INTERNAL = 1
    """A bug in forensics (please report the traceback)."""
    BAD_INPUT = 2
    """The user's input, code or environment: missing path, not a dump, tampered file, unwritable output ..."""
    NOT_REPRODUCED = 3
    """`replay`: the failure did not reproduce."""
    NO_CULPRIT = 4
    """`replay`: reproduced, but no single culprit."""
    INTERRUPTED = 130
    """Ctrl-C (SIGINT), any command: 128 + the signal's number, as shells report it; the files a command writes are
    each written whole (atomically) or not at all."""


class Policy(_Kind):
    """What the Guard does after dumping a trigger (GuardConfig.detection.on_nonfinite / on_spike)."""

    RAISE = "raise"
    """Stop the job with TrainingFaultError (after the dump)."""
    SKIP = "skip"
    """check() returns False: the loop skips optimizer.step(); training goes on."""
    CONTINUE = "continue"
    """Apply the step anyway; training goes on."""


class StateLayout(_Kind):
    """How the ranks of a multi-rank job write the model and optimizer state (GuardConfig.dumping.state_layout)."""

    AUTO = "auto"
    """FULL for a small state without DTensors (at most GuardConfig.dumping.full_state_max_bytes), else SHARDED."""
    FULL = "full"
    """Every rank writes the full state: each rank dump replays alone (sharded states are gathered first)."""
    SHARDED = "sharded"
    """Each rank writes only what it owns (its DTensor shards, its share of replicated tensors): one copy of
    the state across all ranks, no gather, no collective while writing (dump format version 2)."""


class ReplayedQuantity(_Kind):
    """Which replayed number is compared with a trigger's recorded value (TriggerKind.replayed)."""

    MICRO_BATCH_LOSS = "micro_batch_loss"
    """The loss of the micro-batch that fired."""
    STEP_LOSS = "step_loss"
    """The step's loss (every micro-batch's, divided as the job divided it)."""
    GRAD_NORM = "grad_norm"
    """The total gradient norm of the step."""
    EXCEPTION = "exception"
    """The same exception type, raised at the same place."""

    @property
    def words(self) -> str:
        """'grad norm' or 'loss': the quantity in a sentence."""
        return "grad norm" if self is ReplayedQuantity.GRAD_NORM else "loss"


class FidelityMode(_Kind):
    """How replayed and recorded values were compared (report `fidelity.mode`)."""

    BITWISE = "bitwise"
    """Bit for bit (the replay runs where the job ran, deterministically)."""
    TOLERANCE = "tolerance"
    """Within an absolute tolerance (another device or kernels that are not deterministic)."""
    NOT_REPLAYED = "not_replayed"
    """Nothing was re-run (a precursor dump, an exception raised between steps): `fidelity.reason` says why."""


class Tracker(_Kind):
    """An experiment tracker a dump or report is sent to (GuardConfig.dumping.upload, `forensics replay --upload`)."""

    WANDB = "wandb"
    MLFLOW = "mlflow"
    TENSORBOARD = "tensorboard"

    @property
    def module(self) -> str:
        """The package imported to send to it (installed by the extra of the same name: forensics[wandb])."""
        return self.value


@dataclass(frozen=True)
class _TriggerProps:
    spike: bool
    needs_backward: bool
    words: str
    what_fails: str
    replayed: ReplayedQuantity | None


class TriggerKind(_Kind):
    """What made the Guard dump a step (manifest `trigger.kind`, report `trigger.kind`)."""

    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_SPIKE = "grad_norm_spike"
    NONFINITE_PARAM = "nonfinite_param"
    EXCEPTION = "exception"
    """The step raised (IndexError, a shape error, out of memory ...): manifest section `exception`."""
    PRECURSOR = "precursor"
    """A healthy step whose per-layer statistics have been growing for several steps (capture/precursors/monitor.py):
    dumped once per (layer, statistic) under policy 'continue', before any loss is non-finite."""
    SILENT_CORRUPTION = "silent_corruption"
    """Two computations that must agree bit for bit did not (capture/silent/): the step's recompute, the cross-rank
    check of one micro-batch, or the replicas' parameters; no NaN, no spike. Dump member `silent.json`."""

    @property
    def props(self) -> _TriggerProps:
        return _TRIGGER_PROPS[self]

    @property
    def spike(self) -> bool:
        """A finite value above a threshold (judged against the batch), not a NaN/Inf."""
        return self.props.spike

    @property
    def needs_backward(self) -> bool:
        """Reproducing it needs the backward pass, not only the forward."""
        return self.props.needs_backward

    @property
    def words(self) -> str:
        """'non-finite loss': the kind in a sentence."""
        return self.props.words

    @property
    def what_fails(self) -> str:
        """'the loss non-finite': completes 'samples that make ...'."""
        return self.props.what_fails

    @property
    def replayed(self) -> ReplayedQuantity | None:
        """Which replayed quantity is compared with the recorded value, or None (the weights after the update)."""
        return self.props.replayed

    @property
    def data_independent(self) -> bool:
        """The data of the step does not decide it (bisection over samples is pointless)."""
        return self.replayed is None


_TRIGGER_PROPS = {
    TriggerKind.NONFINITE_LOSS: _TriggerProps(
        False, False, "non-finite loss", "the loss non-finite", ReplayedQuantity.MICRO_BATCH_LOSS
    ),
    TriggerKind.NONFINITE_GRAD: _TriggerProps(
        False, True, "non-finite gradient", "the gradients non-finite", ReplayedQuantity.GRAD_NORM
    ),
    TriggerKind.LOSS_SPIKE: _TriggerProps(True, False, "loss spike", "the loss spike", ReplayedQuantity.STEP_LOSS),
    TriggerKind.GRAD_NORM_SPIKE: _TriggerProps(
        True, True, "gradient-norm spike", "the gradient norm spike", ReplayedQuantity.GRAD_NORM
    ),
    TriggerKind.NONFINITE_PARAM: _TriggerProps(False, True, "non-finite weights", "the weights non-finite", None),
    TriggerKind.EXCEPTION: _TriggerProps(False, True, "exception", "the step raise", ReplayedQuantity.EXCEPTION),
    TriggerKind.PRECURSOR: _TriggerProps(False, True, "instability precursor", "a layer's statistics grow", None),
    TriggerKind.SILENT_CORRUPTION: _TriggerProps(
        False, True, "silent data corruption", "two computations of the step disagree", None
    ),
}


@dataclass(frozen=True)
class _StatisticProps:
    words: str
    rising: bool
    usual_fix: str


class PrecursorStatistic(_Kind):
    """A per-layer statistic the precursor monitor records (capture/precursors/monitor.py; dump `precursors.json`)."""

    BLOCK_RMS = "block_rms"
    BLOCK_ABSMAX = "block_absmax"
    ATTENTION_LOGIT = "attention_logit_bound"
    OUTPUT_LOGIT = "output_logit_absmax"
    GRAD_NORM = "grad_norm"
    UPDATE_RATIO = "update_ratio"
    ADAM_V_FLOOR = "adam_v_floor"

    @property
    def words(self) -> str:
        """'block output RMS': the statistic in a sentence."""
        return _STATISTIC_PROPS[self].words

    @property
    def rising(self) -> bool:
        """True: growth announces trouble; False (the Adam second-moment floor): a fall does."""
        return _STATISTIC_PROPS[self].rising

    @property
    def usual_fix(self) -> str:
        """What usually stops this statistic's runaway, as a suggestion."""
        return _STATISTIC_PROPS[self].usual_fix


_STATISTIC_PROPS = {
    PrecursorStatistic.BLOCK_RMS: _StatisticProps(
        "block output RMS", True, "lower the learning rate or lengthen the warm-up; add or check the block's norm"
    ),
    PrecursorStatistic.BLOCK_ABSMAX: _StatisticProps(
        "block output abs-max",
        True,
        "lower the learning rate; look for outlier features (clip activations, check the norm's epsilon)",
    ),
    PrecursorStatistic.ATTENTION_LOGIT: _StatisticProps(
        "attention-logit bound (max |q|·|k|/√d)",
        True,
        "add QK-norm (normalise queries and keys), or lower the learning rate of the attention projections",
    ),
    PrecursorStatistic.OUTPUT_LOGIT: _StatisticProps(
        "output-logit abs-max", True, "add a z-loss (1e-4 · logsumexp²) so the output logits stop drifting"
    ),
    PrecursorStatistic.GRAD_NORM: _StatisticProps(
        "gradient norm", True, "lower the learning rate, lengthen the warm-up, or clip gradients"
    ),
    PrecursorStatistic.UPDATE_RATIO: _StatisticProps(
        "update/weight ratio", True, "lower the learning rate (the layer moves a growing fraction of itself per step)"
    ),
    PrecursorStatistic.ADAM_V_FLOOR: _StatisticProps(
        "Adam second-moment floor (min exp_avg_sq)",
        False,
        "raise Adam's eps (e.g. 1e-8 -> 1e-6) so tiny second moments cannot make updates jump",
    ),
}


class PrecursorRule(_Kind):
    """Which rule made a precursor statistic fire (capture/precursors/monitor.py; `precursors.json` firings' `rule`)."""

    GROWTH = "growth"
    """It grew fast against its own recent median (forensics/core/trend.py)."""
    HEADROOM = "headroom"
    """It passed half of its dtype's limit (forensics/core/headroom.py)."""
    TREND = "trend"
    """Its steady log-linear growth reaches its dtype's limit within a short horizon (forensics/core/headroom.py)."""
    NONFINITE = "nonfinite"
    """It overflowed on a step whose loss was still finite."""


class SampleFactKind(_Kind):
    """What replay/culprits/sample_facts.py found odd in a culprit sample's own data (most telling first)."""

    TOO_LONG = "too_long"
    LABELS_MASKED = "labels_masked"
    NO_ATTENTION = "no_attention"
    NONFINITE_VALUES = "nonfinite_values"
    EXTREME_VALUES = "extreme_values"
    ALL_ZERO = "all_zero"
    REPEATED_NGRAMS = "repeated_ngrams"
    """Most of its tokens belong to n-grams it repeats, far more than the other samples' (OLMo 2's spikes)."""


class EvidenceKind(_Kind):
    """Why the replay calls a culprit's record bad data (replay/culprits/evidence.py; report `evidence.against`)."""

    RECORD_DATA = "record_data"
    """Its data is odd on its own (a SampleFactKind)."""
    LOSS_OUTLIER = "loss_outlier"
    """Its loss alone is an outlier against the step's other samples."""
    NONFINITE_ALONE = "nonfinite_alone"
    """Alone it makes the loss non-finite in float32 too, while every other sample's loss is finite."""
    EARLIER_STATE = "earlier_state"
    """Fed to an earlier state of the model, it still fails or still stands out."""


class Phase(_Kind):
    """Where the first non-finite value appeared (report `culprit.phase`), or where a step raised (manifest
    `exception.during`)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    BETWEEN_STEPS = "between_steps"
    """After the optimizer update of one step and before the next step's first record_batch: the user's data
    loading or other code of the loop raised (only a step that raised; capture/raised/optimizer_steps.py)."""

    @property
    def is_pass(self) -> bool:
        """Forward or backward: 'in the forward pass' reads right; the optimizer is an update, not a pass."""
        return self in (Phase.FORWARD, Phase.BACKWARD)

    @property
    def in_model_step(self) -> bool:
        """The model's step was running (forward, backward, update): replaying the step can reproduce it."""
        return self is not Phase.BETWEEN_STEPS

    @property
    def words(self) -> str:
        """'the forward pass', 'between steps (data loading or user code)': completes 'raised during ...'."""
        return _PHASE_WORDS[self]


_PHASE_WORDS = {
    Phase.FORWARD: "the forward pass",
    Phase.BACKWARD: "the backward pass",
    Phase.OPTIMIZER: "the optimizer update",
    Phase.BETWEEN_STEPS: "between steps (data loading or user code)",
}


class StateHolds(_Kind):
    """What the dump of a step that raised holds as its model state (manifest `exception.state_holds`)."""

    PRE_STEP = "pre_step"
    """The dumped step's pre-step state: it raised inside its forward / backward, or no update ran after its check."""
    AFTER_UPDATE = "after_update"
    """The state after step S's update, which is step S + 1's pre-step state: raised between steps."""
    MAYBE_PARTIAL = "maybe_partial"
    """Raised inside the update, or after check() with no optimizer step hooks: the update may be half applied."""

    @property
    def step_offset(self) -> int:
        """Added to the checked step's number: the step whose pre-step state the dump holds."""
        return 1 if self is StateHolds.AFTER_UPDATE else 0


@dataclass(frozen=True)
class _VerdictProps:
    label: str
    exit_code: ExitCode
    names_culprit: bool
    schema_major: int = 1


class VerdictKind(_Kind):
    """What the replay concluded (report `verdict.kind`; docs/REPORT_FORMAT.md)."""

    BAD_SAMPLE = "bad_sample"
    NUMERICAL_PRECISION = "numerical_precision"
    OPTIMIZER_UPDATE = "optimizer_update"
    MODEL_STATE = "model_state"
    NOT_REPRODUCED = "not_reproduced"
    SPIKE_NO_SINGLE_CAUSE = "spike_no_single_cause"
    EXCEPTION = "exception"
    """The step raised on replay too; names where, and the samples that make it raise."""
    INSTABILITY_AHEAD = "instability_ahead"
    """A precursor dump: the job was still healthy; names the layer and statistic that started to grow first."""
    TRIGGER_SAMPLE = "trigger_sample"
    """Bisection isolated samples, but nothing shows their records are bad: they are the first to cross on a state
    that could not take them (replay/culprits/evidence.py); no blocklist, the advice is about the state."""
    SILENT_CORRUPTION = "silent_corruption"
    """A silent-corruption dump judged on the replay device: its SilentClass (transient, persistent on the job's
    device, replica drift, not the hardware), the first module where the computations part, the rank and device."""

    @property
    def label(self) -> str:
        """'bad sample': the kind as people read it."""
        return _VERDICT_PROPS[self].label

    @property
    def exit_code(self) -> ExitCode:
        """What `forensics replay` exits with for this verdict."""
        return _VERDICT_PROPS[self].exit_code

    @property
    def names_culprit(self) -> bool:
        """The verdict names a cause to act on (a sample, a precision problem, an update)."""
        return _VERDICT_PROPS[self].names_culprit

    @property
    def schema_major(self) -> int:
        """The report schema major version that introduced this kind: a report with it is written under that
        major, so a reader of an older one refuses it instead of misreading it (docs/REPORT_FORMAT.md)."""
        return _VERDICT_PROPS[self].schema_major

    @property
    def outcome(self) -> str:
        """'found', 'none' or 'notrepro': how renderers colour the verdict."""
        if self is VerdictKind.NOT_REPRODUCED:
            return "notrepro"
        return "found" if self.names_culprit else "none"


_VERDICT_PROPS = {
    VerdictKind.BAD_SAMPLE: _VerdictProps("bad sample", ExitCode.OK, True),
    VerdictKind.NUMERICAL_PRECISION: _VerdictProps("numerical precision", ExitCode.OK, True),
    VerdictKind.OPTIMIZER_UPDATE: _VerdictProps("optimizer update", ExitCode.OK, True),
    VerdictKind.MODEL_STATE: _VerdictProps("model state", ExitCode.NO_CULPRIT, False),
    VerdictKind.NOT_REPRODUCED: _VerdictProps("not reproduced", ExitCode.NOT_REPRODUCED, False),
    VerdictKind.SPIKE_NO_SINGLE_CAUSE: _VerdictProps("spike, no single cause", ExitCode.NO_CULPRIT, False),
    VerdictKind.EXCEPTION: _VerdictProps("exception", ExitCode.OK, True, schema_major=2),
    VerdictKind.INSTABILITY_AHEAD: _VerdictProps("instability ahead", ExitCode.OK, True, schema_major=3),
    VerdictKind.TRIGGER_SAMPLE: _VerdictProps("trigger, not bad data", ExitCode.NO_CULPRIT, False, schema_major=4),
    VerdictKind.SILENT_CORRUPTION: _VerdictProps("silent data corruption", ExitCode.OK, True, schema_major=5),
}


@dataclass(frozen=True)
class _SilentProps:
    words: str
    hardware: bool


class SilentCheck(_Kind):
    """Which in-job check found a silent corruption (dump `silent.json` `check`)."""

    RECOMPUTE = "recompute"
    """The step's second forward and backward on the same device disagreed with the first."""
    CROSS_RANK = "cross_rank"
    """Another rank's run of rank 0's first micro-batch disagreed with rank 0's (replicated weights)."""
    REPLICAS = "replicas"
    """The replicas' copies of some parameters differ."""


class SilentClass(_Kind):
    """What the replay concluded about a silent-corruption dump (report `silent.class`)."""

    TRANSIENT = "transient"
    """The replay agrees with one of the job's two computations: the other was hit by a fault that did not repeat."""
    PERSISTENT = "persistent"
    """The job's two computations agree with each other and the replay on another device differs: the job's device
    computes wrong, reproducibly."""
    REPLICA_DRIFT = "replica_drift"
    """One replica's weights differ from the others' (memory or update corruption on that rank)."""
    NOT_HARDWARE = "not_hardware"
    """Everything agrees with the replay, or the difference follows non-determinism the replay shows."""
    UNDECIDED = "undecided"
    """The evidence cannot tell (another kind of device that cannot match bits, or a replay on the job's own device
    that agrees with the job's two runs)."""

    @property
    def words(self) -> str:
        return _SILENT_PROPS[self].words

    @property
    def hardware(self) -> bool:
        """A device is to blame (drain it)."""
        return _SILENT_PROPS[self].hardware


_SILENT_PROPS = {
    SilentClass.TRANSIENT: _SilentProps("a transient fault", True),
    SilentClass.PERSISTENT: _SilentProps("a persistent fault of the job's device", True),
    SilentClass.REPLICA_DRIFT: _SilentProps("a replica whose weights drifted", True),
    SilentClass.NOT_HARDWARE: _SilentProps("not the hardware", False),
    SilentClass.UNDECIDED: _SilentProps("undecided", False),
}


@dataclass(frozen=True)
class _PatternProps:
    words: str
    usual_cause: str


class HistoryPattern(_Kind):
    """The shape of the loss curve before the trigger (the table of replay/judge/history_pattern.py)."""

    SUDDEN_JUMP = "sudden_jump"
    EXPONENTIAL_GROWTH = "exponential_growth"
    OSCILLATING_DIVERGENCE = "oscillating_divergence"
    DIVERGED = "diverged"
    """The loss sits far above where the run started (or above a uniform guess): never "stable"."""
    STABLE = "stable"
    INSUFFICIENT_HISTORY = "insufficient_history"

    @property
    def words(self) -> str:
        return _PATTERN_PROPS[self].words

    @property
    def usual_cause(self) -> str:
        """What the pattern usually means ('' when it means nothing in particular)."""
        return _PATTERN_PROPS[self].usual_cause

    def cause_for(self, trigger: Any) -> str:
        """usual_cause, true for a dump of `trigger` (a TriggerKind or its value): 'the failing step is an outlier'
        only where a value failed — not for a step that raised or a precursor of a healthy step."""
        if self is HistoryPattern.STABLE and trigger in (
            TriggerKind.EXCEPTION,
            TriggerKind.PRECURSOR,
            TriggerKind.SILENT_CORRUPTION,
        ):
            return ""
        return self.usual_cause

    def means(self, trigger: Any = None) -> str:
        """'sudden jump (usually one bad sample, or a numerical overflow)', for a dump of `trigger`."""
        cause = self.cause_for(trigger)
        return f"{self.words} ({cause})" if cause else self.words


_PATTERN_PROPS = {
    HistoryPattern.SUDDEN_JUMP: _PatternProps("sudden jump", "usually one bad sample, or a numerical overflow"),
    HistoryPattern.EXPONENTIAL_GROWTH: _PatternProps(
        "exponential growth", "usually a learning rate too high, an accumulation bug, or momentum"
    ),
    HistoryPattern.OSCILLATING_DIVERGENCE: _PatternProps(
        "oscillating divergence", "usually corrupted optimizer state or a batch distribution shift"
    ),
    HistoryPattern.DIVERGED: _PatternProps(
        "diverged: the loss sits far above where the run started",
        "usually a learning rate too high or a warm-up too short",
    ),
    HistoryPattern.STABLE: _PatternProps("stable until the failure", "the failing step is an outlier"),
    HistoryPattern.INSUFFICIENT_HISTORY: _PatternProps("too little history to tell", ""),
}

__all__ = [
    "EvidenceKind",
    "ExitCode",
    "FidelityMode",
    "HistoryPattern",
    "Phase",
    "Policy",
    "PrecursorStatistic",
    "ReplayedQuantity",
    "SilentCheck",
    "SilentClass",
    "Tracker",
    "TriggerKind",
    "VerdictKind",
]


@dataclass(frozen=True)
class _RemedyProps:
    words: str
    rank: int  # preference among remedies that work: a fix of the cause before a fix of the symptom


class RemedyKind(_Kind):
    """A change the replay tries on the failing step (replay/judge/remedies.py), and what it stands for."""

    AS_RECORDED = "as_recorded"
    """No change: the step's own update (for a spike: is any action needed at all?)."""
    DROP_SAMPLES = "drop_samples"
    ADAM_EPS = "adam_eps"
    FP32 = "fp32"
    LOSS_SCALE = "loss_scale"
    CLIP_GRAD = "clip_grad"
    LOWER_LR = "lower_lr"
    SKIP_STEP = "skip_step"

    @property
    def words(self) -> str:
        return _REMEDY_PROPS[self].words

    @property
    def rank(self) -> int:
        return _REMEDY_PROPS[self].rank


_REMEDY_PROPS = {
    RemedyKind.AS_RECORDED: _RemedyProps("no change", 0),
    RemedyKind.DROP_SAMPLES: _RemedyProps("drop the culprit samples", 1),
    RemedyKind.ADAM_EPS: _RemedyProps("a non-zero Adam eps", 2),
    RemedyKind.FP32: _RemedyProps("run the step in fp32", 3),
    RemedyKind.LOSS_SCALE: _RemedyProps("a lower loss scale", 4),
    RemedyKind.CLIP_GRAD: _RemedyProps("clip the gradient at a lower norm", 5),
    RemedyKind.LOWER_LR: _RemedyProps("a 10x lower learning rate", 6),
    RemedyKind.SKIP_STEP: _RemedyProps("skip the step", 9),
}
