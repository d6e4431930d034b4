"""Plain-words terminal summary of a report (what `forensics replay` prints), and the sentences that the
Markdown and HTML renderers share. Numbers, ids and labels are worded by forensics.report.wording."""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, Mapping, Sequence, TypeVar

from forensics.report.wording import fp32_ran_words
from forensics.report.model import as_float
from forensics.core.kinds import FidelityMode, Phase, TriggerKind, VerdictKind
from forensics.report.tree import Bisection, Report, Timings, parse_report
from forensics.report.wording import (
    MAX_LISTED_SAMPLES,
    clean,
    fmt_id,
    fmt_list,
    fmt_num,
    mb_number,
    mb_phrase,
    module_words,
    pattern_words,
    verdict_label,
)
from forensics.core.trigger import detail_words

log = logging.getLogger(__name__)


def is_nonfinite(value: Any) -> bool:
    x = as_float(value)
    return x is not None and not math.isfinite(x)


Row = TypeVar("Row")


def row_nonfinite(row: Any) -> bool:
    """A per-sample row that is non-finite: its own `finite` flag, its loss or its gradient norm (the one rule the
    summary's count, the table and the plot's hatching share)."""
    return not getattr(row, "error", None) and (
        getattr(row, "finite", None) is False
        or is_nonfinite(getattr(row, "loss", None))
        or is_nonfinite(getattr(row, "grad_norm", None))
    )


def top_rows(rows: Sequence[Row], value: Callable[[Row], Any], n: int = 20) -> list[Row]:
    """The `n` rows with the largest `value(row)`: non-finite first, then largest finite, then null."""

    def order(row: Row) -> tuple:
        x = as_float(value(row))
        if x is None:
            return (2, 0.0)
        if not math.isfinite(x):
            return (0, 0.0 if math.isnan(x) else -x)
        return (1, -x)

    return sorted(rows, key=order)[:n]


# ---- sentences shared by the text, Markdown and HTML renderers (plain words, no markup) ----


def where_sentence(report: Mapping | Report) -> str:
    """'Step 41217, rank 3 of 8, micro-batch 2 of 4.'"""
    r = parse_report(report)
    dump = r.dump
    parts = [f"Step {'?' if dump.step is None else dump.step}"]
    if dump.rank is not None:
        ws = dump.world_size
        parts.append(f"rank {dump.rank}" + (f" of {ws}" if isinstance(ws, int) and ws > 1 else ""))
    mb = r.trigger.micro_batch
    mbs = sorted({s.micro_batch for s in r.culprit.samples if isinstance(s.micro_batch, int)})
    if len(mbs) == 1:
        mb = mbs[0]
    n = dump.num_micro_batches
    if len(mbs) > 1:
        parts.append(
            "micro-batches " + ", ".join(mb_number(m) for m in mbs) + (f" of {n}" if isinstance(n, int) else "")
        )
    elif mb is not None:
        parts.append(mb_phrase(mb, n))
    text = ", ".join(parts) + "."
    missing = dump.missing_ranks or []
    if missing:
        text += f" Ranks that wrote no dump: {', '.join(str(m) for m in missing)}."
    damage = damage_sentence(r)
    return f"{text} {damage}" if damage else text


def damage_sentence(report: Mapping | Report) -> str:
    """'The dump is damaged: window.json (...) — the flight recorder ...: the window replay is skipped.' ('' if not)."""
    damaged = parse_report(report).dump.damaged
    if not damaged:
        return ""
    parts = [f"{clean(d.file, 80)} ({clean(d.problem, 200)}) — {clean(d.lost, 200)}" for d in damaged]
    return "The dump is damaged, and the replay went on without the damaged parts: " + "; ".join(parts) + "."


