"""Verdicts about the state, the update and the reproduction: broken weights, a random draw, an optimizer update, a
diverged run, a spike without a single cause, a replay that did not reproduce."""

from __future__ import annotations

from forensics.report.tree import Verdict
from forensics.report.wording import fmt_num
from forensics.core.kinds import HistoryPattern, RemedyKind, TriggerKind, VerdictKind
from forensics.replay.judge.verdict_facts import (
    DIVERGED_TIMES_HEALTHY,
    MAX_NAMED_SAMPLES,
    DivergedHere,
    VerdictFacts,
    failing_on_earlier_state,
    has_culprit,
    what,
    whole_batch,
)
from forensics.replay.judge.verdict_words import (
    DIV_OPS,
    LOG_OPS,
    earlier_state_hint,
    filter_oversized,
    num,
    op_base,
    op_hints,
    pattern_hints,
    quoted_id,
    samples_phrase,
    size_words,
    verdict_node,
    where_step,
    where_value,
)


def inherited(f: VerdictFacts) -> Verdict:
    """A rank whose own step is healthy: the fault reached it from another rank (e.g. via the all-reduce)."""
    rank = f"rank {f.rank}" if f.rank is not None else "this rank"
    step = f"step {f.step}" if f.step is not None else "the step"
    headline = (
        f"{rank[0].upper() + rank[1:]}'s own part of {step} is healthy: the fault came from another "
        "rank, whose dump holds the culprit."
    )
    reading = (
        f"The Guard on {rank} triggered because another rank saw a non-finite loss or gradient (trigger "
        "'local: false'); replaying this rank's own micro-batches gives a finite step, as expected."
    )
    return verdict_node(
        VerdictKind.NOT_REPRODUCED,
        headline,
        f,
        [
            "Replay the rank that saw the fault first-hand: forensics replay STEP_DIR (it picks that rank) or "
            "--rank R for the rank whose manifest says trigger.local = true.",
            "forensics replay STEP_DIR --all-ranks replays every rank and names the one carrying the culprit.",
        ],
        reading,
    )


def not_reproduced_headline(f: VerdictFacts) -> str:
    """'The replay on DEVICE did not reproduce the ... of step S: recorded X, replayed Y.' (every not_reproduced)."""
    numbers = ""
    if f.trigger_kind is TriggerKind.EXCEPTION:
        numbers = (
            f": it raised {f.exception_type} there instead"
            if f.exception_type
            else ": the step finished without raising"
        )
    elif f.trigger_value is not None or f.replayed_value is not None:
        numbers = f": recorded {num(f.trigger_value)}, replayed {num(f.replayed_value)}"
    on = f" on {f.replay_device}" if f.replay_device else ""
    words = f.trigger_kind.words
    return f"The replay{on} did not reproduce the {words} of {where_step(f)}{numbers}."


def not_reproduced(f: VerdictFacts) -> Verdict:
    """The same weights, batch and RNG give a healthy step here: what the dump does not carry."""
    headline = not_reproduced_headline(f)
    reading = (
        "The same weights, batch and RNG gave a healthy step here, so the failure depends on "
        "something the dump does not carry: the GPU, the kernels chosen, non-deterministic "
        "reductions, distributed state from other ranks, or the hardware itself."
    )
    if f.environment_warnings:
        reading += " Differences between the job and this replay: " + "; ".join(f.environment_warnings) + "."
    if failing := failing_on_earlier_state(f):
        fed = len(f.earlier_sample_grad_norms or [])
        reading += (
            f" The step's samples diverge here, but fed to {f.earlier_state_source}, {failing} of {fed} fail or "
            "diverge alone there too: a broken state would not do that, records that are all bad (unnormalised "
            "inputs, another scale) would. Nothing about the records themselves was found, so no sample is named: "
            "look at this step's records."
        )
    rank = f" on the node of rank {f.rank}" if f.rank is not None else ""
    return verdict_node(
        VerdictKind.NOT_REPRODUCED,
        headline,
        f,
        [
            "Replay on the same GPU model, driver and torch version as the job (the environment "
            "warnings list what differs).",
            "Make the job deterministic so replays compare bit for bit: torch.use_deterministic_algorithms(True), "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8, torch.backends.cudnn.benchmark = False.",
            "Check the other ranks' dumps: state exchanged between ranks (all-reduce, sharded optimizer) "
            "is not replayed from one rank.",
            f"If the same GPU and settings still do not reproduce it, suspect the hardware (silent data "
            f"corruption): run the vendor's diagnostics (e.g. DCGM level 3){rank}.",
        ],
        reading,
    )


