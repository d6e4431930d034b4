"""The verdict's words: the evidence sentences in the field notes' triage order, the hints an op or a loss curve
calls for, and the typed Verdict every verdict builder returns (`verdict_of`; replay/judge/verdict.py decides which
builder speaks)."""

from __future__ import annotations

import logging
import math
from typing import Any

from forensics.core.kinds import HistoryPattern, Phase, SampleFactKind, VerdictKind
from forensics.report.tree import Verdict
from forensics.report.wording import fmt_id, fmt_num, mb_number, module_words
from forensics.replay.judge.verdict_facts import (
    INPUT_PREFIX,
    MAX_ID_CHARS,
    MAX_NAMED_SAMPLES,
    PROSE_DIGITS,
    VerdictFacts,
    blames_data,
    has_culprit,
    low_precision,
)

log = logging.getLogger(__name__)


def num(value: Any) -> str:
    return fmt_num(value, PROSE_DIGITS)


def quoted_id(sample_id: Any) -> str:
    return fmt_id(sample_id, MAX_ID_CHARS)


def listed(f: VerdictFacts, whom: str) -> str:
    """' (blocklist.jsonl lists the culprits)', ' (blocklist.jsonl lists all 4)' when not every culprit is named;
    nothing for made-up positional IDs or IDs shared with samples the replay does not blame, which no blocklist lists
    (no_blocklist says why)."""
    if f.shared_ids:  # filtering by that ID would drop healthy samples: the record is named by its position below
        return " (the record at its position, not every record with its ID: see below)"
    if f.ids_are_positional:
        return ""
    if len(f.culprit_samples) > MAX_NAMED_SAMPLES:
        whom = f"all {len(f.culprit_samples)}"
    return f" (blocklist.jsonl lists {whom})"


def named_ids(ids: list) -> str:
    """'46, 48, 3 and 1 more': the first MAX_NAMED_SAMPLES ids and how many are left out (never silently)."""
    text = ", ".join(quoted_id(s) for s in ids[:MAX_NAMED_SAMPLES])
    return text + (f" and {len(ids) - MAX_NAMED_SAMPLES} more" if len(ids) > MAX_NAMED_SAMPLES else "")


def no_blocklist(f: VerdictFacts) -> list[str]:
    """Samples named by made-up positions ('step5/rank0/mb1/2'), or by an ID other samples the replay does not blame
    carry too: why no blocklist names them, and the fix."""
    named = f.culprit_samples or [o.get("sample_id") for o in f.size_outliers]
    shared = [
        f"No blocklist entry for {words}: filtering that ID would drop those samples too. Give each record its own ID."
        for words in f.shared_ids[:MAX_NAMED_SAMPLES]
    ]
    if not (f.ids_are_positional and named):
        return shared
    return shared + [
        f"No blocklist entry for {quoted_id(named[0])}: the job recorded no sample IDs for its micro-batch, so the "
        "replay names samples by their position in the batch, which does not identify a record of the dataset. "
        "Record real IDs (guard.record_batch(batch, sample_ids=ids), or a 'sample_ids' key in dict batches) to "
        "get a blocklist."
    ]


def samples_phrase(f: VerdictFacts, lower: bool = False) -> str:
    """ "Sample 'x' alone" / "Samples 'a' and 'b' together (neither alone)" / "3 samples together (...)"."""
    ids = [quoted_id(s) for s in f.culprit_samples[:MAX_NAMED_SAMPLES]]
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


def where_step(f: VerdictFacts, micro_batch: bool = True) -> str:
    text = f"step {f.step}" if f.step is not None else "the step"
    extra = []
    if f.rank is not None:
        extra.append(f"rank {f.rank}")
    if f.micro_batch is not None and micro_batch:
        of = f" of {f.num_micro_batches}" if f.num_micro_batches else ""
        extra.append(f"micro-batch {mb_number(f.micro_batch)}{of}")
    return text + (f" ({', '.join(extra)})" if extra else "")


