"""What the verdict is decided on: VerdictFacts, everything the replay established, and the predicates the rules and
the wording share (has a culprit, blames data, a whole-batch failure, the low precision the job ran in)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from forensics.core.kinds import HistoryPattern, Phase, TriggerKind
from forensics.replay.culprits.sample_facts import SampleFact

LOW_PRECISION = {
    "float16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
MAX_NAMED_SAMPLES = 3  # headlines name at most this many culprit samples
MAX_ID_CHARS = 80  # longer sample ids are cut in the headline (report.json keeps them whole)
PROSE_DIGITS = 6  # significant digits of numbers in verdict prose
# forensics.replay.localize.forward_backward.INPUT_MODULE + ".": a batch field that was non-finite itself
INPUT_PREFIX = "<input>."
# A non-finite gradient norm not reproduced on another device still reproduced as the run's divergence when the
# replayed norm is this many times the run's healthy one (three orders of magnitude: far out of any normal range; a
# transient fault's or a GPU-only kernel bug's replay sits in it)...
DIVERGED_TIMES_HEALTHY = 1000.0
# ... the replayed step loss is this many times the top of the run's healthy loss range (the loss exploded) ...
EXPLODED_TIMES_CEILING = 10.0
# ... and within this factor of the loss the job recorded for the step (the same forward: other kernels and other
# dropout masks on another device move it by a few percent, never by a factor)
SAME_LOSS_FACTOR = 2.0
# ... against a healthy gradient norm of at least this many recorded steps: one or two steps after the start are no
# range (the first steps of a run move fast, and a median of two is either of them), three give a median that one odd
# step cannot set. With fewer, only an earlier state the samples were fed to (a measured reference) lets the rule fire.
MIN_HEALTHY_STEPS = 3


@dataclass
class VerdictFacts:
    """Everything the replay found that the verdict depends on. Only the first two are required."""

    trigger_kind: TriggerKind
    """manifest trigger.kind: nonfinite_loss, nonfinite_grad, loss_spike, grad_norm_spike, nonfinite_param."""
    reproduced: bool
    """The replay failed the same way (report `reproduced`)."""
    step: int | None = None
    rank: int | None = None
    trigger_local: bool = True
    """False when this rank only inherited the fault from another rank (multi-rank dumps)."""
    """Rank whose dump was replayed; also the rank of the culprit samples unless `culprit_rank`."""
    micro_batch: int | None = None
    """Micro-batch index in which the trigger fired, 0-based as in the report's JSON; prose shows it
    1-based, like the report renderers (index 1 of 4 reads "micro-batch 2 of 4")."""
    num_micro_batches: int | None = None
    trigger_value: float | None = None
    """The recorded value that fired (nan / inf / the spiking number)."""
    threshold: float | None = None
    replayed_value: float | None = None
    """The same quantity in the replay (for not_reproduced: 'recorded nan, replayed 2.31')."""
    unit_factor: str | None = None
    """Not reproduced, and the recorded value is the replayed one times a factor the job recorded (replay/run/units.py):
    'the recorded grad norm is the replayed one times the loss scale (65536)'. A unit, not hardware."""
    bitwise: bool | None = None
    """Replayed values equal the recorded ones bit for bit (fidelity.bitwise_equal)."""
    replay_device: str | None = None
    environment_warnings: list[str] = field(default_factory=list)
    phase: Phase | None = None
    """forward, backward, optimizer or None: where the first non-finite value appeared."""
    module: str | None = None
    op: str | None = None
    parameter: str | None = None
    optimizer_state: str | None = None
    """The optimizer-state fact that explains an optimizer_update, e.g. 'exp_avg_sq == 0 with eps == 0'."""
    optimizer_class: str | None = None
    norm_eps: float | None = None
    """The eps of the failing module when it normalises (read from the model: `eps`, `variance_epsilon`); None: not a
    normalisation, or it says no eps. The eps advice is computed from it, never assumed."""
    inputs_absmax: float | None = None
    outputs_absmax: float | None = None
    culprit_samples: list[Any] = field(default_factory=list)
    """Sample ids of the culprit subset bisection found ([] if none or not run)."""
    culprit_facts: list[SampleFact] = field(default_factory=list)
    """What is odd in the culprits' own data (replay/culprits/sample_facts.py), most telling first."""
    remedies: dict[str, bool | None] = field(default_factory=dict)
    """RemedyKind value -> whether that change made the step healthy (replay/judge/remedies.py; absent: not tried).
    A suggestion the remedies showed to be useless is not made."""
    tested_remedies: Any = None
    """The report's `remedies` block (replay/judge/remedies.try_remedies), when remedies were tried: the fixes that
    made the step healthy lead the verdict's suggestions (verdict.suggestions_with_remedies)."""
    evidence_bad_data: bool = False
    """The evidence against the culprits' records stands (replay/culprits/evidence.Evidence.bad_data, once what
    refutes it is applied): with tested remedies, a precision verdict then advises about the data too."""
    culprit_rank: int | None = None
    culprit_subset_size: int | None = None
    """Defaults to len(culprit_samples)."""
    candidates: int = 0
    """Samples that were bisected."""
    bisect_runs: int | None = None
    culprits_each_fail_alone: bool = False
    """The culprits are independent: each one alone makes the step fail (several bad samples)."""
    all_subsets_fail: bool = False
    """Every subset tried failed (every sample fails alone): the data is not what breaks it."""
    weights_nonfinite_at_start: bool = False
    fp32_reproduces: bool | None = None
    """True: still fails in fp32; False: finite in fp32; None: not re-run."""
    autocast_dtype: str | None = None
    param_dtype: str | None = None
    history_pattern: HistoryPattern | None = None
    history_signals: list[str] = field(default_factory=list)
    spike: bool | None = None
    """The trigger is a finite spike; None: derived from trigger_kind."""
    per_sample_top: list[dict] = field(default_factory=list)
    """Worst rows of `rank_by_loss(per_sample_stats(...))`, worst first."""
    rng_dependent: bool | None = None
    """True: the step fails with the recorded RNG but not from some other seed (a dropout mask, a random
    op); False: it failed from every other seed tried; None: not checked (report block `rng`)."""
    exception_type: str | None = None
    """trigger exception: the type the replay raised (e.g. IndexError)."""
    exception_message: str | None = None
    exception_detail: str | None = None
    """trigger exception: the data that made the op raise, in words ('token id 300 is outside [0, 64) ...')."""
    corrupted_weights: list[dict] = field(default_factory=list)
    """Parameters non-finite before the step: name, bad_elements, elements, slice_kind, bad_rows ..."""
    touching_samples: list | None = None
    """Samples whose input ids hit a corrupted embedding row (None: no corrupted embedding)."""
    samples_failing: list | None = None
    """Samples whose own replay is non-finite (per-sample table); None: not measured."""
    samples_checked: int = 0
    run_diverged: str | None = None
    """A sentence when the run was far off long before this step (forensics.replay.judge.history_pattern.diverged_long_ago):
    then a spike is that run's symptom, and no sample is blamed for it."""
    edge_share: float | None = None
    """The fp16 margin (replay/culprits/margin.py), set only when the state is at the edge: without the samples
    bisection isolated, the rest of the step still reaches this share of fp16's max. Then no sample is blamed."""
    edge_excluded: int = 0
    """The samples left out of the step to measure `edge_share`."""
    data_kind: str | None = None
    """'tokens' when the culprit's micro-batch holds integer tensors (token ids, labels), 'float' when it holds
    only floating-point data (features, embeddings, images): chooses the record-inspection hint."""
    rng_seeds_tried: int = 0
    """Other seeds the step was re-run from (without restoring the recorded RNG)."""
    out_of_memory: bool = False
    """The job's exception is running out of memory (GPU or host): sizes were measured (report exception.sizes)."""
    size_outliers: list[dict] = field(default_factory=list)
    """Out of memory: samples at least forensics.replay.culprits.sizes.OUTLIER_FACTOR x the step's median size, largest first."""
    median_size: float | None = None
    unblamed_group: int = 0
    """The smallest failing set bisection found when it was too large a share of the step to blame (the whole
    step or most of it: forensics.replay.stages.MAX_CULPRIT_SHARE); 0 otherwise. No sample is named then."""
    history_reading: list[str] = field(default_factory=list)
    """What the history shows before the loss left its start (forensics.replay.judge.history_pattern.read_history): where it
    left, the learning rate then, clipping, the healthy steps' grad norm. Empty when the loss never left it."""
    update_change: float | None = None
    """Window replay: how far this step's own update moved the weights (|update| / |weights|), set only when that
    is what broke the run (more than forensics.replay.judge.remedies.WRECK_RATIO with finite gradients and weights)."""
    lr: float | None = None
    """The step's learning rate (the optimizer's first parameter group)."""
    record_evidence: list[str] = field(default_factory=list)
    """Why the culprits' records are bad data (replay/culprits/evidence.py), in words; empty: they are triggers."""
    ordinary_record: str | None = None
    """For triggers: the culprit against the other samples ('its loss 4.2 against 4.1-4.24 for the other 15 ...')."""
    earlier_state: str | None = None
    """The earlier-state ablation in one sentence (replay/culprits/earlier_state.py); None: no earlier state."""
    earlier_state_healthy: bool | None = None
    """The culprits, fed to the earlier state, were healthy there (PaLM's test: the state, not the data); None: no
    earlier state was fed."""
    evidence_set_aside: list[str] = field(default_factory=list)
    """What was measured against a culprit but is no evidence (replay/culprits/evidence.py `set_aside`), or evidence
    the verdict rules found contradicted (`refuted_by`), in words."""
    refuted_by: list[str] = field(default_factory=list)
    """Set by the verdict rules (replay/judge/verdict.refutations), never by a caller: the replay's own findings that
    contradict calling the culprits bad data. Their evidence then counts for nothing."""
    fp32_ran: str | None = None
    """What the fp32 re-run ran, in words (forensics.report.wording.fp32_ran_words); None: no fp32 re-run."""
    fp32_unverified: bool = False
    """The fp32 re-run could not be held to float32 (a compute op still ran below it): no conclusion from it."""
    grad_norm_overflow: float | None = None
    """Every gradient value is finite but their norm overflows: the largest |gradient| (a diverged state)."""
    shared_ids: list[str] = field(default_factory=list)
    """Culprits whose ID other samples of the step carry and the replay does not blame, in words (replay/judge/
    assemble.py shared_id_words): no blocklist lists their ID, and the verdict says why."""
    ids_are_positional: bool = False
    replayed_grad_norm: float | None = None
    """The replayed step's total gradient norm (StepResult.grad_norm); None without backward."""
    recorded_step_loss: float | None = None
    """The step loss the job recorded (sum of its micro-batch losses / divisor); None when it recorded none."""
    replayed_step_loss: float | None = None
    healthy_grad_norm: float | None = None
    """The run's gradient norm before the loss left its start (history_pattern.HistoryReading.healthy_grad_norm)."""
    healthy_loss_ceiling: float | None = None
    """The top of the run's recorded healthy loss range (HistoryReading.healthy_loss_ceiling)."""
    healthy_steps: int = 0
    """The recorded steps `healthy_grad_norm` is the median of (HistoryReading.healthy_steps)."""
    sample_grad_norms: list[float] | None = None
    """Each sample's own gradient norm (the per-sample table; NaN where it is non-finite or the row raised); None: not
    measured."""
    sample_losses: list[float | None] | None = None
    """Each sample's own loss, in the order of `sample_grad_norms` (None where the row raised or has no loss); None:
    not given (then no row counts as diverging alone)."""
    earlier_state_source: str | None = None
    """A NaN gradient norm replayed finite: the earlier state the step's samples were fed to, in words; None: none."""
    earlier_sample_grad_norms: list[float] | None = None
    """Those samples' own gradient norms on the earlier state (NaN where non-finite or raised)."""
    earlier_sample_losses: list[float | None] | None = None
    """Their own losses there (None where the row raised or has no loss)."""
    """The samples the verdict names carry IDs made up from their position in the batch (the job recorded no
    sample IDs: manifest `ids_are_positional`): no blocklist lists them, and the verdict says how to record real
    IDs instead of promising a blocklist entry."""

    def __post_init__(self) -> None:
        for name, kind in (("trigger_kind", TriggerKind), ("phase", Phase), ("history_pattern", HistoryPattern)):
            value = getattr(self, name)
            if value is not None:
                try:
                    setattr(self, name, kind.parse(value))
                except ValueError as exc:
                    raise ValueError(f"VerdictFacts.{name}: {exc}") from None
        if self.spike is None:
            self.spike = self.trigger_kind.spike
        if self.culprit_subset_size is None:
            self.culprit_subset_size = len(self.culprit_samples)
        if self.culprit_rank is None:
            self.culprit_rank = self.rank
        if self.culprit_facts and not self.record_evidence:  # what is odd in the record's own data is evidence
            self.record_evidence = [fact.words for fact in self.culprit_facts]