def diverged_elsewhere(f: VerdictFacts, d: DivergedHere) -> Verdict:
    """A non-finite gradient norm this device replays finite, but as far out of the run's range as the job's step, and
    every sample alone as well (verdict_facts.diverged_here): the step reproduced as the divergence; the state is
    broken, not the data — cleared by an earlier state when one ran, else the words name the test that would tell (a
    host snapshot). Says that the job's exact non-finite value was not reproduced bit for bit, and why."""
    on = f" on {f.replay_device}" if f.replay_device else " here"
    blame = (
        "the model state, not the data, is broken"
        if d.earlier_source
        else "no single record is to blame, the model state most likely is (no earlier state ran to clear the data)"
    )
    headline = (
        f"Every sample tried diverges on its own at {where_step(f)}: {blame} "
        f"(the job's gradient norm was {num(f.trigger_value)};{on} it is {num(d.replayed_grad_norm)}, "
        f"{fmt_num(d.times_healthy, 3)} x the run's healthy {fmt_num(d.healthy_grad_norm, 3)})."
    )
    samples = f"{d.samples_over} sample{'s' if d.samples_over != 1 else ''}"
    spread = (
        f"{fmt_num(d.smallest_sample_norm, 3)} to {fmt_num(d.largest_sample_norm, 3)}"
        if d.smallest_sample_norm != d.largest_sample_norm
        else fmt_num(d.smallest_sample_norm, 3)
    )
    reading = (
        f"Not reproduced bit for bit: the job's gradient norm was {num(f.trigger_value)}, the replay's{on} is "
        f"{num(d.replayed_grad_norm)}, finite but {fmt_num(d.times_healthy, 3)} x the run's gradient norm before its "
        f"loss left its start ({fmt_num(d.healthy_grad_norm, 3)}), with the step loss at {fmt_num(d.replayed_loss, 4)} "
        f"where the job recorded {fmt_num(d.recorded_loss, 4)}. This device reproduced the step as the run's divergence: gradients this "
        "far out of range are where the kernels of two devices part ways (the job's made a non-finite value of them, this "
        "device's a finite one: another attention or matmul kernel, another summation order, other dropout masks), "
        "and which of the two a step gives is not in the dump."
    )
    if f.environment_warnings:
        reading += " Differences between the job and this replay: " + "; ".join(f.environment_warnings) + "."
    units = (
        "" if abs(d.sample_scale - 1.0) < 0.05 else f" (in the step's units: each times {fmt_num(d.sample_scale, 3)})"
    )
    job_like = f", and {d.samples_nonfinite} more non-finite alone as the job's step was" if d.samples_nonfinite else ""
    reading += (
        f" The per-sample test: each of the {samples} run alone has a gradient norm of {spread}{units}, every one "
        f"over {num(DIVERGED_TIMES_HEALTHY)} x the healthy one{job_like}, so no single record is to blame."
    )
    if d.earlier_source:
        reading += (
            f" Fed to {d.earlier_source}, the same samples are healthy (gradient norms up to "
            f"{fmt_num(d.earlier_largest_norm, 3)}): the model state, not the data, is broken (PaLM's test)."
        )
    else:
        reading += (
            " That alone does not tell a broken state from a batch whose records are all bad (unnormalised inputs "
            "fail alone on any weights): no earlier state was at hand to feed the samples to."
        )
    suggestions = [
        "Resume from an earlier checkpoint with a lower learning rate or longer warm-up.",
        "Look at the pre-step weights: parameters with a huge abs-max or a collapsed norm layer (the per-layer "
        "table) show where the state went bad.",
        "To see the job's exact non-finite value (which op made it), replay on the same GPU model and torch "
        "version as the job; the verdict there is the same.",
    ]
    if not d.earlier_source:
        suggestions.append(
            earlier_state_hint(
                "To tell the state from the data, give the replay an earlier state",
                "feeds the step's samples to it, and samples healthy there clear the data",
            )
        )
    return verdict_node(VerdictKind.MODEL_STATE, headline, f, suggestions + pattern_hints(f), reading)