def where_value(f: VerdictFacts, details: list[str] | None = None) -> str:
    """' in the forward pass at `m` (aten::mm; <details>)', or '' when localisation found nothing."""
    if f.phase is None and f.module is None:
        return ""
    text = f" in the {f.phase} pass" if f.phase is not None and f.phase.is_pass else ""
    if f.module:
        text += module_words(f.module)
    notes = ([f.op] if f.op else []) + list(details or [])
    if notes:
        text += f" ({'; '.join(notes)})"
    return text


def evidence_sentences(f: VerdictFacts) -> list[str]:
    """The field notes' answer, sentence by sentence: where, reproduction, localisation, culprit."""
    out = []
    where = [f"Step {f.step}" if f.step is not None else "The failing step"]
    if f.rank is not None:
        where.append(f"rank {f.rank}")
    if f.micro_batch is not None:
        where.append(
            f"micro-batch {mb_number(f.micro_batch)}" + (f" of {f.num_micro_batches}" if f.num_micro_batches else "")
        )
    trigger = f.trigger_kind.words
    numbers = ([num(f.trigger_value)] if f.trigger_value is not None else []) + (
        [f"threshold {num(f.threshold)}"] if f.threshold is not None else []
    )
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
                stats.append(f"{label} holds NaN" if math.isnan(value) else f"{label} abs-max {num(value)}")
        if f.parameter and f.phase in (Phase.BACKWARD, Phase.OPTIMIZER):
            stats.append(f"parameter `{f.parameter}`")
        located = (
            where_value(f, stats)
            if (f.module or (f.phase is not None and f.phase.is_pass))
            else f" in the {f.phase} step" + (f" ({'; '.join(stats)})" if stats else "")
        )
        if f.module and f.module.startswith(INPUT_PREFIX):
            field = f.module[len(INPUT_PREFIX) :]
            value = f.inputs_absmax
            held = (
                "NaN"
                if value is not None and math.isnan(value)
                else "Inf"
                if value is not None and math.isinf(value)
                else "NaN/Inf"
            )
            out.append(
                f"The batch's own `{field}` already holds {held} before any layer runs: the data is the "
                "source, not a module."
            )
        else:
            out.append(f"The first non-finite value appears{located}.")
    if has_culprit(f):
        runs = f" (found in {f.bisect_runs} replays of {f.candidates} samples)" if f.bisect_runs is not None else ""
        phrase = samples_phrase(f).rstrip(",")
        label = "Culprit" if f.record_evidence else "First to cross"
        out.append(f"{label}: {phrase[0].lower() + phrase[1:]}{runs}.")
        if f.record_evidence:
            out.append(f"Evidence against the record: {'; '.join(f.record_evidence[:3])}.")
        elif f.refuted_by:
            out.append(
                f"What stood against the record ({'; '.join(f.evidence_set_aside[:2])}) does not hold: "
                f"{'; '.join(f.refuted_by)}."
            )
        elif f.evidence_set_aside:
            out.append(f"No evidence against the record: {'; '.join(f.evidence_set_aside[:2])}.")
        elif f.ordinary_record:
            out.append(f"Its record looks like the others: {f.ordinary_record}.")
        if f.earlier_state:
            out.append(f.earlier_state)
    elif f.unblamed_group and f.bisect_runs is not None:
        test = "whose removal ends the spike" if f.spike else "that fails"
        out.append(
            f"Bisecting {f.candidates} samples ({f.bisect_runs} replays): the smallest set {test} is "
            f"{f.unblamed_group} of the {f.candidates} samples, too large a share of the step to blame any "
            "of them."
        )
    elif f.candidates > 1 and f.bisect_runs is not None:
        out.append(f"Bisecting {f.candidates} samples ({f.bisect_runs} replays) found no smaller subset that fails.")
    if f.rng_dependent:
        seeds = f"{f.rng_seeds_tried} other seed{'s' if f.rng_seeds_tried != 1 else ''}"
        out.append(
            f"Re-run from {seeds} instead of the recorded RNG, the step is healthy: the failure "
            "depends on the random state (a dropout mask or another random op)."
        )
    elif f.rng_dependent is False and f.rng_seeds_tried:
        out.append(f"It fails from {f.rng_seeds_tried} other seeds too, so the random state is not the cause.")
    low = low_precision(f)
    checked = f" (checked: {f.fp32_ran})" if f.fp32_ran else ""
    if f.fp32_unverified:
        out.append(f"The fp32 re-run could not be held to float32{checked}: no conclusion is drawn from it.")
    elif f.fp32_reproduces is False:
        healthy = "does not spike" if f.spike else "is finite"
        out.append(f"In fp32{checked} the step {healthy} → {'precision + data' if blames_data(f) else 'precision'}.")
    elif f.fp32_reproduces is True and low:
        out.append(f"It fails in fp32 too{checked}, so {low} is not the cause.")
    return out