@dataclass(frozen=True)
class DivergedHere:
    """The numbers that show a step reproduced as the run's divergence on this device, though not to the job's exact
    non-finite value (`diverged_here`)."""

    replayed_grad_norm: float
    healthy_grad_norm: float
    recorded_loss: float
    replayed_loss: float
    samples_over: int
    """Samples of the per-sample table whose own gradient norm (finite, with a finite loss) is past the bar."""
    smallest_sample_norm: float
    largest_sample_norm: float
    samples_nonfinite: int = 0
    """Samples whose own gradient norm is non-finite with a finite loss, as the job's step was (past any bar)."""
    sample_scale: float = 1.0
    """What a sample's own gradient norm is multiplied by to be in the step's units (`step_units`)."""
    earlier_source: str | None = None
    """The earlier state the samples were fed to and were healthy on; None: no earlier state was at hand."""
    earlier_largest_norm: float | None = None
    """The largest of their gradient norms there (in the step's units)."""

    @property
    def times_healthy(self) -> float:
        return self.replayed_grad_norm / self.healthy_grad_norm

    def as_dict(self) -> dict:
        """The report's `fidelity.diverged` block (docs/REPORT_FORMAT.md)."""
        out = {
            "replayed_grad_norm": self.replayed_grad_norm,
            "healthy_grad_norm": self.healthy_grad_norm,
            "times_healthy": self.times_healthy,
            "recorded_loss": self.recorded_loss,
            "replayed_loss": self.replayed_loss,
            "bar_times_healthy": DIVERGED_TIMES_HEALTHY,
            "samples_over": self.samples_over,
            "samples_nonfinite": self.samples_nonfinite,
            "sample_grad_norms": [self.smallest_sample_norm, self.largest_sample_norm],
            "sample_scale": self.sample_scale,
            "earlier_state": self.earlier_source,
        }
        if self.earlier_largest_norm is not None:
            out["earlier_largest_grad_norm"] = self.earlier_largest_norm
        return out