def other_units(f: VerdictFacts) -> Verdict:
    """Not reproduced, but the ratio of recorded to replayed is a factor the job recorded: a unit, not the hardware."""
    headline = not_reproduced_headline(f)
    factor = f.unit_factor or ""  # set: the caller checked
    reading = (
        f"{factor[0].upper() + factor[1:]}: the job and the replay measured the same step in "
        "different units, so the two numbers cannot be compared as they are. This is not a sign of "
        "non-determinism or of the hardware."
    )
    suggestions = []
    if "loss scale" in factor:
        suggestions.append(
            "Pass check() the norm of unscaled gradients: call scaler.unscale_(optimizer) before "
            "clip_grad_norm_, or call check() without grad_norm (the Guard divides the loss scale out "
            "of its own norm); clipping thresholds are then in the same units too."
        )
    if "world size" in factor:
        suggestions.append(
            "The recorded value covers every rank (summed, or not averaged); replay this step with "
            "--all-ranks to compare the whole job's value."
        )
    if "accumulation" in factor:
        suggestions.append(
            "The loop divides (or does not divide) by the number of micro-batches where the Guard "
            "assumes otherwise: set GuardConfig.detection.loss_divisor to what the loop divides each "
            "micro-batch loss by."
        )
    return verdict_node(VerdictKind.NOT_REPRODUCED, headline, f, suggestions, reading)


def memory_not_reproduced(f: VerdictFacts) -> Verdict:
    """The job ran out of memory and this replay did not (a device with more memory): the sizes still speak."""
    headline = not_reproduced_headline(f)
    suggestions = [
        "Replay on a device with no more memory than the job's (report.json exception.memory holds the "
        "job's allocated / reserved / total), or cap this process's memory, to reproduce it."
    ]
    reading = "The job ran out of memory where this replay, with more memory, did not."
    if f.size_outliers:
        reading += f" {size_words(f)}: the likely cause."
        suggestions.insert(
            0,
            f"{filter_oversized(f)}, and cap the sequence length so one long sample cannot "
            "set the size of a whole micro-batch.",
        )
    else:
        reading += " No sample of the step is far larger than the others: the step as a whole needs more memory."
        suggestions.insert(
            0, "Lower the micro-batch size (with more gradient accumulation), or use activation checkpointing."
        )
    return verdict_node(VerdictKind.NOT_REPRODUCED, headline, f, suggestions, reading)


def corruption_words(f: VerdictFacts) -> str:
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


