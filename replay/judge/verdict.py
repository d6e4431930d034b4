"""Turn what the replay found into the report's verdict: kind, headline, explanation, suggestions.

`decide_verdict(VerdictFacts(...))` applies the rules below in order; the first that holds wins.

| rule                                                              | kind                    |
|-------------------------------------------------------------------|-------------------------|
| the replay did not fail                                           | `not_reproduced`        |
| weights non-finite before the step, or every sample fails alone   | `model_state`           |
| forward and backward finite, the optimizer update broke a weight  | `optimizer_update`      |
| finite in fp32, non-finite in float16 / bfloat16                  | `numerical_precision`   |
| a culprit subset, and evidence that its record is bad             | `bad_sample`            |
| a culprit subset, and nothing shows its record is bad             | `trigger_sample`        |
| a spike (finite trigger) with no culprit subset                   | `spike_no_single_cause` |
| anything else (non-finite, but only the whole batch fails)        | `model_state`           |

Before the weight / precision / sample rules, a spike whose own update wrecks the weights (window replay) or in a
run whose loss had long left where it started is `spike_no_single_cause` with no sample named; a step whose
gradients are all finite but whose norm overflows (a divergence) is `model_state`.
Evidence that a record is bad (replay/culprits/evidence.py): its data is odd on its own, its loss alone is an outlier,
it alone makes the loss non-finite in float32, or it still fails on an earlier state. Without any, the sample only
crossed first (`trigger_sample`): no blocklist, no "filter", and the advice is about the state. The fp32 re-run counts
only when it was checked to have run in float32 (replay/run/fp32.py).

The wording follows the field notes' "What a good forensic answer looks like" (../shared/FIELD-NOTES.md): the
headline is one sentence naming what broke and where; the explanation gives the evidence in the
triage order (where, reproduction, culprit, precision, history); suggestions are concrete.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from forensics.kinds import HistoryPattern, Phase, RemedyKind, SampleFactKind, TriggerKind, VerdictKind
from forensics.report.wording import fmt_id, fmt_num, mb_number
from replay.culprits.sample_facts import SampleFact

log = logging.getLogger(__name__)

LOW_PRECISION = {"float16": "float16", "half": "float16", "torch.float16": "float16", "fp16": "float16",
                 "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16", "bf16": "bfloat16"}
MAX_NAMED_SAMPLES = 3   # headlines name at most this many culprit samples
MAX_ID_CHARS = 80       # longer sample ids are cut in the headline (report.json keeps them whole)
PROSE_DIGITS = 6        # significant digits of numbers in verdict prose
# replay.localize.forward_backward.INPUT_MODULE + ".": a batch field that was non-finite itself
INPUT_PREFIX = "<input>."


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
    inputs_absmax: float | None = None
    outputs_absmax: float | None = None
    culprit_samples: list[Any] = field(default_factory=list)
    """Sample ids of the culprit subset bisection found ([] if none or not run)."""
    culprit_facts: list[SampleFact] = field(default_factory=list)
    """What is odd in the culprits' own data (replay/culprits/sample_facts.py), most telling first."""
    remedies: dict[str, bool | None] = field(default_factory=dict)
    """RemedyKind value -> whether that change made the step healthy (replay/judge/remedies.py; absent: not tried).
    A suggestion the remedies showed to be useless is not made."""
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
    """A sentence when the run was far off long before this step (replay.judge.history_pattern.diverged_long_ago):
    then a spike is that run's symptom, and no sample is blamed for it."""
    data_kind: str | None = None
    """'tokens' when the culprit's micro-batch holds integer tensors (token ids, labels), 'float' when it holds
    only floating-point data (features, embeddings, images): chooses the record-inspection hint."""
    rng_seeds_tried: int = 0
    """Other seeds the step was re-run from (without restoring the recorded RNG)."""
    out_of_memory: bool = False
    """The job's exception is running out of memory (GPU or host): sizes were measured (report exception.sizes)."""
    size_outliers: list[dict] = field(default_factory=list)
    """Out of memory: samples at least replay.culprits.sizes.OUTLIER_FACTOR x the step's median size, largest first."""
    median_size: float | None = None
    unblamed_group: int = 0
    """The smallest failing set bisection found when it was too large a share of the step to blame (the whole
    step or most of it: replay.engine.MAX_CULPRIT_SHARE); 0 otherwise. No sample is named then."""
    history_reading: list[str] = field(default_factory=list)
    """What the history shows before the loss left its start (replay.judge.history_pattern.read_history): where it
    left, the learning rate then, clipping, the healthy steps' grad norm. Empty when the loss never left it."""
    update_change: float | None = None
    """Window replay: how far this step's own update moved the weights (|update| / |weights|), set only when that
    is what broke the run (more than replay.judge.remedies.WRECK_RATIO with finite gradients and weights)."""
    lr: float | None = None
    """The step's learning rate (the optimizer's first parameter group)."""
    record_evidence: list[str] = field(default_factory=list)
    """Why the culprits' records are bad data (replay/culprits/evidence.py), in words; empty: they are triggers."""
    ordinary_record: str | None = None
    """For triggers: the culprit against the other samples ('its loss 4.2 against 4.1-4.24 for the other 15 ...')."""
    earlier_state: str | None = None
    """The earlier-state ablation in one sentence (replay/culprits/earlier_state.py); None: no earlier state."""
    fp32_ran: str | None = None
    """What the fp32 re-run ran, in words (replay.run.fp32.ran_words); None: no fp32 re-run."""
    fp32_unverified: bool = False
    """The fp32 re-run could not be held to float32 (a compute op still ran below it): no conclusion from it."""
    grad_norm_overflow: float | None = None
    """Every gradient value is finite but their norm overflows: the largest |gradient| (a diverged state)."""
    ids_are_positional: bool = False
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


# --- wording helpers --------------------------------------------------------------------------

def _num(value: Any) -> str:
    return fmt_num(value, PROSE_DIGITS)


def _id(sample_id: Any) -> str:
    return fmt_id(sample_id, MAX_ID_CHARS)


def _listed(f: VerdictFacts, whom: str) -> str:
    """' (blocklist.jsonl lists the culprits)'; nothing for made-up positional IDs, which no blocklist lists."""
    return "" if f.ids_are_positional else f" (blocklist.jsonl lists {whom})"


def _no_blocklist(f: VerdictFacts) -> list[str]:
    """Samples named by made-up positions ('step5/rank0/mb0/2'): why no blocklist names them, and the fix."""
    named = f.culprit_samples or [o.get("sample_id") for o in f.size_outliers]
    if not (f.ids_are_positional and named):
        return []
    return [f"No blocklist entry for {_id(named[0])}: the job recorded no sample IDs for its micro-batch, so the "
            "replay names samples by their position in the batch, which does not identify a record of the dataset. "
            "Record real IDs (guard.record_batch(batch, sample_ids=ids), or a 'sample_ids' key in dict batches) to "
            "get a blocklist."]