def step_units(losses: list[float | None], step_loss: float) -> float | None:
    """The factor that puts a sample's own gradient norm in the step's units. A per-sample row is the gradient of ONE
    sample's loss as the loss function returns it, not divided by the job's loss_divisor; the step's norm is that of
    sum(micro-batch losses) / loss_divisor (replay/judge/assemble.py, replay/stages.per_sample_rows). Whatever the
    reduction (a mean over samples with the default divisor, a sum with a divisor of tokens), step loss = a x the sum
    of every sample's own loss, so a step of N samples each like this one has a gradient norm of a x N x its own:
    a x N = the step loss / the mean of the samples' own losses, measured here (1 for a mean-reduced loss with the
    default divisor). None without a finite positive loss to measure it by."""
    finite = [v for v in losses if v is not None and math.isfinite(v) and v > 0]
    if not finite or not (math.isfinite(step_loss) and step_loss > 0):
        return None
    return step_loss / (sum(finite) / len(finite))


def _alone(norms: list[float], losses: list[float | None], bar: float, scale: float) -> tuple[list[float], int] | None:
    """The rows past `bar` alone (in the step's units) and the rows non-finite as the job's step was (a finite loss, a
    non-finite gradient norm); None when a row is healthy alone, raised, has no loss, or has a non-finite loss (not
    the job's way: its loss was finite) — each of those blocks the rule."""
    over, nonfinite = [], 0
    for norm, loss in zip(norms, losses, strict=True):
        if loss is None or not math.isfinite(loss):
            return None
        if not math.isfinite(norm):
            nonfinite += 1
        elif norm * scale >= bar:
            over.append(norm * scale)
        else:
            return None
    return over, nonfinite