def trigger_sentence(report: Mapping | Report) -> str:
    trigger = parse_report(report).trigger
    kind = trigger.kind or "unknown trigger"
    detail = detail_words(trigger.detail, trigger.micro_batch)
    text = f"Trigger: {clean(kind)}"
    if detail:
        text += f" ({clean(detail, 200)})"
    else:
        text += f" (value {fmt_num(trigger.value)}"
        if trigger.threshold is not None:
            text += f", threshold {fmt_num(trigger.threshold)}"
        text += ")"
    return text + "."


def reproduction_sentence(report: Mapping | Report) -> str:
    r = parse_report(report)
    fid, replay = r.fidelity, r.environment.replay
    device = replay.device or "the replay device"
    on = f"on {clean(device)}" + (f" ({clean(replay.gpu)})" if replay.gpu else "")
    if fid.mode == FidelityMode.NOT_REPLAYED:
        return f"Not replayed: {clean(fid.reason or 'nothing to reproduce', 300)}."
    attempts = fid.attempts
    att = f"{attempts} attempt{'s' if attempts != 1 else ''}" if isinstance(attempts, int) else None
    if r.reproduced:
        compared = any(v is not None for v in fid.recorded_losses or []) or fid.grad_norm_compared
        if not compared and fid.recorded_losses is not None:
            return (
                f"Reproduced {on}" + (f", {att}" if att else "") + ": it raised where the job did, before any "
                "loss the job recorded, so there is no value to compare bit for bit."
            )
        if fid.bitwise_equal or (fid.mode == FidelityMode.BITWISE and fid.bitwise_equal is not False):
            how = FidelityMode.BITWISE.value  # the mode's name is the word
        elif fid.mode == FidelityMode.TOLERANCE:
            how = f"within tolerance {fmt_num(fid.tolerance)}"
            if fid.max_abs_diff is not None:
                how += f" (max abs diff {fmt_num(fid.max_abs_diff)})"
        else:
            how = "but not bitwise"
            if fid.max_abs_diff is not None:
                how += f" (max abs diff {fmt_num(fid.max_abs_diff)})"
        text = f"Reproduced {how} {on}" + (f", {att}." if att else ".")
        if fid.grad_norm_compared is False and fid.grad_norm_reason:
            text += f" Grad norm not compared: {clean(fid.grad_norm_reason, 300)}."
        return text
    rec, rep = fid.recorded_losses or [], fid.replayed_losses or []
    diverged = fid.diverged if isinstance(fid.diverged, Mapping) else None
    text = (f"Reproduced as the run's divergence {on}, not bit for bit" if diverged else f"NOT reproduced {on}") + (
        f" after {att}" if att else ""
    )
    if rec or rep:
        text += f": recorded losses [{fmt_list(rec)}], replayed [{fmt_list(rep)}]"
    gn_rec, gn_rep = fid.recorded_grad_norm, fid.replayed_grad_norm
    if gn_rec is not None or gn_rep is not None:
        text += f"; grad norm recorded {fmt_num(gn_rec)}, replayed {fmt_num(gn_rep)}"
    if diverged:
        text += (
            f" ({fmt_num(diverged.get('times_healthy'), 3)} x the run's healthy "
            f"{fmt_num(diverged.get('healthy_grad_norm'), 3)})"
        )
    return text + "."


def rng_sentence(report: Mapping | Report) -> str | None:
    """Whether the failure needs the dump's random state (report block `rng`), or None if not checked."""
    rng = parse_report(report).rng
    if rng is None or not rng.checked:
        return None
    seeds = rng.seeds or []
    n = f"{len(seeds)} other seed{'s' if len(seeds) != 1 else ''}"
    if rng.rng_dependent:
        return (
            f"Random state: the failure needs the dump's RNG — re-run from {n} without it, the step "
            "is healthy (a dropout mask or another random op makes it)."
        )
    if rng.rng_dependent is False:
        return f"Random state: the step fails from {n} too; the RNG is not the cause."
    return None