def _samples_phrase(f: VerdictFacts, lower: bool = False) -> str:
    """"Sample 'x' alone" / "Samples 'a' and 'b' together (neither alone)" / "3 samples together (...)"."""
    ids = [_id(s) for s in f.culprit_samples[:MAX_NAMED_SAMPLES]]
    n = f.culprit_subset_size or len(f.culprit_samples)
    if n == 1:
        text = f"Sample {ids[0]}" + ("" if lower else " alone")
    elif f.culprits_each_fail_alone:
        more = f" and {n - len(ids)} more" if n > len(ids) else ""
        text = f"{n} samples, each of them on its own, ({', '.join(ids)}{more})"
    elif n == 2 and len(ids) == 2:
        text = f"Samples {ids[0]} and {ids[1]} together, neither alone,"
    else:
        more = f" and {n - len(ids)} more" if n > len(ids) else ""
        text = f"{n} samples together ({', '.join(ids)}{more}; none of them can be left out)"
    return text[0].lower() + text[1:] if lower else text


def _where_step(f: VerdictFacts, micro_batch: bool = True) -> str:
    text = f"step {f.step}" if f.step is not None else "the step"
    extra = []
    if f.rank is not None:
        extra.append(f"rank {f.rank}")
    if f.micro_batch is not None and micro_batch:
        of = f" of {f.num_micro_batches}" if f.num_micro_batches else ""
        extra.append(f"micro-batch {mb_number(f.micro_batch)}{of}")
    return text + (f" ({', '.join(extra)})" if extra else "")


def _where_value(f: VerdictFacts, details: list[str] | None = None) -> str:
    """' in the forward pass at `m` (aten::mm; <details>)', or '' when localisation found nothing."""
    if f.phase is None and f.module is None:
        return ""
    text = f" in the {f.phase} pass" if f.phase is not None and f.phase.is_pass else ""
    if f.module:
        text += f" at `{f.module}`"
    notes = ([f.op] if f.op else []) + list(details or [])
    if notes:
        text += f" ({'; '.join(notes)})"
    return text


def _low_precision(f: VerdictFacts) -> str | None:
    for dtype in (f.autocast_dtype, f.param_dtype):
        if dtype is not None and str(dtype).lower() in LOW_PRECISION:
            return LOW_PRECISION[str(dtype).lower()]
    return None


def _evidence(f: VerdictFacts) -> list[str]:
    """The field notes' answer, sentence by sentence: where, reproduction, localisation, culprit."""
    out = []
    where = [f"Step {f.step}" if f.step is not None else "The failing step"]
    if f.rank is not None:
        where.append(f"rank {f.rank}")
    if f.micro_batch is not None:
        where.append(f"micro-batch {mb_number(f.micro_batch)}" + (f" of {f.num_micro_batches}" if f.num_micro_batches else ""))
    trigger = f.trigger_kind.words
    numbers = ([_num(f.trigger_value)] if f.trigger_value is not None else []) + \
        ([f"threshold {_num(f.threshold)}"] if f.threshold is not None else [])
    if numbers:
        trigger += f" ({', '.join(numbers)})"
    out.append(", ".join(where) + f": {trigger}.")
    if f.reproduced:
        how = "bit for bit" if f.bitwise else "within tolerance" if f.bitwise is False else ""
        on = f" on {f.replay_device}" if f.replay_device else ""
        out.append(f"Reproduced {how}{on}.".replace("  ", " ").replace(" .", "."))
    if f.phase is not None or f.module is not None:
        stats = []
        for label, value in (("input", f.inputs_absmax), ("output", f.outputs_absmax)):
            if value is not None:
                stats.append(f"{label} holds NaN" if math.isnan(value) else f"{label} abs-max {_num(value)}")
        if f.parameter and f.phase in (Phase.BACKWARD, Phase.OPTIMIZER):
            stats.append(f"parameter `{f.parameter}`")
        located = _where_value(f, stats) if (f.module or (f.phase is not None and f.phase.is_pass)) \
            else f" in the {f.phase} step" + (f" ({'; '.join(stats)})" if stats else "")
        if f.module and f.module.startswith(INPUT_PREFIX):
            field = f.module[len(INPUT_PREFIX):]
            value = f.inputs_absmax
            held = "NaN" if value is not None and math.isnan(value) else "Inf" if value is not None and \
                math.isinf(value) else "NaN/Inf"
            out.append(f"The batch's own `{field}` already holds {held} before any layer runs: the data is the "
                       "source, not a module.")
        else:
            out.append(f"The first non-finite value appears{located}.")
    if _has_culprit(f):
        runs = f" (found in {f.bisect_runs} replays of {f.candidates} samples)" if f.bisect_runs is not None else ""
        phrase = _samples_phrase(f).rstrip(",")
        label = "Culprit" if f.record_evidence else "First to cross"
        out.append(f"{label}: {phrase[0].lower() + phrase[1:]}{runs}.")
        if f.record_evidence:
            out.append(f"Evidence against the record: {'; '.join(f.record_evidence[:3])}.")
        elif f.ordinary_record:
            out.append(f"Its record looks like the others: {f.ordinary_record}.")
        if f.earlier_state:
            out.append(f.earlier_state)
    elif f.unblamed_group and f.bisect_runs is not None:
        test = "whose removal ends the spike" if f.spike else "that fails"
        out.append(f"Bisecting {f.candidates} samples ({f.bisect_runs} replays): the smallest set {test} is "
                   f"{f.unblamed_group} of the {f.candidates} samples, too large a share of the step to blame any "
                   "of them.")
    elif f.candidates > 1 and f.bisect_runs is not None:
        out.append(f"Bisecting {f.candidates} samples ({f.bisect_runs} replays) found no smaller subset that fails.")
    if f.rng_dependent:
        seeds = f"{f.rng_seeds_tried} other seed{'s' if f.rng_seeds_tried != 1 else ''}"
        out.append(f"Re-run from {seeds} instead of the recorded RNG, the step is healthy: the failure "
                   "depends on the random state (a dropout mask or another random op).")
    elif f.rng_dependent is False and f.rng_seeds_tried:
        out.append(f"It fails from {f.rng_seeds_tried} other seeds too, so the random state is not the cause.")
    low = _low_precision(f)
    checked = f" (checked: {f.fp32_ran})" if f.fp32_ran else ""
    if f.fp32_unverified:
        out.append(f"The fp32 re-run could not be held to float32{checked}: no conclusion is drawn from it.")
    elif f.fp32_reproduces is False:
        healthy = "does not spike" if f.spike else "is finite"
        out.append(f"In fp32{checked} the step {healthy} → {'precision + data' if _blames_data(f) else 'precision'}.")
    elif f.fp32_reproduces is True and low:
        out.append(f"It fails in fp32 too{checked}, so {low} is not the cause.")
    return out