def _healthy_earlier(f: VerdictFacts, bar: float, scale: float) -> tuple[bool, float] | None:
    """The earlier-state test, when it ran: (every sample healthy there, the largest finite norm there in the step's
    units). Healthy: a finite loss and a finite gradient norm under the bar. None: no earlier state was fed."""
    norms, losses = f.earlier_sample_grad_norms, f.earlier_sample_losses
    if not f.earlier_state_source or not norms or losses is None or len(losses) != len(norms):
        return None
    healthy = all(
        loss is not None and math.isfinite(loss) and math.isfinite(norm) and norm * scale < bar
        for norm, loss in zip(norms, losses)
    )
    finite = [v * scale for v in norms if math.isfinite(v)]
    return healthy, max(finite, default=math.nan)


def failing_on_earlier_state(f: VerdictFacts) -> int:
    """How many of the step's samples fed to the earlier state were not healthy there (a non-finite or missing loss, a
    non-finite norm, or one past the bar in the step's units); 0 when no earlier state was fed or no bar is known."""
    norms, losses, healthy = f.earlier_sample_grad_norms, f.earlier_sample_losses, f.healthy_grad_norm
    if not f.earlier_state_source or not norms or losses is None or len(losses) != len(norms) or not healthy:
        return 0
    scale = step_units(f.sample_losses or [], f.replayed_step_loss or math.nan) or 1.0
    bar = DIVERGED_TIMES_HEALTHY * healthy
    return sum(
        not (loss is not None and math.isfinite(loss) and math.isfinite(norm) and norm * scale < bar)
        for norm, loss in zip(norms, losses)
    )