def location_sentence(report: Mapping | Report) -> str | None:
    """Where the first bad value appeared (module / op / phase / parameter), or None if unknown."""
    r = parse_report(report)
    c = r.culprit
    module, op, phase = c.module, c.op, c.phase
    param, opt_state = c.parameter, c.optimizer_state
    nonfinite = str(r.trigger.kind or "").startswith("nonfinite")
    if phase == Phase.OPTIMIZER:
        text = "The optimizer update broke " + (f"parameter {clean(param)}" if param else "the weights")
        if opt_state:
            text += f" ({clean(opt_state)})"
        text += "."
        if module:
            text += f" Module: {clean(module)}" + (f" ({clean(op)})." if op else ".")
        return text
    if not (module or op or param):
        return None
    head = "First non-finite value" if nonfinite else "Located"
    text = head + (f" in the {clean(phase)} pass" if phase else "")
    if module:
        text += module_words(module, quote=False)
    if op:
        text += f" ({clean(op)})"
    stats = c.stats
    facts = [
        f"{label} holds NaN" if fmt_num(value) == "nan" else f"{label} abs-max {fmt_num(value, 3)}"
        for value, label in (
            (stats.inputs_absmax, "input"),
            (stats.outputs_absmax, "output"),
            (stats.params_absmax, "weight"),
        )
        if value is not None
    ]
    if facts:
        text += ": " + ", ".join(facts)
    text += "."
    if param:
        text += (
            f" First parameter with a non-finite gradient: {clean(param)}."
            if phase == Phase.BACKWARD
            else f" Non-finite parameter feeding it: {clean(param)}."
        )
    if opt_state:
        text += f" Optimizer state: {clean(opt_state)}."
    return text


def culprit_sentence(report: Mapping | Report) -> str | None:
    """'Culprit: sample 'x' (micro-batch 3 of 4, batch[5]) alone — found in 6 replays of 32 samples.'

    Micro-batches are counted from 1 (JSON index 2 above); the sample's `index` is shown as the row of
    its batch tensors, batch[5], 0-based as Python indexes it."""
    r = parse_report(report)
    samples = r.culprit.samples
    bis = r.bisection or Bisection.parse({})
    found = bisection_phrase(bis)
    n_mb = r.dump.num_micro_batches
    runs = "?" if bis.runs is None else bis.runs
    if not samples:
        if bis.unblamed_group:
            test = "whose removal ends the spike" if bis.test == "removal" else "that fails"
            return (
                f"No culprit sample: the smallest set {test} is {fmt_num(bis.unblamed_group)} of the "
                f"{fmt_num(bis.candidates)} samples ({runs} replays), too large a share "
                "of the step to blame any of them; no blocklist is written."
            )
        if bis.culprit_size:  # found, then not blamed (the rest of the step at the same edge, a diverged run)
            return (
                f"No sample is blamed: bisecting {bis.candidates} samples ({runs} replays) isolated "
                f"{fmt_num(bis.culprit_size)}, but the verdict finds the state at fault, not their data."
            )
        if bis.candidates and bis.all_subsets_fail:
            alone = _alone_count(r)
            return (
                f"No culprit sample: every subset of the {bis.candidates} samples bisection tried ({runs} replays) "
                "fails on its own"
                + (f"{alone}" if alone else ", down to single samples")
                + ": the state, not the data."
            )
        if bis.candidates:
            return (
                f"No culprit sample: bisecting {bis.candidates} samples "
                f"({runs} replays) found no subset that fails on its own."
            )
        return None

    def one(s) -> str:
        where = []
        if s.micro_batch is not None:
            where.append(mb_phrase(s.micro_batch, n_mb))
        if s.index is not None:
            where.append(f"batch[{clean(s.index)}]")
        return fmt_id(s.sample_id) + (f" ({', '.join(where)})" if where else "")

    label = "First to cross (not bad data)" if any(s.trigger for s in samples) else "Culprit"
    if len(samples) == 1:
        text = f"{label}: sample {one(samples[0])} alone"
    else:
        listed = "; ".join(one(s) for s in samples[:MAX_LISTED_SAMPLES])
        more = len(samples) - MAX_LISTED_SAMPLES
        text = f"{label}: {len(samples)} samples together: {listed}"
        if more > 0:
            text += f"; and {more} more (see report.md)"
    text += f" — {found}." if found else "."
    described = [s for s in samples[:MAX_LISTED_SAMPLES] if s.description]
    if len(samples) == 1 and described:
        text += f" Its data: {clean(described[0].description, 200)}."
    elif described:
        text += (
            " Their data: " + "; ".join(f"{fmt_id(s.sample_id)}: {clean(s.description, 200)}" for s in described) + "."
        )
    return text