def _history_sentences(f: VerdictFacts) -> list[str]:
    out = [f.run_diverged] if f.run_diverged else []
    if f.history_pattern:
        out.append(f"Loss history: {f.history_pattern.means(f.trigger_kind)}.")
    out.extend(f.history_reading)
    out.extend(f.history_signals)
    return out


_LOG_OPS = {"log", "log2", "log10", "log1p", "xlogy"}
_DIV_OPS = {"div", "true_divide", "reciprocal", "floor_divide"}
_NORM_OPS = {"sqrt", "rsqrt", "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "native_batch_norm",
             "batch_norm", "group_norm", "native_group_norm"}
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}


def _op_base(op: str | None) -> str:
    """'aten::div.Tensor' -> 'div'; 'aten::add_' -> 'add'."""
    return (op or "").split("::")[-1].split(".")[0].rstrip("_").lower()


def _op_hints(f: VerdictFacts) -> list[str]:
    op = _op_base(f.op)
    parts = (f.module or "").lower().split(".")
    hints = []
    if op in _LOG_OPS:
        hints.append("Guard the log: clamp its input away from 0 (x.clamp_min(1e-6)) or use log_softmax / "
                     "cross_entropy on logits instead of log(softmax).")
    if op in _DIV_OPS:
        hints.append("Guard the division: a denominator of 0 (e.g. a mean over zero unmasked tokens) "
                     "gives 0/0; clamp it or skip samples with nothing to average.")
    if "softmax" in op:
        hints.append("A fully masked row (all -inf) makes softmax NaN: make sure every row keeps at "
                     "least one unmasked position.")
    if op == "exp":
        hints.append("exp overflows above ~88 in fp32 (~11 in fp16): subtract the maximum first "
                     "(logsumexp / softmax do this for you).")
    if op in _NORM_OPS or any("norm" in p or p.startswith("ln") for p in parts if p):
        huge = f.inputs_absmax is not None and (not math.isfinite(f.inputs_absmax) or f.inputs_absmax > 1e18)
        if huge:  # the square of the input overflows the variance: eps is not the problem
            hints.append("The normalisation's input is enormous (its square overflows the variance): find "
                         "where such values enter (the sample's features, an unscaled input, a residual "
                         "stream that grows every layer) rather than changing eps.")
        else:
            hints.append("Raise the normalisation eps (1e-5 or 1e-6 rather than 1e-8 or 0): a near-zero "
                         "hidden vector divides by ~0.")
    if op in _MATMUL_OPS and _low_precision(f) == "float16":
        hints.append("A matmul output above 65504 overflows float16: bfloat16 keeps fp32's range, or "
                     "scale the activations down (e.g. a norm before this layer).")
    return hints


def _pattern_hints(f: VerdictFacts) -> list[str]:
    if f.history_pattern is HistoryPattern.EXPONENTIAL_GROWTH:
        return ["The loss grew exponentially before the failure: lower the learning rate or lengthen "
                "warm-up, and check that the loss is divided by the number of accumulation steps."]
    if f.history_pattern is HistoryPattern.DIVERGED:
        return ["The loss sits far above where the run started: lower the learning rate (or lengthen the "
                "warm-up) and restart from a checkpoint taken before the loss left its start."]
    if f.history_pattern is HistoryPattern.OSCILLATING_DIVERGENCE:
        return ["The loss oscillated with growing swings: check the optimizer state (Adam's exp_avg / "
                "exp_avg_sq, e.g. after a resume) for corruption, and the batch distribution for a shift."]
    return []


def _result(kind: VerdictKind, headline: str, f: VerdictFacts, suggestions: list[str],
            reading: str | None = None) -> dict:
    evidence = _evidence(f) + ([reading] if reading else []) + _history_sentences(f)
    unique = list(dict.fromkeys(s for s in suggestions + _no_blocklist(f) if s))
    log.info("verdict %s: %s", kind, headline)
    return {"kind": kind.value, "headline": headline, "explanation": " ".join(evidence), "suggestions": unique}


# --- the rules --------------------------------------------------------------------------------

def decide_verdict(facts: VerdictFacts) -> dict:
    """The report's `verdict` section from the replay's findings (rules in the module docstring).

    Args:
        facts: what the replay established.
    Returns:
        `{"kind", "headline", "explanation", "suggestions"}` with kind a forensics.kinds.VerdictKind value.
    Example:
        >>> v = decide_verdict(VerdictFacts("nonfinite_loss", True, step=41217, rank=3,
        ...                                 culprit_samples=["shard-0192/rec-55411"], candidates=32,
        ...                                 bisect_runs=6, phase="forward",
        ...                                 module="model.layers.17.mlp.down_proj", op="aten::mm"))
        >>> v["kind"], v["headline"]
        ('bad_sample', "Sample 'shard-0192/rec-55411' alone makes the loss non-finite at step 41217 (rank 3) in the forward pass at `model.layers.17.mlp.down_proj` (aten::mm).")
    """
    f = facts
    if not f.reproduced and not f.trigger_local:
        return _inherited(f)
    if not f.reproduced:
        return _not_reproduced(f)
    if f.trigger_kind is TriggerKind.EXCEPTION:
        return _exception_verdict(f)
    if f.spike and f.update_change is not None and not _has_culprit(f):
        return _update_too_large(f)
    if f.spike and (f.run_diverged or f.history_pattern is HistoryPattern.DIVERGED):
        return _diverged(f)
    precision = f.fp32_reproduces is False and (_low_precision(f) is not None or f.fp32_ran is not None)
    if f.grad_norm_overflow is not None and not f.weights_nonfinite_at_start:
        return _norm_overflow(f)
    if f.weights_nonfinite_at_start or (f.all_subsets_fail and not precision):
        return _model_state(f)
    if f.phase is Phase.OPTIMIZER:
        return _optimizer_update(f)
    if precision:  # every sample failing alone, or none to blame, and finite in fp32: the precision is the cause
        return _numerical_precision(f)
    if _has_culprit(f):
        return _bad_sample(f) if f.record_evidence else _trigger_sample(f)
    if f.spike:
        return _spike(f)
    return _model_state(f)