def history_sentences(f: VerdictFacts) -> list[str]:
    out = [f.run_diverged] if f.run_diverged else []
    if f.history_pattern:
        out.append(f"Loss history: {f.history_pattern.means(f.trigger_kind)}.")
    out.extend(f.history_reading)
    out.extend(f.history_signals)
    return out


LOG_OPS = {"log", "log2", "log10", "log1p", "xlogy"}
DIV_OPS = {"div", "true_divide", "reciprocal", "floor_divide"}
NORM_OPS = {
    "sqrt",
    "rsqrt",
    "native_layer_norm",
    "layer_norm",
    "rms_norm",
    "_fused_rms_norm",
    "native_batch_norm",
    "batch_norm",
    "group_norm",
    "native_group_norm",
}
SAFE_NORM_EPS = 1e-6  # an eps at least this large keeps a near-zero hidden vector from dividing by ~0
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}


def op_base(op: str | None) -> str:
    """'aten::div.Tensor' -> 'div'; 'aten::add_' -> 'add'."""
    return (op or "").split("::")[-1].split(".")[0].rstrip("_").lower()


def op_hints(f: VerdictFacts) -> list[str]:
    op = op_base(f.op)
    parts = (f.module or "").lower().split(".")
    hints = []
    if op in LOG_OPS:
        hints.append(
            "Guard the log: clamp its input away from 0 (x.clamp_min(1e-6)) or use log_softmax / "
            "cross_entropy on logits instead of log(softmax)."
        )
    if op in DIV_OPS:
        hints.append(
            "Guard the division: a denominator of 0 (e.g. a mean over zero unmasked tokens) "
            "gives 0/0; clamp it or skip samples with nothing to average."
        )
    if "softmax" in op:
        hints.append(
            "A fully masked row (all -inf) makes softmax NaN: make sure every row keeps at least one unmasked position."
        )
    if op == "exp":
        hints.append(
            "exp overflows above ~88 in fp32 (~11 in fp16): subtract the maximum first "
            "(logsumexp / softmax do this for you)."
        )
    if op in NORM_OPS or any("norm" in p or p.startswith("ln") for p in parts if p):
        huge = f.inputs_absmax is not None and (not math.isfinite(f.inputs_absmax) or f.inputs_absmax > 1e18)
        if huge:  # the square of the input overflows the variance: eps is not the problem
            hints.append(
                "The normalisation's input is enormous (its square overflows the variance): find "
                "where such values enter (the sample's features, an unscaled input, a residual "
                "stream that grows every layer) rather than changing eps."
            )
        elif f.norm_eps is not None and f.norm_eps >= SAFE_NORM_EPS:
            hints.append(
                f"The normalisation's eps is already {fmt_num(f.norm_eps, 3)}: raising it will not help; look at "
                "what feeds it (the per-layer table: a residual stream or weights that grew step after step)."
            )
        elif f.norm_eps is not None:
            hints.append(
                f"Raise the normalisation eps from {fmt_num(f.norm_eps, 3)} to 1e-5 or 1e-6: a near-zero hidden vector "
                "divides by ~0."
            )
        else:
            hints.append(
                "If the normalisation's eps is tiny (1e-8 or 0), raise it to 1e-5 or 1e-6: a near-zero hidden vector "
                "divides by ~0."
            )
    if op in MATMUL_OPS and low_precision(f) == "float16":
        hints.append(
            "A matmul output above 65504 overflows float16: bfloat16 keeps fp32's range, or "
            "scale the activations down (e.g. a norm before this layer)."
        )
    return hints