def _alone_count(r: Report) -> str | None:
    """', though alone only 1 of 8 samples is non-finite (per-sample table)' when the per-sample table says fewer
    than all fail on their own (bisection's subsets share the micro-batch's random draws; a sample alone does not)."""
    if TriggerKind.parse(r.trigger.kind, TriggerKind.NONFINITE_LOSS).spike:
        return None  # a spike's subsets are judged by removal, not by a non-finite value alone
    rows = [row for row in r.per_sample if not row.error]
    bad = [row for row in rows if row_nonfinite(row)]
    if not rows or len(bad) == len(rows):
        return None
    return f", though alone only {len(bad)} of {len(rows)} sample{'s' if len(rows) != 1 else ''} {'is' if len(bad) == 1 else 'are'} non-finite (per-sample table)"


def bisection_phrase(bis: Bisection) -> str | None:
    runs, cand = bis.runs, bis.candidates
    if runs is None or cand is None:
        return None
    text = f"found in {runs} replay{'s' if runs != 1 else ''} of {cand} samples"
    if bis.budget is not None:
        text += f" (budget {bis.budget})"
    return text


def precision_sentence(report: Mapping | Report) -> str | None:
    """The fp32 triage in plain words, combined with the culprit: 'precision + data'."""
    r = parse_report(report)
    prec = r.precision
    if prec is None:
        return None
    dtype, fp32, fsdp = prec.autocast_dtype, prec.fp32_reproduces, prec.fsdp_param_dtype
    evidence = r.evidence if isinstance(r.evidence, dict) else {}
    # bad data: a trigger is not (a report without an evidence block: what its verdict says)
    bad_data = evidence["bad_data"] is True if "bad_data" in evidence else r.verdict.kind == VerdictKind.BAD_SAMPLE
    has_samples = bool(r.culprit.ids()) and bad_data
    code = prec.code_dtypes if isinstance(prec.code_dtypes, dict) else {}
    low_code = next((k for k in ("float16", "bfloat16") if code.get(k)), None)
    under = (
        f"autocast {clean(dtype)}"
        if dtype
        else f"FSDP2 mixed precision ({clean(fsdp)} compute)"
        if fsdp
        else f"{low_code} (the job's own code)"
        if low_code
        else "the job's precision"
    )
    spike = TriggerKind.parse(r.trigger.kind, TriggerKind.NONFINITE_LOSS).spike
    ran = prec.fp32_ran if isinstance(prec.fp32_ran, dict) else None
    checked = f" (checked: {fp32_ran_words(ran)})" if ran else ""
    if ran is not None and not ran.get("verified"):
        return f"Ran under {under}; the fp32 re-run could not be held to float32{checked}: no conclusion drawn."
    if fp32 is False:
        cause = "precision + data" if has_samples else "precision"
        return f"Ran under {under}; in fp32{checked} the step {'does not spike' if spike else 'is finite'} → {cause}."
    if fp32 is True:
        cause = "data, not precision" if has_samples else "not precision (data, model or optimizer)"
        return f"Ran under {under}; {'still spikes' if spike else 'still non-finite'} in fp32{checked} → {cause}."
    if not r.reproduced:
        return None  # nothing failed in the replay, so there was nothing to re-run in fp32
    if not dtype and not fsdp:
        return "The job ran in full precision (no autocast); no fp32 re-run needed."
    return f"Ran under {under}; fp32 re-run not performed."