def model_state(f: VerdictFacts) -> Verdict:
    at = where_step(f)
    if f.weights_nonfinite_at_start:
        where = corruption_words(f)
        which = f": {where}" if where else (f", first in `{f.parameter}`" if f.parameter else "")
        all_failing = f.samples_failing
        if all_failing is not None and f.samples_checked and len(all_failing) < f.samples_checked:
            failing = f.touching_samples if f.touching_samples else all_failing
            named = ", ".join(quoted_id(s) for s in failing[:MAX_NAMED_SAMPLES]) + (
                f" and {len(failing) - MAX_NAMED_SAMPLES} more" if len(failing) > MAX_NAMED_SAMPLES else ""
            )
            headline = (
                f"The weights were already non-finite before {where_step(f, micro_batch=False)}{which}; "
                f"only the samples that meet them fail ({named}: {len(all_failing)} of "
                f"{f.samples_checked}), the others are finite."
            )
            reading = (
                "A few slices of the weights hold NaN/Inf, so only the samples that use them fail; the update "
                "that broke them happened at an earlier, unchecked step (this step's data only decides "
                "who meets them)."
            )
        else:
            headline = (
                f"The weights were already non-finite before {where_step(f, micro_batch=False)}{which}: "
                "an earlier step broke them."
            )
            reading = (
                "The pre-step weights hold NaN/Inf, so every forward fails whatever the data; the "
                "update that broke them happened at an earlier, unchecked step."
            )
        suggestions = [
            "Find the step that broke them: `forensics replay DUMP --from CHECKPOINT --trust` "
            "re-executes the recorded steps from an earlier checkpoint (the job needs "
            "GuardConfig(dumping=DumpConfig(data_recipe=...)); "
            "GuardConfig(recording=RecordConfig(snapshot_every=K)) makes the Guard keep its own "
            "snapshot, so no checkpoint is needed).",
            "Or go back to the last checkpoint with finite weights and train forward from it with "
            "GuardConfig(detection=DetectionConfig(verify_update=True)), which checks the weights after "
            "every optimizer step and dumps the update that breaks them (trigger nonfinite_param).",
            "Check that gradient clipping runs after backward and before optimizer.step(), and "
            "that skipped steps (loss-scale overflow) really skip the update.",
        ]
    elif f.all_subsets_fail:
        headline = f"Every subset of samples tried fails on its own at {at}: the model state, not the data, is broken."
        alone, checked = len(f.samples_failing or []), f.samples_checked
        reading = (
            (
                "Bisection could not find a sample to blame: every subset it replayed failed, though alone only "
                f"{alone} of {checked} samples {'is' if alone == 1 else 'are'} non-finite (the per-sample "
                "table): the step fails with most groups of its samples, not because of one record."
            )
            if f.samples_failing is not None and checked and alone < checked
            else "Bisection could not find a sample to blame: every subset it replayed failed, down to "
            "single samples, so the weights or buffers make any input fail."
        )
        suggestions = [
            "Look at the pre-step weights: parameters with a huge abs-max or a collapsed "
            "norm layer (the per-layer table) show where the state went bad.",
            "Resume from an earlier checkpoint with a lower learning rate or longer warm-up.",
            "Check the optimizer state for NaN/Inf or exp_avg_sq == 0 if the job was resumed.",
        ]
    elif whole_batch(f):
        most = (
            f"{f.unblamed_group} of its {f.candidates} samples together"
            if f.unblamed_group and f.unblamed_group < f.candidates
            else "the whole micro-batch"
        )
        headline = (
            f"{at[0].upper() + at[1:]} fails only with {most}: no small subset of samples makes it fail, "
            "so no sample is to blame."
        )
        reading = (
            "The failure needs every sample of the batch together: a batch-level effect (a sum or "
            "mean that overflows over the whole batch, normalisation statistics, a loss averaged "
            "over all tokens) or the model state itself."
        )
        suggestions = [
            "Look for a reduction over the whole batch that overflows (sums in fp16, token "
            "counts); try a smaller micro-batch.",
            "Look at the pre-step weights and optimizer state for huge values (per-layer table).",
        ]
    else:
        headline = (
            f"{at[0].upper() + at[1:]} fails again in the replay, but no sample, precision or "
            "optimizer finding explains it: suspect the model state."
        )
        reading = (
            "No culprit subset of samples was found (bisection did not run or found none), and "
            "neither the optimizer update nor an fp32 re-run points elsewhere."
        )
        suggestions = [
            "Look at the pre-step weights and optimizer state for huge values (per-layer table).",
            "If bisection was skipped, run the replay with it to see whether some samples alone make the step fail.",
        ]
    return verdict_node(VerdictKind.MODEL_STATE, headline, f, suggestions + pattern_hints(f) + op_hints(f), reading)


def rng_dependent(f: VerdictFacts) -> Verdict:
    """model_state's wording when the failure needs the recorded random state (kind stays model_state)."""
    at = where_step(f)
    words = f.trigger_kind.words
    headline = (
        f"The {words} at {at}{where_value(f)} depends on the random state: it comes back with the "
        "dump's RNG and goes away from other seeds, so one draw of a random op (a dropout mask) "
        "makes it, not a sample or the weights alone."
    )
    reading = (
        "With each micro-batch's recorded RNG the step fails"
        + (" for every subset of samples tried" if f.all_subsets_fail else "")
        + "; without it the same weights and batch give a healthy step. A computation after a "
        "random op cannot survive every draw: e.g. a -log of a sum that dropout can zero entirely. "
        "It will happen again, at random steps, until that computation is guarded."
    )
    op = op_base(f.op)
    suggestions = []
    if op in LOG_OPS:
        suggestions.append(
            "The NaN/Inf needs this dropout mask: a -log of a sum that dropout can zero. Guard "
            "the log (clamp its input, e.g. x.clamp_min(1e-6), or add a small constant) or "
            "apply the random op where it cannot zero everything the log depends on."
        )
    elif op in DIV_OPS:
        suggestions.append(
            "The NaN/Inf needs this random draw: a division by a sum or count that dropout "
            "can zero. Clamp the denominator or skip the term when it is 0."
        )
    suggestions += [
        "Make the computation after the random op safe for every draw (clamp / guard the log, division or "
        "normalisation that follows the dropout), rather than changing the data or the weights.",
        "Do not blocklist samples or roll back for this: the samples and the weights are fine; resuming "
        "with another RNG state will likely pass this step, but the failure will come back at random.",
    ]
    hints = [] if op in LOG_OPS | DIV_OPS else op_hints(f)
    return verdict_node(VerdictKind.MODEL_STATE, headline, f, suggestions + hints + pattern_hints(f), reading)


