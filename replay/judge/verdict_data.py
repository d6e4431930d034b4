"""Verdicts that name samples: bad data (with the evidence), a trigger (the first to cross, not bad data), precision
with or without data, a step that raises, a sample too large for memory."""

from __future__ import annotations

from forensics.report.tree import Verdict
from forensics.core.kinds import VerdictKind
from forensics.replay.judge.verdict_facts import (
    INPUT_PREFIX,
    VerdictFacts,
    blames_data,
    has_culprit,
    low_precision,
    what,
)
from forensics.replay.judge.verdict_words import (
    data_hint,
    earlier_state_hint,
    filter_oversized,
    listed,
    named_ids,
    op_hints,
    pattern_hints,
    quoted_id,
    samples_phrase,
    size_words,
    state_hints,
    verdict_node,
    where_step,
    where_value,
)


def numerical_precision(f: VerdictFacts) -> Verdict:
    dtype = low_precision(f) or "float16 / bfloat16"
    with_data = blames_data(f)
    who = f" and only with {samples_phrase(f, lower=True).rstrip(',')}," if with_data else ""
    at = where_step(f)
    where = ("," if not with_data and where_value(f) else "") + where_value(f)
    fails, fine = ("spikes", "it does not") if f.spike else ("goes non-finite", "it is finite")
    every = " with every sample on its own" if f.all_subsets_fail and not with_data else ""
    headline = f"{at[0].upper() + at[1:]} {fails} only in {dtype}{who}{every}{where}; in fp32 {fine}" + (
        ": precision + data." if with_data else "."
    )
    suggestions = []
    if with_data:
        ids = named_ids(f.culprit_samples)
        suggestions.append(
            f"Filter {ids} from the data{listed(f, 'the culprits')}: "
            f"{'it pushes' if len(f.culprit_samples) == 1 else 'they push'} the activations "
            f"out of {dtype}'s range."
        )
    if has_culprit(f) and not with_data:
        suggestions.append(
            f"Do not filter {quoted_id(f.culprit_samples[0])}: nothing marks its record as bad; it is only the "
            "first sample to cross on a state at the edge of the format, and the next one like it "
            "would cross too."
        )
    if dtype == "float16":
        suggestions.append(
            "Switch autocast from float16 to bfloat16: same speed on Ampere and newer, "
            "fp32's range, no overflow at 65504; keep dynamic loss scaling while on fp16."
        )
    elif with_data:
        suggestions.append("Keep bfloat16: the sample is the trigger, not the format.")
    else:
        target = f"`{f.module}`" if f.module else "the failing module"
        suggestions.append(
            f"Keep bfloat16 but run {target} in fp32: wrap it in torch.autocast(..., "
            "enabled=False) and cast its input to float32."
        )
    return verdict_node(VerdictKind.NUMERICAL_PRECISION, headline, f, suggestions + op_hints(f) + pattern_hints(f))


def exception_verdict(f: VerdictFacts) -> Verdict:
    """The step raises on replay too: where, which samples, and the data that made it raise."""
    what = f.exception_type or "an exception"
    phase, where = exception_place(f)
    detail = f": {f.exception_detail}" if f.exception_detail else ""
    if has_culprit(f):
        subject = samples_phrase(f)
        verb = "make" if (f.culprit_subset_size or 0) > 1 else "makes"
        headline = f"{subject} {verb} {where_step(f)} raise {what}{phase}{where}{detail}."
    elif f.all_subsets_fail or f.candidates > 1:
        headline = (
            f"{where_step(f)[0].upper()}{where_step(f)[1:]} raises {what}{phase}{where} whatever the samples{detail}."
        )
    else:
        headline = f"{where_step(f)[0].upper()}{where_step(f)[1:]} raises {what}{phase}{where}{detail}."
    reading = f"The replay raised {what} where the job did" + (
        f" ('{f.exception_message[:200]}')." if f.exception_message else "."
    )
    suggestions = []
    if has_culprit(f):
        ids = named_ids(f.culprit_samples)
        suggestions.append(
            f"Filter {ids} from the training data{listed(f, 'the culprits')} and fix the "
            "record: the rest of the step runs."
        )
        if f.culprit_facts:
            suggestions.append(data_hint(f))
    if f.exception_detail and ("token id" in f.exception_detail or "index" in f.exception_detail):
        suggestions.append(
            "An id at or above the embedding's size: check that the tokenizer and the model agree on "
            "the vocabulary size (added special tokens need model.resize_token_embeddings), and that "
            "the data was tokenized with this tokenizer."
        )
    if f.exception_detail and "label" in f.exception_detail:
        suggestions.append(
            "A label outside the classes: check the label mapping and the number of classes of the "
            "head; use -100 for positions to ignore."
        )
    if f.exception_type in ("OutOfMemoryError", "MemoryError"):
        suggestions.append(
            "Cap the sequence length (or the tokens per micro-batch) so one long sample cannot take "
            "the memory of a whole batch."
        )
    if not has_culprit(f):
        suggestions.append(
            "Every subset of samples raises: the model code or its configuration is at fault, not "
            "one record; the traceback in report.json shows where."
        )
    return verdict_node(VerdictKind.EXCEPTION, headline, f, suggestions, reading)