def _whole_batch(f: VerdictFacts) -> bool:
    """Bisection's 1-minimal failing set is every candidate, or most of them: no sample can be singled out."""
    return f.candidates > 1 and ((f.culprit_subset_size or 0) >= f.candidates or f.unblamed_group > 0)


def _has_culprit(f: VerdictFacts) -> bool:
    return bool(f.culprit_samples) and not _whole_batch(f)


def _blames_data(f: VerdictFacts) -> bool:
    """A culprit subset AND evidence that its records are bad: only then is a sample called bad data."""
    return _has_culprit(f) and bool(f.record_evidence)


def _what(f: VerdictFacts) -> str:
    return f.trigger_kind.what_fails


def _inherited(f: VerdictFacts) -> dict:
    """A rank whose own step is healthy: the fault reached it from another rank (e.g. via the all-reduce)."""
    rank = f"rank {f.rank}" if f.rank is not None else "this rank"
    step = f"step {f.step}" if f.step is not None else "the step"
    headline = (f"{rank[0].upper() + rank[1:]}'s own part of {step} is healthy: the fault came from another "
                "rank, whose dump holds the culprit.")
    reading = (f"The Guard on {rank} triggered because another rank saw a non-finite loss or gradient (trigger "
               "'local: false'); replaying this rank's own micro-batches gives a finite step, as expected.")
    return _result(VerdictKind.NOT_REPRODUCED, headline, f, [
        "Replay the rank that saw the fault first-hand: forensics replay STEP_DIR (it picks that rank) or "
        "--rank R for the rank whose manifest says trigger.local = true.",
        "forensics replay STEP_DIR --all-ranks replays every rank and names the one carrying the culprit.",
    ], reading)


def _not_reproduced(f: VerdictFacts) -> dict:
    numbers = ""
    if f.trigger_kind is TriggerKind.EXCEPTION:
        numbers = (f": it raised {f.exception_type} there instead" if f.exception_type else
                   ": the step finished without raising")
    elif f.trigger_value is not None or f.replayed_value is not None:
        numbers = f": recorded {_num(f.trigger_value)}, replayed {_num(f.replayed_value)}"
    on = f" on {f.replay_device}" if f.replay_device else ""
    words = f.trigger_kind.words
    headline = f"The replay{on} did not reproduce the {words} of {_where_step(f)}{numbers}."
    reading = ("The same weights, batch and RNG gave a healthy step here, so the failure depends on "
               "something the dump does not carry: the GPU, the kernels chosen, non-deterministic "
               "reductions, distributed state from other ranks, or the hardware itself.")
    if f.environment_warnings:
        reading += " Differences between the job and this replay: " + "; ".join(f.environment_warnings) + "."
    rank = f" on the node of rank {f.rank}" if f.rank is not None else ""
    if f.out_of_memory:
        return _memory_not_reproduced(f, headline)
    if f.unit_factor:
        return _other_units(f, headline)
    return _result(VerdictKind.NOT_REPRODUCED, headline, f, [
        "Replay on the same GPU model, driver and torch version as the job (the environment "
        "warnings list what differs).",
        "Make the job deterministic so replays compare bit for bit: torch.use_deterministic_algorithms(True), "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8, torch.backends.cudnn.benchmark = False.",
        "Check the other ranks' dumps: state exchanged between ranks (all-reduce, sharded optimizer) "
        "is not replayed from one rank.",
        f"If the same GPU and settings still do not reproduce it, suspect the hardware (silent data "
        f"corruption): run the vendor's diagnostics (e.g. DCGM level 3){rank}.",
    ], reading)


def _other_units(f: VerdictFacts, headline: str) -> dict:
    """Not reproduced, but the ratio of recorded to replayed is a factor the job recorded: a unit, not the hardware."""
    factor = f.unit_factor or ""  # set: the caller checked
    reading = (f"{factor[0].upper() + factor[1:]}: the job and the replay measured the same step in "
               "different units, so the two numbers cannot be compared as they are. This is not a sign of "
               "non-determinism or of the hardware.")
    suggestions = []
    if "loss scale" in factor:
        suggestions.append("Pass check() the norm of unscaled gradients: call scaler.unscale_(optimizer) before "
                           "clip_grad_norm_, or call check() without grad_norm (the Guard divides the loss scale out "
                           "of its own norm); clipping thresholds are then in the same units too.")
    if "world size" in factor:
        suggestions.append("The recorded value covers every rank (summed, or not averaged); replay this step with "
                           "--all-ranks to compare the whole job's value.")
    if "accumulation" in factor:
        suggestions.append("The loop divides (or does not divide) by the number of micro-batches where the Guard "
                           "assumes otherwise: set GuardConfig.detection.loss_divisor to what the loop divides each "
                           "micro-batch loss by.")
    return _result(VerdictKind.NOT_REPRODUCED, headline, f, suggestions, reading)


def _memory_not_reproduced(f: VerdictFacts, headline: str) -> dict:
    """The job ran out of memory and this replay did not (a device with more memory): the sizes still speak."""
    suggestions = ["Replay on a device with no more memory than the job's (report.json exception.memory holds the "
                   "job's allocated / reserved / total), or cap this process's memory, to reproduce it."]
    reading = "The job ran out of memory where this replay, with more memory, did not."
    if f.size_outliers:
        reading += f" {_size_words(f)}: the likely cause."
        suggestions.insert(0, f"{_filter_oversized(f)}, and cap the sequence length so one long sample cannot "
                              "set the size of a whole micro-batch.")
    else:
        reading += " No sample of the step is far larger than the others: the step as a whole needs more memory."
        suggestions.insert(0, "Lower the micro-batch size (with more gradient accumulation), or use activation "
                              "checkpointing.")
    return _result(VerdictKind.NOT_REPRODUCED, headline, f, suggestions, reading)


def _corruption_words(f: VerdictFacts) -> str:
    """'`model.embed_tokens.weight` holds 8 non-finite values (+inf) in token ids [99]' for the first ones."""
    parts = []
    for entry in f.corrupted_weights[:2]:
        kinds = [word for key, word in (("nan", "NaN"), ("pos_inf", "+inf"), ("neg_inf", "-inf")) if entry.get(key)]
        text = f"`{entry.get('name')}` holds {entry.get('bad_elements')} non-finite value(s) ({', '.join(kinds)})"
        rows = entry.get("bad_rows")
        if rows and entry.get("slice_kind") and entry.get("bad_row_count", 0) < (entry.get("shape") or [0])[0]:
            more = f" and {entry['bad_row_count'] - len(rows)} more" if entry["bad_row_count"] > len(rows) else ""
            text += f" in {entry['slice_kind']} {rows}{more}"
        parts.append(text)
    if len(f.corrupted_weights) > 2:
        parts.append(f"{len(f.corrupted_weights) - 2} more parameters")
    return "; ".join(parts)