def diverged_here(f: VerdictFacts) -> DivergedHere | None:
    """A non-finite gradient norm (with a finite loss) that this device did not reproduce to the job's NaN/Inf, while
    the step still diverges here as the run did: the replayed norm is DIVERGED_TIMES_HEALTHY x the run's healthy one
    or more, the replayed loss is the job's for the step (within SAME_LOSS_FACTOR) and EXPLODED_TIMES_CEILING x the top
    of its healthy loss range, and every sample of the per-sample table is past that bar alone. Then the step did
    reproduce, as a divergence (the same weights give gradients no finite-precision kernel can be trusted with: the
    job's NaN was where its kernels crossed).

    * Units: a sample's own gradient norm is put in the step's units before it meets the bar (`step_units`: the norm
      the step would have if every sample were this one), so a per-sample norm and the batch's healthy norm compare.
    * Past the bar alone: a row with a finite loss and a finite norm at or over the bar; a row with a finite loss and a
      non-finite norm (as the job's step) does not block; a row healthy alone, one that raised, one with no loss or a
      non-finite loss does: the rule does not fire.
    * State or data: every sample failing alone says only that no single record is to blame; a batch whose records
      are all bad (unnormalised inputs) fails alone on any weights too. When the samples were fed to an earlier state
      (the Guard's host snapshot, the window's checkpoint, from before the loss left its start: replay/pipeline.py),
      healthy there → the state (the rule fires, and says so);
      any of them past the bar or failing there too → the rule does not fire (the data is suspect, but no record
      evidence names it: the verdict rules decide as without this rule). With no earlier state the rule fires and
      its words name the test that would tell (a host snapshot).
    * Reference: the healthy norm must be the median of at least MIN_HEALTHY_STEPS recorded steps, or the samples
      must have been healthy on an earlier state (a measured reference).

    None otherwise: a replay in the run's normal range (a transient fault, a GPU-only kernel bug), a run with no
    healthy history to compare with, or a sample that is healthy alone stays not reproduced (never blamed from this).

    Example:
        >>> d = diverged_here(VerdictFacts("nonfinite_grad", False, replayed_grad_norm=9.7e6, recorded_step_loss=1.8e9,
        ...                                replayed_step_loss=1.77e9, healthy_grad_norm=2.93, healthy_loss_ceiling=6.2,
        ...                                healthy_steps=3, sample_grad_norms=[6.2e6, 1.3e7],
        ...                                sample_losses=[1.7e9, 1.84e9]))
        >>> f"{d.times_healthy:.3g}", d.samples_over
        ('3.31e+06', 2)
    """
    if f.reproduced or not f.trigger_local or f.trigger_kind is not TriggerKind.NONFINITE_GRAD:
        return None
    norm, healthy = f.replayed_grad_norm, f.healthy_grad_norm
    recorded, replayed, ceiling = f.recorded_step_loss, f.replayed_step_loss, f.healthy_loss_ceiling
    if norm is None or healthy is None or recorded is None or replayed is None or ceiling is None:
        return None
    if not all(math.isfinite(v) and v > 0 for v in (norm, healthy, recorded, replayed, ceiling)):
        return None
    bar = DIVERGED_TIMES_HEALTHY * healthy
    if norm < bar or max(recorded / replayed, replayed / recorded) > SAME_LOSS_FACTOR:
        return None
    if replayed < EXPLODED_TIMES_CEILING * ceiling:
        return None
    norms, losses = f.sample_grad_norms or [], f.sample_losses
    if not norms or losses is None or len(losses) != len(norms):
        return None
    scale = step_units(losses, replayed)
    alone = _alone(norms, losses, bar, scale) if scale is not None else None
    if scale is None or alone is None or not alone[0]:
        return None
    over, nonfinite = alone
    earlier = _healthy_earlier(f, bar, scale)
    if earlier is not None and not earlier[0]:
        return None  # the samples fail on the earlier state too: the records are suspect, not the state
    if earlier is None and f.healthy_steps < MIN_HEALTHY_STEPS:
        return None
    return DivergedHere(
        norm,
        healthy,
        recorded,
        replayed,
        len(over),
        min(over),
        max(over),
        nonfinite,
        scale,
        f.earlier_state_source if earlier is not None else None,
        earlier[1] if earlier is not None else None,
    )