def pattern_hints(f: VerdictFacts) -> list[str]:
    if f.history_pattern is HistoryPattern.EXPONENTIAL_GROWTH:
        return [
            "The loss grew exponentially before the failure: lower the learning rate or lengthen "
            "warm-up, and check that the loss is divided by the number of accumulation steps."
        ]
    if f.history_pattern is HistoryPattern.DIVERGED:
        return [
            "The loss sits far above where the run started: lower the learning rate (or lengthen the "
            "warm-up) and restart from a checkpoint taken before the loss left its start."
        ]
    if f.history_pattern is HistoryPattern.OSCILLATING_DIVERGENCE:
        return [
            "The loss oscillated with growing swings: check the optimizer state (Adam's exp_avg / "
            "exp_avg_sq, e.g. after a resume) for corruption, and the batch distribution for a shift."
        ]
    return []


def verdict_node(
    kind: VerdictKind, headline: str, f: VerdictFacts, suggestions: list[str], reading: str | None = None
) -> Verdict:
    """The report's verdict every builder returns: the evidence in triage order, then the builder's reading, the
    history, and (a state at the edge of fp16) why no sample is blamed; suggestions without repeats."""
    evidence = evidence_sentences(f) + ([reading] if reading else []) + history_sentences(f)
    explanation = " ".join(evidence)
    if f.edge_share is not None:
        explanation = f"{explanation} {edge_words(f.edge_share, f.edge_excluded)}".strip()
    return verdict_of(kind, headline, explanation, suggestions + no_blocklist(f))


def verdict_of(kind: VerdictKind, headline: str, explanation: str, suggestions: list[str]) -> Verdict:
    """The report's typed verdict, as every verdict builder returns it (`verdict_node`'s, and those of the dumps with
    no step to replay: verdict_unreplayed.py): the suggestions in their order, without repeats or empty ones."""
    unique = list(dict.fromkeys(s for s in suggestions if s))
    log.info("verdict %s: %s", kind, headline)
    return Verdict(kind=kind, headline=headline, explanation=explanation, suggestions=unique)


def edge_words(share: float, excluded: int) -> str:
    """Why the samples bisection isolated are not blamed: the rest of the step is at fp16's limit too
    (replay/culprits/margin.py)."""
    return (
        f"Without the {excluded} sample(s) bisection isolated, the rest of the step still reaches {100 * share:.0f} % "
        "of fp16's max (65,504): the model's state is at the edge of fp16, and whichever sample crosses first is not "
        "to blame."
    )


RECORD_HINTS = {
    "tokens": (
        "Look at the record behind it: empty or zero-length, control characters only, very long strings "
        "without spaces (base64, binary), mis-encoded text, every label masked (-100)."
    ),
    "float": (
        "Look at the record behind it: NaN/Inf or extreme values in its features (see the input abs-max), "
        "all-zero or constant rows, values in the wrong units or unscaled, a corrupted or truncated file."
    ),
}