def _model_state(f: VerdictFacts) -> dict:
    at = _where_step(f)
    if f.weights_nonfinite_at_start:
        where = _corruption_words(f)
        which = f": {where}" if where else (f", first in `{f.parameter}`" if f.parameter else "")
        all_failing = f.samples_failing
        if all_failing is not None and f.samples_checked and len(all_failing) < f.samples_checked:
            failing = f.touching_samples if f.touching_samples else all_failing
            named = ", ".join(_id(s) for s in failing[:MAX_NAMED_SAMPLES]) + \
                (f" and {len(failing) - MAX_NAMED_SAMPLES} more" if len(failing) > MAX_NAMED_SAMPLES else "")
            headline = (f"The weights were already non-finite before {_where_step(f, micro_batch=False)}{which}; "
                        f"only the samples that meet them fail ({named}: {len(all_failing)} of "
                        f"{f.samples_checked}), the others are finite.")
            reading = ("A few slices of the weights hold NaN/Inf, so only the samples that use them fail; the update "
                       "that broke them happened at an earlier, unchecked step (this step's data only decides "
                       "who meets them).")
        else:
            headline = (f"The weights were already non-finite before {_where_step(f, micro_batch=False)}{which}: "
                        "an earlier step broke them.")
            reading = ("The pre-step weights hold NaN/Inf, so every forward fails whatever the data; the "
                       "update that broke them happened at an earlier, unchecked step.")
        suggestions = ["Find the step that broke them: `forensics replay DUMP --from CHECKPOINT --trust` "
                       "re-executes the recorded steps from an earlier checkpoint (the job needs "
                       "GuardConfig(dumping=DumpConfig(data_recipe=...)); "
                       "GuardConfig(recording=RecordConfig(snapshot_every=K)) makes the Guard keep its own "
                       "snapshot, so no checkpoint is needed).",
                       "Or go back to the last checkpoint with finite weights and train forward from it with "
                       "GuardConfig(detection=DetectionConfig(verify_update=True)), which checks the weights after "
                       "every optimizer step and dumps the update that breaks them (trigger nonfinite_param).",
                       "Check that gradient clipping runs after backward and before optimizer.step(), and "
                       "that skipped steps (loss-scale overflow) really skip the update."]
    elif f.rng_dependent:
        return _rng_dependent(f)
    elif f.all_subsets_fail:
        headline = (f"Every subset of samples tried fails on its own at {at}: the model state, not the "
                    "data, is broken.")
        reading = ("Bisection could not find a sample to blame: every subset it replayed failed, down to "
                   "single samples, so the weights or buffers make any input fail.")
        suggestions = ["Look at the pre-step weights: parameters with a huge abs-max or a collapsed "
                       "norm layer (the per-layer table) show where the state went bad.",
                       "Resume from an earlier checkpoint with a lower learning rate or longer warm-up.",
                       "Check the optimizer state for NaN/Inf or exp_avg_sq == 0 if the job was resumed."]
    elif _whole_batch(f):
        most = (f"{f.unblamed_group} of its {f.candidates} samples together" if f.unblamed_group
                and f.unblamed_group < f.candidates else "the whole micro-batch")
        headline = (f"{at[0].upper() + at[1:]} fails only with {most}: no small subset of samples makes it fail, "
                    "so no sample is to blame.")
        reading = ("The failure needs every sample of the batch together: a batch-level effect (a sum or "
                   "mean that overflows over the whole batch, normalisation statistics, a loss averaged "
                   "over all tokens) or the model state itself.")
        suggestions = ["Look for a reduction over the whole batch that overflows (sums in fp16, token "
                       "counts); try a smaller micro-batch.",
                       "Look at the pre-step weights and optimizer state for huge values (per-layer table)."]
    else:
        headline = (f"{at[0].upper() + at[1:]} fails again in the replay, but no sample, precision or "
                    "optimizer finding explains it: suspect the model state.")
        reading = ("No culprit subset of samples was found (bisection did not run or found none), and "
                   "neither the optimizer update nor an fp32 re-run points elsewhere.")
        suggestions = ["Look at the pre-step weights and optimizer state for huge values (per-layer table).",
                       "If bisection was skipped, run the replay with it to see whether some samples alone "
                       "make the step fail."]
    return _result(VerdictKind.MODEL_STATE, headline, f, suggestions + _pattern_hints(f) + _op_hints(f), reading)


def _rng_dependent(f: VerdictFacts) -> dict:
    """model_state's wording when the failure needs the recorded random state (kind stays model_state)."""
    at = _where_step(f)
    words = f.trigger_kind.words
    headline = (f"The {words} at {at}{_where_value(f)} depends on the random state: it comes back with the "
                "dump's RNG and goes away from other seeds, so one draw of a random op (a dropout mask) "
                "makes it, not a sample or the weights alone.")
    reading = ("With each micro-batch's recorded RNG the step fails"
               + (" for every subset of samples tried" if f.all_subsets_fail else "")
               + "; without it the same weights and batch give a healthy step. A computation after a "
               "random op cannot survive every draw: e.g. a -log of a sum that dropout can zero entirely. "
               "It will happen again, at random steps, until that computation is guarded.")
    op = _op_base(f.op)
    suggestions = []
    if op in _LOG_OPS:
        suggestions.append("The NaN/Inf needs this dropout mask: a -log of a sum that dropout can zero. Guard "
                           "the log (clamp its input, e.g. x.clamp_min(1e-6), or add a small constant) or "
                           "apply the random op where it cannot zero everything the log depends on.")
    elif op in _DIV_OPS:
        suggestions.append("The NaN/Inf needs this random draw: a division by a sum or count that dropout "
                           "can zero. Clamp the denominator or skip the term when it is 0.")
    suggestions += [
        "Make the computation after the random op safe for every draw (clamp / guard the log, division or "
        "normalisation that follows the dropout), rather than changing the data or the weights.",
        "Do not blocklist samples or roll back for this: the samples and the weights are fine; resuming "
        "with another RNG state will likely pass this step, but the failure will come back at random.",
    ]
    hints = [] if op in _LOG_OPS | _DIV_OPS else _op_hints(f)
    return _result(VerdictKind.MODEL_STATE, headline, f, suggestions + hints + _pattern_hints(f), reading)