def low_precision(f: VerdictFacts) -> str | None:
    for dtype in (f.autocast_dtype, f.param_dtype):
        if dtype is not None and str(dtype).lower() in LOW_PRECISION:
            return LOW_PRECISION[str(dtype).lower()]
    return None


def whole_batch(f: VerdictFacts) -> bool:
    """Bisection's 1-minimal failing set is every candidate, or most of them: no sample can be singled out."""
    return f.candidates > 1 and ((f.culprit_subset_size or 0) >= f.candidates or f.unblamed_group > 0)


def has_culprit(f: VerdictFacts) -> bool:
    return bool(f.culprit_samples) and not whole_batch(f)


def blames_data(f: VerdictFacts) -> bool:
    """A culprit subset AND evidence that its records are bad: only then is a sample called bad data."""
    return has_culprit(f) and bool(f.record_evidence)


def what(f: VerdictFacts) -> str:
    return f.trigger_kind.what_fails


__all__ = [
    "DIVERGED_TIMES_HEALTHY",
    "DivergedHere",
    "EXPLODED_TIMES_CEILING",
    "INPUT_PREFIX",
    "SAME_LOSS_FACTOR",
    "LOW_PRECISION",
    "MIN_HEALTHY_STEPS",
    "MAX_ID_CHARS",
    "MAX_NAMED_SAMPLES",
    "PROSE_DIGITS",
    "VerdictFacts",
    "blames_data",
    "diverged_here",
    "failing_on_earlier_state",
    "has_culprit",
    "low_precision",
    "step_units",
    "what",
    "whole_batch",
]