FACT_FIXES = {
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
DIVISION_FIX = "drop such records, or guard the division (clamp the sum or norm to at least eps)."


def data_hint(f: VerdictFacts) -> str:
    """The first suggestion about the culprit's record: what its data shows, else where to look."""
    if not f.culprit_facts:
        return RECORD_HINTS[f.data_kind or "tokens"]
    fact = f.culprit_facts[0]
    who = quoted_id(f.culprit_samples[0]) if len(f.culprit_samples) == 1 else "A culprit sample"
    if fact.kind is SampleFactKind.ALL_ZERO and op_base(f.op) in DIV_OPS | NORM_OPS:  # the op that failed divides
        return f"{who}: {fact.words}, and the step fails where {f.op} divides by its sum or norm. Fix: {DIVISION_FIX}"
    return f"{who}: {fact.words}. Fix: {FACT_FIXES[fact.kind]}"


EARLIER_STATE_HOW = (
    "GuardConfig(recording=RecordConfig(snapshot_every=K)) keeps one in every dump, or replay with --from CHECKPOINT "
    "--trust"
)
"""How a user gives the replay an earlier state (the Guard's host snapshot, or a checkpoint): one wording for every
verdict that such a state would settle."""


def earlier_state_hint(lead: str, then: str) -> str:
    """The suggestion of a verdict that an earlier state would settle: `lead`, how to give one, what the replay `then`
    does with it."""
    return f"{lead}: {EARLIER_STATE_HOW}; the replay then {then}."


def state_hints(f: VerdictFacts) -> list[str]:
    """Fixes that act on the state a trigger met: learning rate, warm-up, logit growth, the format, skipping."""
    hints = pattern_hints(f)
    lr = f" (it was {num(f.lr)})" if f.lr is not None else ""
    hints.append(
        f"Act on the state: lower the learning rate{lr} or lengthen the warm-up, and restart from a checkpoint "
        "taken well before this step (PaLM restarted ~100 steps earlier and skipped 200-500 batches)."
    )
    if "attn" in (f.module or "").lower() or "attention" in (f.module or "").lower() or "softmax" in (f.op or ""):
        hints.append("The attention logits grew until they crossed: QK-norm (or QK-clip) holds them.")
    else:
        hints.append("If attention or output logits keep growing, QK-norm and a z-loss hold them.")
    if low_precision(f) == "float16" and f.fp32_reproduces is not True:  # still failing in fp32: the range is not it
        hints.append("bfloat16 has fp32's range: the same state does not overflow it.")
    hints.append(
        "To ride it out without restarting, skip such steps: DetectionConfig(on_spike='skip') / "
        "on_nonfinite='skip', or a skip-step optimizer (OLMo-core, Levanter)."
    )
    return hints


def size_words(f: VerdictFacts) -> str:
    """'sample doc-7 (100,000 tokens, 6250x the step's median of 16)' for the largest outlier (+ how many more)."""
    top = f.size_outliers[0]
    ratio = (
        f" ({top['tokens']:,} tokens, {top['tokens'] / f.median_size:,.0f}x the step's median of {f.median_size:,.0f})"
        if f.median_size
        else f" ({top['tokens']:,} tokens)"
    )
    more = f" and {len(f.size_outliers) - 1} more sample(s) that size" if len(f.size_outliers) > 1 else ""
    return f"Sample {quoted_id(top['sample_id'])}{ratio}{more}"


def filter_oversized(f: VerdictFacts) -> str:
    """'Filter or truncate 'doc-7' (blocklist.jsonl lists it)' (without the parenthesis for positional IDs)."""
    ids = ", ".join(quoted_id(o["sample_id"]) for o in f.size_outliers[:MAX_NAMED_SAMPLES])
    return f"Filter or truncate {ids}{listed(f, 'them' if len(f.size_outliers) > 1 else 'it')}"


__all__ = [
    "filter_oversized",
    "size_words",
    "DIVISION_FIX",
    "DIV_OPS",
    "FACT_FIXES",
    "LOG_OPS",
    "MATMUL_OPS",
    "NORM_OPS",
    "RECORD_HINTS",
    "data_hint",
    "evidence_sentences",
    "history_sentences",
    "listed",
    "named_ids",
    "no_blocklist",
    "num",
    "op_base",
    "op_hints",
    "pattern_hints",
    "quoted_id",
    "samples_phrase",
    "state_hints",
    "edge_words",
    "verdict_node",
    "verdict_of",
    "where_step",
    "where_value",
]