def exception_place(f: VerdictFacts) -> tuple[str, str]:
    """Where the step raised, in words: ' in the forward pass' and ' at `module` (op)' (either may be empty)."""
    where = f" at `{f.module}`" if f.module else ""
    if f.op:
        where += f" ({f.op})"
    phase = f" in the {f.phase} pass" if f.phase is not None and f.phase.is_pass else ""
    return phase, where


def oversized(f: VerdictFacts) -> Verdict:
    """Out of memory with a sample far larger than the others: that sample, by its size."""
    phase, where = exception_place(f)
    top = f.size_outliers[0]
    headline = f"{size_words(f)} makes {where_step(f)} run out of memory{phase}{where}."
    reading = (
        f"Micro-batch {top['micro_batch'] + 1} is padded to its longest sample, so every sample in it "
        "costs that much memory (attention grows with the square of the length): bisection cannot tell "
        "them apart, the size does."
    )
    suggestions = [
        f"{filter_oversized(f)} and resume from the last checkpoint.",
        "Cap the sequence length (truncate in the collate function or the tokenizer's max_length), or "
        "batch by length so one long sample cannot set the size of a whole micro-batch.",
    ]
    return verdict_node(VerdictKind.EXCEPTION, headline, f, suggestions, reading)


def bad_sample(f: VerdictFacts) -> Verdict:
    headline = f"{samples_phrase(f)} makes {what(f)} at {where_step(f)}{where_value(f)}."
    if (f.culprit_subset_size or 0) > 1:
        headline = headline.replace(" makes ", " make ", 1)
    reading = None
    if f.bisect_runs is None and f.module and f.module.startswith(INPUT_PREFIX) and f.candidates > 1:
        reading = (
            f"Named from the data, without bisection: of the {f.candidates} samples, only "
            f"{'this one holds' if len(f.culprit_samples) == 1 else 'these hold'} NaN/Inf in "
            f"`{f.module[len(INPUT_PREFIX) :]}`."
        )
    elif f.candidates == 1:
        reading = (
            "The micro-batch held only this sample, so bisection could not tell it apart from the "
            "model state; replay another sample with these weights to be sure."
        )
    ids = named_ids(f.culprit_samples)
    suggestions = [
        f"Filter {ids} from the training data{listed(f, 'the culprits')} and resume "
        "from the last checkpoint before "
        f"{f'step {f.step}' if f.step is not None else 'the failing step'} with the same RNG and "
        "data position.",
        data_hint(f),
    ]
    if (f.culprit_subset_size or 0) > 1 and not f.culprits_each_fail_alone:
        suggestions.insert(
            1,
            "These samples fail only together: look for a computation they share across "
            "the batch (normalisation statistics, a loss averaged over all tokens, a sum "
            "that overflows); keep them out of one batch or fix that computation.",
        )
    hints = op_hints(f)
    if low_precision(f) == "float16" and not any("bfloat16" in h for h in hints):
        hints.append("The job runs in float16: bfloat16 has fp32's range and tolerates outliers better.")
    return verdict_node(VerdictKind.BAD_SAMPLE, headline, f, suggestions + hints + pattern_hints(f), reading)


def trigger_sample(f: VerdictFacts) -> Verdict:
    """Bisection isolated samples, but nothing shows their records are bad: they crossed first on a state that could
    not take them (replay/culprits/evidence.py)."""
    phrase = samples_phrase(f)
    verb = "are" if (f.culprit_subset_size or 0) > 1 else "is"
    headline = (
        f"{phrase.rstrip(',')} {verb} the first to make {what(f)} at {where_step(f)}{where_value(f)}, but "
        + ("no evidence against the record holds" if f.refuted_by else "nothing marks the record as bad")
        + ": the model's state is what fails, and no sample is to blame."
    )
    reading = (
        "On a state at the edge, the first sample to cross is whichever comes: filtering it only moves the "
        "failure to the next sample like it."
    )
    ids = named_ids(f.culprit_samples)
    suggestions = [
        f"Do not filter {ids}: no blocklist is written. "
        + (
            "What set it apart is contradicted by the replay itself (see the explanation)."
            if f.refuted_by
            else "Its loss and data are like the other samples'; a large gradient on an ordinary record is what a "
            "sharpened state gives."
        )
    ]
    suggestions += state_hints(f)
    if not f.earlier_state:
        suggestions.append(
            earlier_state_hint(
                "To be sure, replay it with an earlier state",
                "feeds this micro-batch to it (a bad record fails there too, a trigger does not)",
            )
        )
    return verdict_node(VerdictKind.TRIGGER_SAMPLE, headline, f, suggestions + op_hints(f), reading)