def optimizer_update(f: VerdictFacts) -> Verdict:
    name = f.optimizer_class.rsplit(".", 1)[-1] if f.optimizer_class else "optimizer"
    param = f" `{f.parameter}`" if f.parameter else " a parameter"
    why = f" ({f.optimizer_state})" if f.optimizer_state else ""
    headline = (
        f"The forward and backward passes of {where_step(f)} are finite; the {name} update made{param} non-finite{why}."
    )
    state = (f.optimizer_state or "").lower()
    suggestions = []
    if "eps" in state:
        suggestions.append(
            "Raise the optimizer's eps (e.g. 1e-8, not 0): with eps == 0 a zero second moment divides 0 by 0."
        )
    lower_lr_helps = f.remedies.get(RemedyKind.LOWER_LR.value) is not False
    if ("lr" in state or "learning rate" in state) and lower_lr_helps:
        suggestions.append("Lower the learning rate; the update itself is too large.")
    if any(w in state for w in ("nan", "inf", "non-finite", "corrupt")):
        suggestions.append(
            "The optimizer state itself is broken: restart from a checkpoint with "
            "healthy optimizer state (or re-initialise it) rather than resuming this one."
        )
    suggestions.append(
        f"Inspect the optimizer state of{param} (exp_avg, exp_avg_sq): zeros, NaN/Inf, or values that "
        "grew step after step."
    )
    if lower_lr_helps:
        suggestions.append("Lower the learning rate or lengthen warm-up; check weight decay is not too large.")
    if f.remedies.get(RemedyKind.CLIP_GRAD.value) is not False:
        suggestions.append("Clip gradients (clip_grad_norm_ after backward, before optimizer.step()).")
    return verdict_node(VerdictKind.OPTIMIZER_UPDATE, headline, f, suggestions + pattern_hints(f))


def diverging(f: VerdictFacts) -> Verdict:
    """A NaN/Inf at the end of a loss that grew for steps (or sat far above its start): the run diverged; whichever
    sample crossed first is not the cause, and no record shows otherwise."""
    lr = f" at a learning rate of {num(f.lr)}" if f.lr is not None else ""
    crossed = (
        f"; {samples_phrase(f, lower=True).rstrip(',')} crossed first, but "
        + ("no evidence against the record holds" if f.refuted_by else "nothing marks its record as bad")
        if has_culprit(f)
        else ""
    )
    headline = (
        f"The run diverged{lr}: its loss grew for steps before the step made {what(f)} at {where_step(f)}"
        f"{where_value(f)}{crossed}; no sample is to blame."
    )
    reading = (
        "The loss history shows the divergence before this step; the non-finite value is where it ended, "
        "not where it began."
    )
    suggestions = pattern_hints(f) + [
        "Restart from a checkpoint taken before the loss left its early values, with a lower learning rate or a "
        "longer warm-up; change one setting at a time.",
        "Do not filter the samples of this step: on weights this far gone, any batch fails.",
    ]
    return verdict_node(VerdictKind.MODEL_STATE, headline, f, suggestions, reading)


def norm_overflow(f: VerdictFacts) -> Verdict:
    """Every gradient value finite, their norm not: the weights and gradients grew until the norm overflowed."""
    largest = f" (the largest |gradient| is {num(f.grad_norm_overflow)})" if f.grad_norm_overflow else ""
    headline = (
        f"Every gradient of {where_step(f, micro_batch=False)} is finite, but they are so large that their "
        f"norm overflows float32{largest}: the run has diverged, and no sample is to blame."
    )
    reading = (
        "The Guard fired on the gradient norm, which is Inf here too: the replay reproduces it. Gradients that "
        "large come from weights that grew step after step, not from one batch."
    )
    suggestions = pattern_hints(f) or [
        "Lower the learning rate (or lengthen the warm-up) and restart from a "
        "checkpoint taken before the loss left its early values."
    ]
    suggestions += [
        "Clip gradients (clip_grad_norm_ after backward, before optimizer.step()); with a norm this "
        "large, clipping only hides the divergence: the learning rate is what to change.",
        "Do not filter the samples of this step: any batch gives such gradients on these weights.",
    ]
    return verdict_node(VerdictKind.MODEL_STATE, headline, f, suggestions, reading)