def evidence_sentence(report: Mapping | Report) -> str | None:
    """Why the named samples are (or are not) bad data, and what an earlier state said (replay/culprits/evidence.py)."""
    r = parse_report(report)
    evidence = r.evidence if isinstance(r.evidence, dict) else None
    if not evidence or not r.culprit.samples:
        return None
    against = [clean(str(e.get("words")), 200) for e in evidence.get("against") or [] if isinstance(e, dict)]
    refuted = [clean(str(w), 200) for w in evidence.get("refuted_by") or []]
    aside = [clean(str(w), 300) for w in evidence.get("set_aside") or []]
    if against and refuted:
        text = f"What stood against the record ({'; '.join(against[:2])}) does not hold: {'; '.join(refuted)}."
    elif against:
        text = "Evidence against the record: " + "; ".join(against[:3]) + "."
    elif aside:
        text = "No evidence against the record: " + "; ".join(aside[:2]) + "."
    elif evidence.get("ordinary"):
        text = f"Its record looks like the others: {clean(str(evidence['ordinary']), 300)}."
    else:
        text = "Nothing marks its record as bad."
    if evidence.get("earlier_state"):
        text += " " + clean(str(evidence["earlier_state"]), 300)
    return text


def precursor_story_sentence(report: Mapping | Report) -> str | None:
    """What the per-layer statistics did before the crash, and the run's earlier dumps (report.md has it too)."""
    block = parse_report(report).precursor_history
    if not isinstance(block, dict) or not block.get("sentence"):
        return None
    before = (
        f"Before it, {clean(str(block['sentence']), 400)}" if block.get("lead") else clean(str(block["sentence"]), 400)
    )
    return before.rstrip(".") + "."


def history_sentence(report: Mapping | Report) -> str | None:
    r = parse_report(report)
    pattern = r.history_pattern
    if not pattern:
        return None
    words, meaning = pattern_words(pattern, r.trigger.kind)
    text = f"Loss history: {words}"
    losses = (r.history.loss if r.history else None) or []
    if losses:
        text += f" ({fmt_list(losses, 6)})"
    if meaning:
        text += f" — {meaning}"
    shows = [clean(str(line), 400) for line in (r.history.shows if r.history else None) or []]
    return " ".join([text + "."] + shows)


def per_sample_sentence(report: Mapping | Report) -> str | None:
    """Per-sample replay summary: how many samples are non-finite, which is the worst."""
    rows = parse_report(report).per_sample
    if not rows:
        return None
    raised = [r for r in rows if r.error]
    bad = [r for r in rows if row_nonfinite(r)]
    text = f"Per-sample replay: {len(bad)} of {len(rows)} samples non-finite"
    diverged = parse_report(report).fidelity.diverged
    if isinstance(diverged, Mapping) and isinstance(diverged.get("sample_grad_norms"), list):
        low, high = (diverged["sample_grad_norms"] + [None, None])[:2]
        text += (
            f", {'all ' if diverged.get('samples_over') == len(rows) else ''}{diverged.get('samples_over')} diverging "
            f"alone (gradient norm {fmt_num(low, 3)} to {fmt_num(high, 3)}, each over "
            f"{fmt_num(diverged.get('bar_times_healthy'))} x the run's healthy {fmt_num(diverged.get('healthy_grad_norm'), 3)})"
        )
    culprits = parse_report(report).culprit.samples
    if bad and (not culprits or all(s.trigger for s in culprits)):
        text += " (alone, on this state; the verdict finds the state at fault, not their records)"
    if raised:
        kind = clean(str(raised[0].error).split(":", 1)[0], 60)
        text += f", {len(raised)} raised when run alone ({kind})"
    finite = [row for row in rows if (x := as_float(row.loss)) is not None and math.isfinite(x)]
    top = top_rows(finite, lambda row: row.loss, 2)  # a NaN is no "highest loss": the count above says it
    if not top:
        return text + "."
    worst = f"{fmt_id(top[0].sample_id)} loss {fmt_num(top[0].loss)}"
    if len(top) > 1:
        worst += f" (next highest {fmt_num(top[1].loss)})"
    label = "highest finite loss" if len(finite) < len(rows) else "highest loss"
    return f"{text}; {label}: {worst}."