def _optimizer_update(f: VerdictFacts) -> dict:
    name = f.optimizer_class.rsplit(".", 1)[-1] if f.optimizer_class else "optimizer"
    param = f" `{f.parameter}`" if f.parameter else " a parameter"
    why = f" ({f.optimizer_state})" if f.optimizer_state else ""
    headline = (f"The forward and backward passes of {_where_step(f)} are finite; the {name} update "
                f"made{param} non-finite{why}.")
    state = (f.optimizer_state or "").lower()
    suggestions = []
    if "eps" in state:
        suggestions.append("Raise the optimizer's eps (e.g. 1e-8, not 0): with eps == 0 a zero second "
                           "moment divides 0 by 0.")
    lower_lr_helps = f.remedies.get(RemedyKind.LOWER_LR.value) is not False
    if ("lr" in state or "learning rate" in state) and lower_lr_helps:
        suggestions.append("Lower the learning rate; the update itself is too large.")
    if any(w in state for w in ("nan", "inf", "non-finite", "corrupt")):
        suggestions.append("The optimizer state itself is broken: restart from a checkpoint with "
                           "healthy optimizer state (or re-initialise it) rather than resuming this one.")
    suggestions.append(f"Inspect the optimizer state of{param} (exp_avg, exp_avg_sq): zeros, NaN/Inf, or values that "
                       "grew step after step.")
    if lower_lr_helps:
        suggestions.append("Lower the learning rate or lengthen warm-up; check weight decay is not too large.")
    if f.remedies.get(RemedyKind.CLIP_GRAD.value) is not False:
        suggestions.append("Clip gradients (clip_grad_norm_ after backward, before optimizer.step()).")
    return _result(VerdictKind.OPTIMIZER_UPDATE, headline, f, suggestions + _pattern_hints(f))


def _numerical_precision(f: VerdictFacts) -> dict:
    dtype = _low_precision(f) or "float16 / bfloat16"
    with_data = _blames_data(f)
    who = f" and only with {_samples_phrase(f, lower=True).rstrip(',')}," if with_data else ""
    at = _where_step(f)
    where = ("," if not with_data and _where_value(f) else "") + _where_value(f)
    fails, fine = ("spikes", "it does not") if f.spike else ("goes non-finite", "it is finite")
    every = " with every sample on its own" if f.all_subsets_fail and not with_data else ""
    headline = (f"{at[0].upper() + at[1:]} {fails} only in {dtype}{who}{every}{where}; "
                f"in fp32 {fine}" + (": precision + data." if with_data else "."))
    suggestions = []
    if with_data:
        ids = ", ".join(_id(s) for s in f.culprit_samples[:MAX_NAMED_SAMPLES])
        suggestions.append(f"Filter {ids} from the data{_listed(f, 'the culprits')}: "
                           f"{'it pushes' if len(f.culprit_samples) == 1 else 'they push'} the activations "
                           f"out of {dtype}'s range.")
    if _has_culprit(f) and not with_data:
        suggestions.append(f"Do not filter {_id(f.culprit_samples[0])}: nothing marks its record as bad; it is only the "
                           "first sample to cross on a state at the edge of the format, and the next one like it "
                           "would cross too.")
    if dtype == "float16":
        suggestions.append("Switch autocast from float16 to bfloat16: same speed on Ampere and newer, "
                           "fp32's range, no overflow at 65504; keep dynamic loss scaling while on fp16.")
    elif with_data:
        suggestions.append("Keep bfloat16: the sample is the trigger, not the format.")
    else:
        target = f"`{f.module}`" if f.module else "the failing module"
        suggestions.append(f"Keep bfloat16 but run {target} in fp32: wrap it in torch.autocast(..., "
                           "enabled=False) and cast its input to float32.")
    return _result(VerdictKind.NUMERICAL_PRECISION, headline, f, suggestions + _op_hints(f) + _pattern_hints(f))


_RECORD_HINTS = {
    "tokens": ("Look at the record behind it: empty or zero-length, control characters only, very long strings "
               "without spaces (base64, binary), mis-encoded text, every label masked (-100)."),
    "float": ("Look at the record behind it: NaN/Inf or extreme values in its features (see the input abs-max), "
              "all-zero or constant rows, values in the wrong units or unscaled, a corrupted or truncated file."),
}


_FACT_FIXES = {
    SampleFactKind.TOO_LONG: "truncate samples to the model's context length (the tokenizer's max_length or the "
                             "collate function), or drop them; raising max_position_embeddings needs the new "
                             "positions trained.",
    SampleFactKind.LABELS_MASKED: "drop samples with no supervised token before batching (a prompt truncated past "
                                  "its answer, an empty completion), or divide the summed loss by max(number of "
                                  "label tokens, 1).",
    SampleFactKind.NO_ATTENTION: "drop samples left with zero tokens (by truncation or filtering) before batching.",
    SampleFactKind.NONFINITE_VALUES: "fix the preprocessing that produced them (a division by zero, log of 0, a "
                                     "corrupted or truncated file) or drop the record.",
    SampleFactKind.EXTREME_VALUES: "check this field's units and scaling in preprocessing (normalise or clip it), "
                                   "or drop the record.",
    SampleFactKind.ALL_ZERO: "check why the record is all zeros (a failed read, missing values filled with 0) and fix "
                             "or drop it.",
    SampleFactKind.REPEATED_NGRAMS: "deduplicate or filter documents dominated by repeated n-grams (OLMo 2 removed "
                                    "such spans, and their spikes with them).",
}
_DIVISION_FIX = "drop such records, or guard the division (clamp the sum or norm to at least eps)."


def _data_hint(f: VerdictFacts) -> str:
    """The first suggestion about the culprit's record: what its data shows, else where to look."""
    if not f.culprit_facts:
        return _RECORD_HINTS[f.data_kind or "tokens"]
    fact = f.culprit_facts[0]
    who = _id(f.culprit_samples[0]) if len(f.culprit_samples) == 1 else "A culprit sample"
    if fact.kind is SampleFactKind.ALL_ZERO and _op_base(f.op) in _DIV_OPS | _NORM_OPS:  # the op that failed divides
        return f"{who}: {fact.words}, and the step fails where {f.op} divides by its sum or norm. Fix: {_DIVISION_FIX}"
    return f"{who}: {fact.words}. Fix: {_FACT_FIXES[fact.kind]}"