def update_too_large(f: VerdictFacts) -> Verdict:
    """Window replay: a step with finite gradients whose own update wrecks the weights — the learning rate."""
    at = f"At a learning rate of {num(f.lr)}, the" if f.lr is not None else "The"
    headline = (
        f"{at} update of {where_step(f, micro_batch=False)} moves the weights by {f.update_change:.0%} of "
        "their norm: the learning rate is too high for this model and the run diverges from there; no "
        "sample is to blame."
    )
    reading = (
        "Its gradients are finite and no small group of samples makes them large: the step size, not the "
        "data, is what breaks the weights."
    )
    scaled = f.lr * 0.01 / f.update_change if f.lr is not None and f.update_change else None
    suggestions = [
        (
            "Lower the learning rate: an update scales with it, so an lr around "
            f"{num(scaled)} would move the weights by about 1% of their norm in this step; add a warm-up "
            "(start 10-100x lower) and restart from the last checkpoint before this step."
        )
        if scaled
        else "Lower the learning rate and add a warm-up, and restart from the last checkpoint before this step.",
        "Do not filter the samples of this step: any batch gives an update that size at this learning rate.",
    ]
    return verdict_node(VerdictKind.SPIKE_NO_SINGLE_CAUSE, headline, f, suggestions + pattern_hints(f), reading)


def diverged(f: VerdictFacts) -> Verdict:
    """A spike in a run that was already far off: the run is the problem, not a sample of this step."""
    headline = (
        f"The {f.trigger_kind.words} at {where_step(f)} is a symptom: the run had diverged long before, "
        "so no sample is to blame."
    )
    suggestions = [
        "Lower the learning rate (or lengthen the warm-up) and restart from the last checkpoint taken "
        "before the loss left its early values; clipping alone does not bring such a run back.",
        "Do not filter the samples of this step: in a diverged model the largest gradients land on "
        "whichever samples happen to be there.",
    ]
    reading = (
        (
            "Samples whose removal ends the spike only carry the largest gradients of an unstable model; "
            "their data is not what is wrong."
        )
        if f.candidates > 1
        else None
    )
    hints = [] if f.history_pattern is HistoryPattern.DIVERGED else pattern_hints(f)  # said above already
    return verdict_node(VerdictKind.SPIKE_NO_SINGLE_CAUSE, headline, f, suggestions + hints, reading)


def spike(f: VerdictFacts) -> Verdict:
    value = f" to {num(f.trigger_value)}" if f.trigger_value is not None else ""
    over = f" (threshold {num(f.threshold)})" if f.threshold is not None else ""
    headline = (
        f"{what(f)[0].upper() + what(f)[1:]}{value}{over} at {where_step(f)} is reproduced, "
        "but no single sample, layer or update explains it."
    )
    reading = None
    top = [r for r in f.per_sample_top if isinstance(r, dict)][:MAX_NAMED_SAMPLES]
    if top:
        reading = (
            "Highest per-sample losses: "
            + ", ".join(f"{quoted_id(r.get('sample_id'))} (loss {num(r.get('loss'))})" for r in top)
            + "."
        )
    compare = "the scale and range of its features" if f.data_kind == "float" else "its sequence lengths"
    suggestions = pattern_hints(f) + [
        "A spike spread over many samples usually comes from the optimizer (learning rate, warm-up, "
        f"clipping threshold) or a shift in the batch distribution: compare this batch's {compare} and "
        "source mix with earlier ones.",
        "If the run recovers on its own, a lower learning rate or tighter clipping may be enough; "
        "change one setting at a time so you learn what fixed it.",
    ]
    return verdict_node(VerdictKind.SPIKE_NO_SINGLE_CAUSE, headline, f, suggestions, reading)