def timing_sentence(report: Mapping | Report) -> str | None:
    t = parse_report(report).timings or Timings.parse({})
    if t.total_s is None:
        return None
    passes = t.passes
    return f"Replay took {fmt_num(t.total_s, 3)} s" + (
        f" ({passes} forward/backward passes)." if passes is not None else "."
    )


def render_verdict_text(report: Mapping | Report, files: Mapping[str, Any] | None = None) -> str:
    """The short terminal summary `forensics replay` prints: verdict and evidence in plain words.

    Args:
        report: a report (forensics.report.tree.Report, or its dict: schema forensics-report/1; numbers may be
            floats or "nan" strings).
        files: optional {"json"|"md"|"html"|"blocklist": path} of files written, to say where they are.
    Returns:
        Several lines of text, ending with a newline. Strings from the report are made
        terminal-safe (control characters escaped), long sample ids are cut.
    Example:
        >>> print(render_verdict_text(report, files={"md": "out/report.md"}))  # doctest: +SKIP
        Verdict: bad sample — Sample 'shard-0192/rec-55411' alone makes step 41217 non-finite.
        Step 41217, rank 3 of 8, micro-batch 2 of 4. Trigger: nonfinite_loss (loss of micro-batch 2 is nan).
        ...
    """
    r = parse_report(report)
    verdict = r.verdict
    kind = verdict.kind or "unknown"
    label = verdict_label(kind)
    lines = [f"Verdict: {label} — {clean(verdict.headline or '(no headline)', 400)}"]
    lines.append(f"{where_sentence(r)} {trigger_sentence(r)}")
    lines.append(reproduction_sentence(r))
    for make in (
        rng_sentence,
        location_sentence,
        culprit_sentence,
        evidence_sentence,
        per_sample_sentence,
        precision_sentence,
        history_sentence,
        precursor_story_sentence,
    ):
        try:
            sentence = make(r)
        except Exception:  # a malformed optional section must not hide the verdict
            log.warning("could not summarise part of the report (%s)", make.__name__, exc_info=True)
            continue
        if sentence:
            lines.append(sentence)
    for w in r.environment.warnings or []:
        lines.append(f"Warning: {clean(w, 300)}")
    suggestions = verdict.suggestions or []
    if suggestions:
        lines.append("Suggested:")
        lines.extend(f"  - {clean(s, 300)}" for s in suggestions)
    timing = timing_sentence(r)
    if timing:
        lines.append(timing)
    lines.extend(_files_lines(files))
    return "\n".join(lines) + "\n"


def _files_lines(files: Mapping[str, Any] | None) -> list[str]:
    if not files:
        return []
    files = {k: v for k, v in files.items() if v is not None}
    lines = []
    main = files.get("md") or files.get("html") or files.get("json")
    if main is not None:
        others = [os.path.basename(str(files[k])) for k in ("html", "json") if k in files and files[k] is not main]
        lines.append(f"Report: {clean(str(main))}" + (f" (also {', '.join(others)})" if others else ""))
    if files.get("blocklist") is not None:
        lines.append(f"Blocklist of culprit samples: {clean(str(files['blocklist']))}")
    for k, v in files.items():
        if k not in ("md", "html", "json", "blocklist"):
            lines.append(f"{clean(k)}: {clean(str(v))}")
    return lines