def _exception_verdict(f: VerdictFacts) -> dict:
    """The step raises on replay too: where, which samples, and the data that made it raise."""
    what = f.exception_type or "an exception"
    where = f" at `{f.module}`" if f.module else ""
    if f.op:
        where += f" ({f.op})"
    phase = f" in the {f.phase} pass" if f.phase is not None and f.phase.is_pass else ""
    detail = f": {f.exception_detail}" if f.exception_detail else ""
    if f.out_of_memory and f.size_outliers:
        return _oversized(f, phase, where)
    if _has_culprit(f):
        subject = _samples_phrase(f)
        verb = "make" if (f.culprit_subset_size or 0) > 1 else "makes"
        headline = f"{subject} {verb} {_where_step(f)} raise {what}{phase}{where}{detail}."
    elif f.all_subsets_fail or f.candidates > 1:
        headline = f"{_where_step(f)[0].upper()}{_where_step(f)[1:]} raises {what}{phase}{where} whatever the samples{detail}."
    else:
        headline = f"{_where_step(f)[0].upper()}{_where_step(f)[1:]} raises {what}{phase}{where}{detail}."
    reading = f"The replay raised {what} where the job did" + (f" ('{f.exception_message[:200]}')." if
                                                             f.exception_message else ".")
    suggestions = []
    if _has_culprit(f):
        ids = ", ".join(_id(s) for s in f.culprit_samples[:MAX_NAMED_SAMPLES])
        suggestions.append(f"Filter {ids} from the training data{_listed(f, 'the culprits')} and fix the "
                           "record: the rest of the step runs.")
        if f.culprit_facts:
            suggestions.append(_data_hint(f))
    if f.exception_detail and ("token id" in f.exception_detail or "index" in f.exception_detail):
        suggestions.append("An id at or above the embedding's size: check that the tokenizer and the model agree on "
                           "the vocabulary size (added special tokens need model.resize_token_embeddings), and that "
                           "the data was tokenized with this tokenizer.")
    if f.exception_detail and "label" in f.exception_detail:
        suggestions.append("A label outside the classes: check the label mapping and the number of classes of the "
                           "head; use -100 for positions to ignore.")
    if f.exception_type in ("OutOfMemoryError", "MemoryError"):
        suggestions.append("Cap the sequence length (or the tokens per micro-batch) so one long sample cannot take "
                           "the memory of a whole batch.")
    if not _has_culprit(f):
        suggestions.append("Every subset of samples raises: the model code or its configuration is at fault, not "
                           "one record; the traceback in report.json shows where.")
    return _result(VerdictKind.EXCEPTION, headline, f, suggestions, reading)


def _size_words(f: VerdictFacts) -> str:
    """'sample doc-7 (100,000 tokens, 6250x the step's median of 16)' for the largest outlier (+ how many more)."""
    top = f.size_outliers[0]
    ratio = f" ({top['tokens']:,} tokens, {top['tokens'] / f.median_size:,.0f}x the step's median of " \
            f"{f.median_size:,.0f})" if f.median_size else f" ({top['tokens']:,} tokens)"
    more = f" and {len(f.size_outliers) - 1} more sample(s) that size" if len(f.size_outliers) > 1 else ""
    return f"Sample {_id(top['sample_id'])}{ratio}{more}"


def _filter_oversized(f: VerdictFacts) -> str:
    """'Filter or truncate 'doc-7' (blocklist.jsonl lists it)' (without the parenthesis for positional IDs)."""
    ids = ", ".join(_id(o["sample_id"]) for o in f.size_outliers[:MAX_NAMED_SAMPLES])
    return f"Filter or truncate {ids}{_listed(f, 'them' if len(f.size_outliers) > 1 else 'it')}"


def _oversized(f: VerdictFacts, phase: str, where: str) -> dict:
    """Out of memory with a sample far larger than the others: that sample, by its size."""
    top = f.size_outliers[0]
    headline = f"{_size_words(f)} makes {_where_step(f)} run out of memory{phase}{where}."
    reading = (f"Micro-batch {top['micro_batch'] + 1} is padded to its longest sample, so every sample in it "
               "costs that much memory (attention grows with the square of the length): bisection cannot tell "
               "them apart, the size does.")
    suggestions = [f"{_filter_oversized(f)} and resume from the last checkpoint.",
                   "Cap the sequence length (truncate in the collate function or the tokenizer's max_length), or "
                   "batch by length so one long sample cannot set the size of a whole micro-batch."]
    return _result(VerdictKind.EXCEPTION, headline, f, suggestions, reading)


def _bad_sample(f: VerdictFacts) -> dict:
    headline = f"{_samples_phrase(f)} makes {_what(f)} at {_where_step(f)}{_where_value(f)}."
    if (f.culprit_subset_size or 0) > 1:
        headline = headline.replace(" makes ", " make ", 1)
    reading = None
    if f.bisect_runs is None and f.module and f.module.startswith(INPUT_PREFIX) and f.candidates > 1:
        reading = (f"Named from the data, without bisection: of the {f.candidates} samples, only "
                   f"{'this one holds' if len(f.culprit_samples) == 1 else 'these hold'} NaN/Inf in "
                   f"`{f.module[len(INPUT_PREFIX):]}`.")
    elif f.candidates == 1:
        reading = ("The micro-batch held only this sample, so bisection could not tell it apart from the "
                   "model state; replay another sample with these weights to be sure.")
    ids = ", ".join(_id(s) for s in f.culprit_samples[:MAX_NAMED_SAMPLES])
    suggestions = [f"Filter {ids} from the training data{_listed(f, 'the culprits')} and resume "
                   "from the last checkpoint before "
                   f"{f'step {f.step}' if f.step is not None else 'the failing step'} with the same RNG and "
                   "data position.",
                   _data_hint(f)]
    if (f.culprit_subset_size or 0) > 1 and not f.culprits_each_fail_alone:
        suggestions.insert(1, "These samples fail only together: look for a computation they share across "
                              "the batch (normalisation statistics, a loss averaged over all tokens, a sum "
                              "that overflows); keep them out of one batch or fix that computation.")
    hints = _op_hints(f)
    if _low_precision(f) == "float16" and not any("bfloat16" in h for h in hints):
        hints.append("The job runs in float16: bfloat16 has fp32's range and tolerates outliers better.")
    return _result(VerdictKind.BAD_SAMPLE, headline, f, suggestions + hints + _pattern_hints(f), reading)


def _state_hints(f: VerdictFacts) -> list[str]:
    """Fixes that act on the state a trigger met: learning rate, warm-up, logit growth, the format, skipping."""
    hints = _pattern_hints(f)
    lr = f" (it was {_num(f.lr)})" if f.lr is not None else ""
    hints.append(f"Act on the state: lower the learning rate{lr} or lengthen the warm-up, and restart from a checkpoint "
                 "taken well before this step (PaLM restarted ~100 steps earlier and skipped 200-500 batches).")
    if "attn" in (f.module or "").lower() or "attention" in (f.module or "").lower() or "softmax" in (f.op or ""):
        hints.append("The attention logits grew until they crossed: QK-norm (or QK-clip) holds them.")
    else:
        hints.append("If attention or output logits keep growing, QK-norm and a z-loss hold them.")
    if _low_precision(f) == "float16":
        hints.append("bfloat16 has fp32's range: the same state does not overflow it.")
    hints.append("To ride it out without restarting, skip such steps: DetectionConfig(on_spike='skip') / "
                 "on_nonfinite='skip', or a skip-step optimizer (OLMo-core, Levanter).")
    return hints


def _trigger_sample(f: VerdictFacts) -> dict:
    """Bisection isolated samples, but nothing shows their records are bad: they crossed first on a state that could
    not take them (replay/culprits/evidence.py)."""
    phrase = _samples_phrase(f)
    verb = "are" if (f.culprit_subset_size or 0) > 1 else "is"
    headline = (f"{phrase.rstrip(',')} {verb} the first to make {_what(f)} at {_where_step(f)}{_where_value(f)}, but "
                "nothing marks the record as bad: the model's state is what fails, and no sample is to blame.")
    reading = ("On a state at the edge, the first sample to cross is whichever comes: filtering it only moves the "
               "failure to the next sample like it.")
    ids = ", ".join(_id(s) for s in f.culprit_samples[:MAX_NAMED_SAMPLES])
    suggestions = [f"Do not filter {ids}: no blocklist is written. Its loss and data are like the other samples'; "
                   "a large gradient on an ordinary record is what a sharpened state gives."]
    suggestions += _state_hints(f)
    if not f.earlier_state:
        suggestions.append("To be sure, replay it with an earlier state: GuardConfig(recording=RecordConfig("
                           "snapshot_every=K)) keeps one in every dump, or pass --from CHECKPOINT --trust; the replay "
                           "then feeds this micro-batch to it (a bad record fails there too, a trigger does not).")
    return _result(VerdictKind.TRIGGER_SAMPLE, headline, f, suggestions + _op_hints(f), reading)


def _norm_overflow(f: VerdictFacts) -> dict:
    """Every gradient value finite, their norm not: the weights and gradients grew until the norm overflowed."""
    largest = f" (the largest |gradient| is {_num(f.grad_norm_overflow)})" if f.grad_norm_overflow else ""
    headline = (f"Every gradient of {_where_step(f, micro_batch=False)} is finite, but they are so large that their "
                f"norm overflows float32{largest}: the run has diverged, and no sample is to blame.")
    reading = ("The Guard fired on the gradient norm, which is Inf here too: the replay reproduces it. Gradients that "
               "large come from weights that grew step after step, not from one batch.")
    suggestions = _pattern_hints(f) or ["Lower the learning rate (or lengthen the warm-up) and restart from a "
                                        "checkpoint taken before the loss left its early values."]
    suggestions += ["Clip gradients (clip_grad_norm_ after backward, before optimizer.step()); with a norm this "
                    "large, clipping only hides the divergence: the learning rate is what to change.",
                    "Do not filter the samples of this step: any batch gives such gradients on these weights."]
    return _result(VerdictKind.MODEL_STATE, headline, f, suggestions, reading)


def _update_too_large(f: VerdictFacts) -> dict:
    """Window replay: a step with finite gradients whose own update wrecks the weights — the learning rate."""
    at = f"At a learning rate of {_num(f.lr)}, the" if f.lr is not None else "The"
    headline = (f"{at} update of {_where_step(f, micro_batch=False)} moves the weights by {f.update_change:.0%} of "
                "their norm: the learning rate is too high for this model and the run diverges from there; no "
                "sample is to blame.")
    reading = ("Its gradients are finite and no small group of samples makes them large: the step size, not the "
               "data, is what breaks the weights.")
    scaled = f.lr * 0.01 / f.update_change if f.lr is not None and f.update_change else None
    suggestions = [("Lower the learning rate: an update scales with it, so an lr around "
                    f"{_num(scaled)} would move the weights by about 1% of their norm in this step; add a warm-up "
                    "(start 10-100x lower) and restart from the last checkpoint before this step.") if scaled else
                   "Lower the learning rate and add a warm-up, and restart from the last checkpoint before this step.",
                   "Do not filter the samples of this step: any batch gives an update that size at this learning "
                   "rate."]
    return _result(VerdictKind.SPIKE_NO_SINGLE_CAUSE, headline, f, suggestions + _pattern_hints(f), reading)


def _diverged(f: VerdictFacts) -> dict:
    """A spike in a run that was already far off: the run is the problem, not a sample of this step."""
    headline = (f"The {f.trigger_kind.words} at {_where_step(f)} is a symptom: the run had diverged long before, "
                "so no sample is to blame.")
    suggestions = ["Lower the learning rate (or lengthen the warm-up) and restart from the last checkpoint taken "
                   "before the loss left its early values; clipping alone does not bring such a run back.",
                   "Do not filter the samples of this step: in a diverged model the largest gradients land on "
                   "whichever samples happen to be there."]
    reading = ("Samples whose removal ends the spike only carry the largest gradients of an unstable model; "
               "their data is not what is wrong.") if f.candidates > 1 else None
    hints = [] if f.history_pattern is HistoryPattern.DIVERGED else _pattern_hints(f)  # said above already
    return _result(VerdictKind.SPIKE_NO_SINGLE_CAUSE, headline, f, suggestions + hints, reading)


def _spike(f: VerdictFacts) -> dict:
    value = f" to {_num(f.trigger_value)}" if f.trigger_value is not None else ""
    over = f" (threshold {_num(f.threshold)})" if f.threshold is not None else ""
    headline = (f"{_what(f)[0].upper() + _what(f)[1:]}{value}{over} at {_where_step(f)} is reproduced, "
                "but no single sample, layer or update explains it.")
    reading = None
    top = [r for r in f.per_sample_top if isinstance(r, dict)][:MAX_NAMED_SAMPLES]
    if top:
        reading = "Highest per-sample losses: " + ", ".join(
            f"{_id(r.get('sample_id'))} (loss {_num(r.get('loss'))})" for r in top) + "."
    compare = "the scale and range of its features" if f.data_kind == "float" else "its sequence lengths"
    suggestions = _pattern_hints(f) + [
        "A spike spread over many samples usually comes from the optimizer (learning rate, warm-up, "
        f"clipping threshold) or a shift in the batch distribution: compare this batch's {compare} and "
        "source mix with earlier ones.",
        "If the run recovers on its own, a lower learning rate or tighter clipping may be enough; "
        "change one setting at a time so you learn what fixed it.",
    ]
    return _result(VerdictKind.SPIKE_NO_SINGLE_CAUSE, headline, f, suggestions, reading)
