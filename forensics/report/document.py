"""The report as a document: a tiny model (sections of paragraphs, bullets, tables, code, plots) and the
one function that builds it from a report (forensics.report.tree.Report, or its dict). report.md
(render_markdown) and report.html (render_html) render the same sections, each escaping every string for its
own syntax."""

from __future__ import annotations

import json
import re
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from forensics.report.render_text import (
    bisection_phrase,
    culprit_sentence,
    history_sentence,
    is_nonfinite,
    location_sentence,
    per_sample_sentence,
    precision_sentence,
    reproduction_sentence,
    rng_sentence,
    timing_sentence,
    top_rows,
    trigger_sentence,
    where_sentence,
)
from forensics.core.kinds import HistoryPattern
from forensics.report.tree import CaptureEnv, ExceptionBlock, Following, Precursor, Report, Repro, Window, parse_report
from forensics.report.wording import clean, fmt_num, mb_number, mb_phrase, verdict_label
from forensics.core.trigger import detail_words

log = logging.getLogger(__name__)

TOP_N = 20  # rows in the per-sample and per-layer tables
HISTORY_ROWS = 12  # most recent history steps shown as a table
MAX_CELL_CHARS = 160  # a sample id longer than this is cut in tables (report.json keeps it whole)


# ---- a tiny document model: both Markdown and HTML render these, escaping every string ----


@dataclass
class Code:
    """Inline literal text (module names, sample ids): shown verbatim, never interpreted."""

    text: str


@dataclass
class Strong:
    text: str


Inline = Union[str, Code, Strong]


@dataclass
class Para:
    parts: list[Inline]


@dataclass
class Bullets:
    items: list[list[Inline]]


@dataclass
class Table:
    header: list[str]
    rows: list[list[Inline]]
    highlight: list[bool] = field(default_factory=list)  # per row: the culprit


@dataclass
class CodeBlock:
    text: str


@dataclass
class Plot:
    """A placeholder where report.html puts a plot (Markdown skips it)."""

    name: str


Block = Union[Para, Bullets, Table, CodeBlock, Plot]


@dataclass
class Section:
    title: str
    blocks: list[Block]
    anchor: str = ""


def _id_text(sample_id: Any) -> str:
    if isinstance(sample_id, str):
        return sample_id
    try:
        return json.dumps(sample_id, ensure_ascii=False, default=repr)
    except (TypeError, ValueError):
        return repr(sample_id)


def _sid(sample_id: Any) -> Code:
    return Code(clean(_id_text(sample_id), MAX_CELL_CHARS))


def _code_or_na(value: Any) -> Inline:
    return Code(clean(value, MAX_CELL_CHARS)) if value not in (None, "") else "n/a"


def _yes_no(value: Any) -> str:
    return "n/a" if value is None else ("yes" if value else "no")


def _kv_table(rows: list[tuple[str, Inline]]) -> Table:
    return Table(["", ""], [[k, v] for k, v in rows])


def build_sections(report: Mapping | Report) -> list[Section]:
    """The report as a list of titled sections (shared by the Markdown and HTML renderers).

    Every string in the result is raw (unescaped) text from the report; renderers escape it.
    Each optional section says "not run" when the report has no data for it.
    """
    r = parse_report(report)
    builders = (
        _summary,
        *((_precursor,) if r.precursor else ()),
        *((_repro,) if r.repro else ()),
        _where,
        _reproduction,
        _culprit,
        *((_exception,) if r.exception else ()),
        *((_window,) if r.window else ()),
        _remedies,
        _precision,
        _bisection,
        _per_sample,
        _per_layer,
        _history,
        _environment,
        _timings,
    )
    out = []
    for build in builders:
        try:
            out.append(build(r))
        except Exception:  # one malformed optional section must not lose the whole report
            log.warning("could not render report section %s", build.__name__, exc_info=True)
            out.append(
                Section(
                    build.__name__.strip("_").replace("_", " ").capitalize(),
                    [Para(["This section could not be rendered; see report.json."])],
                )
            )
    return out


_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def prose(text: Any) -> list[Inline]:
    """Verdict prose as inline parts: `name` spans (module, parameter, sample names) become Code, so each
    renderer shows them as code instead of escaping the backticks."""
    parts: list[Inline] = []
    last = 0
    text = str(text)
    for match in _CODE_SPAN.finditer(text):
        if match.start() > last:
            parts.append(text[last : match.start()])
        parts.append(Code(match.group(1)))
        last = match.end()
    if last < len(text):
        parts.append(text[last:])
    return parts


def _summary(r: Report) -> Section:
    verdict = r.verdict
    kind = verdict.kind or "unknown"
    blocks: list[Block] = [Para([Strong(f"Verdict: {verdict_label(kind)}."), " ", *prose(verdict.headline or "")])]
    facts = [where_sentence(r) + " " + trigger_sentence(r), reproduction_sentence(r)]
    for make in (rng_sentence, location_sentence, culprit_sentence, precision_sentence, history_sentence):
        sentence = make(r)
        if sentence:
            facts.append(sentence)
    blocks.append(Bullets([[f] for f in facts]))
    for paragraph in re.split(r"\n\s*\n", verdict.explanation or ""):
        rest = untold(" ".join(paragraph.split()), facts)
        if rest:
            blocks.append(Para(prose(rest)))
    suggestions = verdict.suggestions or []
    if suggestions:
        blocks.append(Para([Strong("Suggested next steps:")]))
        blocks.append(Bullets([prose(s) for s in suggestions]))
    return Section("Verdict", blocks, "verdict")


# What a sentence of the verdict's explanation is about, when a fact bullet of the verdict box says it too (the
# bullets give the numbers: the step, the replay's fidelity, the op's statistics, the culprit's replays).
_TOPICS = {
    "where": re.compile(r"(step \S|the failing step\b)"),
    "reproduction": re.compile(r"(reproduced|not reproduced|not replayed)\b"),
    "rng": re.compile(r"(random state:|it fails from \d+ other seed|re-run from \d+ other seed)"),
    "location": re.compile(r"((the )?first non-finite value|the batch's own )"),
    "culprit": re.compile(r"(culprit|no culprit|bisecting \d+ samples)\b"),
    "precision": re.compile(r"(in fp32 the step|it fails in fp32 too|ran under |the job ran in full precision)"),
    "history": re.compile(r"loss history:"),
}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'\"])")


def _topic(sentence: str) -> str | None:
    low = sentence.strip().lower()
    return next((name for name, pattern in _TOPICS.items() if pattern.match(low)), None)


def untold(explanation: str, facts: list[str]) -> str:
    """The sentences of `explanation` that no fact bullet already says (word for word, or on the same topic: where,
    reproduction, random state, location, culprit, precision, loss history): the verdict box says each thing once."""
    told = {_topic(f) for f in facts} - {None}
    said = " ".join(" ".join(f.split()) for f in facts)
    kept = [
        _unsaid_clauses(" ".join(s.split()), said)
        for s in _SENTENCE_END.split(explanation)
        if s.strip() and _topic(s) not in told and " ".join(s.split()) not in said
    ]
    return " ".join(s for s in kept if s)


def _unsaid_clauses(sentence: str, said: str) -> str:
    """`sentence` ('Label: clause; clause.') without the clauses the bullets already say word for word ('' when
    none is left)."""
    label, colon, body = sentence.partition(": ")
    if not colon or len(label) > 40:  # no 'Label: ' opening: the clauses are the whole sentence's
        label, body = "", sentence
    end = body[-1] if body[-1:] in ".!?" else ""
    clauses = [c for c in (body[:-1] if end else body).split("; ") if c.strip()]
    kept = [c for c in clauses if c not in said]
    if len(kept) == len(clauses):
        return sentence
    if not kept:
        return ""
    return (f"{label}: " if label else "") + "; ".join(kept) + end


def _where(r: Report) -> Section:
    dump, trig = r.dump, r.trigger
    rows: list[tuple[str, Inline]] = [
        ("Run id", _code_or_na(dump.run_id)),
        ("Dump", _code_or_na(dump.path)),
        ("Step", fmt_num(dump.step)),
        ("Rank", f"{fmt_num(dump.rank)} of world size {fmt_num(dump.world_size)}"),
        ("Micro-batches in the step", fmt_num(dump.num_micro_batches)),
        ("Missing ranks", ", ".join(str(m) for m in dump.missing_ranks or []) or "none"),
        ("Trigger", _code_or_na(trig.kind)),
        ("Value", fmt_num(trig.value)),
        ("Threshold", fmt_num(trig.threshold)),
        ("Micro-batch", mb_phrase(trig.micro_batch, dump.num_micro_batches) if trig.micro_batch is not None else "n/a"),
        ("Detail", detail_words(trig.detail, trig.micro_batch) or "n/a"),
        ("Report created", r.created_at or "n/a"),
    ]
    return Section("Where it happened", [_kv_table(rows)], "where")


def _reproduction(r: Report) -> Section:
    fid = r.fidelity
    blocks: list[Block] = [Para([reproduction_sentence(r)])]
    rec, rep = fid.recorded_losses or [], fid.replayed_losses or []
    if rec or rep:
        rows: list[list[Inline]] = []
        for i in range(max(len(rec), len(rep))):
            a = rec[i] if i < len(rec) else None
            b = rep[i] if i < len(rep) else None
            same = "n/a" if a is None or b is None else _yes_no(fmt_num(a, 17) == fmt_num(b, 17))
            rows.append([mb_number(i), fmt_num(a, 8), fmt_num(b, 8), same])
        compared = fid.grad_norm_compared is not False
        rows.append(
            [
                "grad norm",
                fmt_num(fid.recorded_grad_norm, 8),
                fmt_num(fid.replayed_grad_norm, 8),
                "" if compared else "not compared",
            ]
        )
        blocks.append(Table(["micro-batch", "recorded loss", "replayed loss", "equal"], rows))
    blocks.append(
        _kv_table(
            [
                (
                    "Reproduced",
                    "as the run's divergence, not bit for bit (the job's non-finite value: no)"
                    if not r.reproduced and isinstance(fid.diverged, Mapping)
                    else _yes_no(r.reproduced),
                ),
                ("Comparison", fid.mode or "n/a"),
                ("Tolerance", fmt_num(fid.tolerance)),
                ("Attempts", fmt_num(fid.attempts)),
                ("Max abs diff", fmt_num(fid.max_abs_diff)),
                ("Bitwise equal", _yes_no(fid.bitwise_equal)),
            ]
        )
    )
    rng = rng_sentence(r)
    if rng:
        blocks.append(Para([rng]))
    return Section("Reproduction", blocks, "reproduction")


def _culprit(r: Report) -> Section:
    c = r.culprit
    blocks: list[Block] = []
    sentence = culprit_sentence(r)
    if sentence:
        blocks.append(Para([sentence]))
    if c.samples:
        rows: list[list[Inline]] = [
            [_sid(s.sample_id), mb_number(s.micro_batch), fmt_num(s.index), fmt_num(s.rank), s.description or ""]
            for s in c.samples
        ]
        blocks.append(Table(["sample id", "micro-batch", "index (0-based)", "rank", "description"], rows))
    elif not sentence:
        blocks.append(Para(["No culprit sample was identified."]))
    loc = location_sentence(r)
    if loc:
        blocks.append(Para([loc]))
    blocks.append(
        _kv_table(
            [
                ("Module", _code_or_na(c.module)),
                ("Op", _code_or_na(c.op)),
                ("Phase", c.phase or "n/a"),
                ("Parameter", _code_or_na(c.parameter)),
                ("Optimizer state", _code_or_na(c.optimizer_state)),
                ("Input abs-max", fmt_num(c.stats.inputs_absmax)),
                ("Output abs-max", fmt_num(c.stats.outputs_absmax)),
                ("Weight abs-max", fmt_num(c.stats.params_absmax)),
            ]
        )
    )
    if c.traceback:
        blocks.append(Para(["Forward traceback of the op (anomaly mode):"]))
        blocks.append(CodeBlock(str(c.traceback)))
    return Section("Culprit", blocks, "culprit")


def _exception(r: Report) -> Section:
    """A step that raised: what, where, the values that made it raise, the memory picture, the traceback."""
    exc = r.exception or ExceptionBlock.parse({})  # the section is built only for a report that has one
    rows: list[tuple[str, Inline]] = [
        ("Exception", _code_or_na(exc.type)),
        ("Message", clean(exc.message or "n/a", 300)),
        ("Raised during", clean(exc.during or "n/a")),
        ("Module", _code_or_na(exc.module)),
        ("Op", _code_or_na(exc.op)),
        ("Data", clean(exc.detail or "n/a", 300)),
    ]
    blocks: list[Block] = [_kv_table(rows)]
    if exc.bad_values:
        blocks.append(
            Table(
                ["value", "limit", "sample", "position"],
                [
                    [fmt_num(b.value), fmt_num(b.limit), _sid(b.sample_id), clean(b.position)]
                    for b in exc.bad_values[:TOP_N]
                ],
            )
        )
    memory = exc.memory
    if memory is not None:
        sizes: list[list[Inline]] = [[mb_number(m.index), fmt_num(m.bytes)] for m in memory.micro_batches]
        blocks.append(
            Para(
                [
                    f"Memory when it raised: allocated {fmt_num(memory.allocated)} B, reserved "
                    f"{fmt_num(memory.reserved)} B of {fmt_num(memory.total)} B."
                ]
            )
        )
        if sizes:
            blocks.append(Table(["micro-batch", "bytes of its tensors"], sizes))
    if exc.traceback:
        blocks.append(CodeBlock(clean_block(str(exc.traceback)[-6000:])))
    return Section("Exception", blocks, "exception")


def clean_block(text: str) -> str:
    """Multi-line text from a dump, each line escaped (control characters shown, not obeyed)."""
    return "\n".join(clean(line) for line in text.splitlines())


def _precision(r: Report) -> Section:
    prec = r.precision
    if prec is None:
        return Section("Precision triage", [Para(["Not run."])], "precision")
    return Section(
        "Precision triage",
        [
            Para([precision_sentence(r) or ""]),
            _kv_table(
                [
                    ("Autocast dtype", _code_or_na(prec.autocast_dtype)),
                    ("Still non-finite in fp32", _yes_no(prec.fp32_reproduces)),
                ]
            ),
        ],
        "precision",
    )


def _remedies(r: Report) -> Section:
    block = r.remedies
    if block is None:
        return Section("Remedies tried", [Para(["Not run."])], "remedies")
    rows: list[list[Inline]] = []
    for row in block.tested:
        verdict = {True: "healthy", False: "not enough", None: "not tried"}.get(row.healthy, "n/a")
        rows.append(
            [
                str(row.words),
                verdict,
                fmt_num(row.step_loss),
                fmt_num(row.grad_norm),
                _yes_no(row.weights_finite),
                fmt_num(row.relative_change),
                _following(row.following),
                str(row.change) + (f" — {row.note}" if row.note else ""),
            ]
        )
    return Section(
        "Remedies tried",
        [
            Para(
                [
                    f"Each change re-runs the step and applies its update; {block.criteria or ''}. "
                    f"Following steps: {block.following_steps or 'n/a'}."
                ]
            ),
            Table(
                [
                    "remedy",
                    "result",
                    "step loss",
                    "grad norm",
                    "weights finite",
                    "update / weights",
                    "following steps",
                    "change",
                ],
                rows,
            ),
        ],
        "remedies",
    )


def _following(following: Following | None) -> str:
    """A remedy carried over the next recorded steps: 'healthy (6, 7)', 'breaks at 6', or '' (not tried)."""
    if following is None or not following.tested:
        return ""
    if following.healthy:
        return "healthy (" + ", ".join(fmt_num(s) for s in following.steps or []) + ")"
    return f"breaks at {fmt_num(following.first_unhealthy)}"


def _bisection(r: Report) -> Section:
    bis = r.bisection
    if bis is None:
        return Section("Bisection", [Para(["Not run."])], "bisection")
    phrase = bisection_phrase(bis)
    blocks: list[Block] = (
        [Para([f"Culprit set of {fmt_num(bis.culprit_size)} sample(s) " + (phrase or "") + "."])] if phrase else []
    )
    blocks.append(
        _kv_table(
            [
                ("Replays run", fmt_num(bis.runs)),
                ("Candidate samples", fmt_num(bis.candidates)),
                ("Culprit set size", fmt_num(bis.culprit_size)),
                ("Budget (2·log2 n + 4)", fmt_num(bis.budget)),
            ]
        )
    )
    return Section("Bisection", blocks, "bisection")


def _per_sample(r: Report) -> Section:
    rows = r.per_sample
    if not rows:
        return Section("Per-sample losses", [Para(["Not run."])], "per-sample")
    culprits = r.culprit.ids()
    top = top_rows(rows, lambda row: row.loss, TOP_N)
    table = Table(
        ["#", "sample id", "micro-batch", "index (0-based)", "loss", "grad norm", "finite", "culprit"], [], []
    )
    for i, row in enumerate(top, 1):
        is_culprit = row.sample_id in culprits
        finite = row.finite
        if finite is None:
            finite = not (is_nonfinite(row.loss) or is_nonfinite(row.grad_norm))
        table.rows.append(
            [
                str(i),
                _sid(row.sample_id),
                mb_number(row.micro_batch),
                fmt_num(row.index),
                fmt_num(row.loss),
                fmt_num(row.grad_norm),
                _yes_no(finite),
                Strong("culprit") if is_culprit else "",
            ]
        )
        table.highlight.append(is_culprit)
    title = f"Per-sample losses (top {len(top)} of {len(rows)} by loss)"
    return Section(title, [Para([per_sample_sentence(r) or ""]), Plot("per_sample"), table], "per-sample")


def _precursor(r: Report) -> Section:
    """A precursor report: the statistics that grew, earliest start first."""
    block = r.precursor or Precursor.parse({})  # the section is built only for a report that has one
    fired = block.fired
    blocks: list[Block] = []
    if fired:
        blocks.append(
            Para(
                [
                    "In the job, ",
                    Code(clean(fired.statistic, MAX_CELL_CHARS)),
                    " of ",
                    Code(clean(fired.layer, MAX_CELL_CHARS)),
                    f" fired at step {fmt_num(fired.step)} (started at step {fmt_num(fired.started)}).",
                ]
            )
        )
    blocks.append(Plot("precursor"))
    table = Table(["#", "layer", "statistic", "started at step", "baseline", "at the dump", "growth"], [], [])
    for i, row in enumerate(block.ranking, 1):
        table.rows.append(
            [
                str(i),
                _code_or_na(row.layer),
                clean(row.words or row.statistic),
                fmt_num(row.started),
                fmt_num(row.baseline),
                fmt_num(row.last),
                f"{fmt_num(row.growth, 3)}x",
            ]
        )
        table.highlight.append(i == 1)
    blocks.append(table if block.ranking else Para(["No statistic shows a sustained growth in the recorded window."]))
    title = f"Precursors ({fmt_num(block.ranked)} of {fmt_num(block.columns)} statistics grew)"
    return Section(title, blocks, "precursor")


def _repro(r: Report) -> Section:
    """`forensics repro`: where the standalone scripts are."""
    block = r.repro or Repro.parse({})  # the section is built only for a report that has one
    files = block.files if isinstance(block.files, dict) else {}
    rows: list[tuple[str, Inline]] = [("Directory", _code_or_na(block.directory)), ("Op", _code_or_na(block.op))]
    rows += [(clean(key), _code_or_na(path)) for key, path in files.items()]
    text = (
        "Standalone reproduction: each script fails with an AssertionError while the bug is there "
        "(op_repro.py needs only torch; model_repro.py needs the model code)."
    )
    return Section("Standalone reproduction", [Para([text]), _kv_table(rows)], "repro")


def _per_layer(r: Report) -> Section:
    rows = r.per_layer
    if not rows:
        return Section("Per-layer gradients", [Para(["Not run."])], "per-layer")
    module = r.culprit.module
    top = top_rows(rows, lambda row: row.grad_norm, TOP_N)
    table = Table(["#", "module", "grad norm", "output abs-max", ""], [], [])
    for i, row in enumerate(top, 1):
        hit = module is not None and row.module == module
        table.rows.append(
            [
                str(i),
                _code_or_na(row.module),
                fmt_num(row.grad_norm),
                fmt_num(row.output_absmax),
                Strong("culprit module") if hit else "",
            ]
        )
        table.highlight.append(hit)
    title = f"Per-layer gradients (top {len(top)} of {len(rows)} by grad norm)"
    return Section(title, [Plot("per_layer"), table], "per-layer")


def _window(r: Report) -> Section:
    """The window replay step by step: recorded vs replayed loss and grad norm, whether the weights stayed finite,
    the update's size, and the step that broke the run."""
    window = r.window or Window.parse({})  # the section is built only for a report that has one
    steps = window.steps
    broke = window.broke_at
    intro = (
        (
            f"Re-executed steps {fmt_num(window.from_step)} to {fmt_num(steps[-1].step)} from "
            f"{window.checkpoint or 'the checkpoint'}; "
            + (
                f"step {fmt_num(broke)} broke the run: {window.why}."
                if broke is not None
                else "no step before the dumped one broke the weights."
            )
        )
        if steps
        else "The window replay re-executed no step."
    )
    rows: list[list[Inline]] = [
        [
            fmt_num(s.step),
            fmt_num(s.recorded_loss),
            fmt_num(s.replayed_loss),
            fmt_num(s.recorded_grad_norm),
            fmt_num(s.replayed_grad_norm),
            _yes_no(s.weights_finite),
            fmt_num(s.relative_change),
            s.broke or "",
        ]
        for s in steps[-HISTORY_ROWS:]
    ]
    blocks: list[Block] = [Para(prose(intro))]
    if rows:
        blocks.append(
            Table(
                [
                    "step",
                    "recorded loss",
                    "replayed loss",
                    "recorded grad norm",
                    "replayed grad norm",
                    "weights finite",
                    "update / weights",
                    "broke the run",
                ],
                rows,
            )
        )
    return Section("Window replay", blocks, "window")


def _history(r: Report) -> Section:
    hist = r.history
    steps = (hist.step if hist else None) or []
    blocks: list[Block] = []
    sentence = history_sentence(r)
    if sentence:
        blocks.append(Para([sentence]))
    if not steps or hist is None:
        blocks.append(Para(["No history recorded."]))
        return Section("Loss history", blocks, "history")
    blocks.append(Plot("history"))
    loss, gn = hist.loss or [], hist.grad_norm or []
    first = max(0, len(steps) - HISTORY_ROWS)
    rows: list[list[Inline]] = [
        [fmt_num(steps[i]), fmt_num(loss[i] if i < len(loss) else None), fmt_num(gn[i] if i < len(gn) else None)]
        for i in range(first, len(steps))
    ]
    note = f"Last {len(rows)} of {len(steps)} recorded steps (all of them are in report.json)."
    blocks.extend([Para([note]), Table(["step", "loss", "grad norm"], rows)])
    pattern = r.history_pattern
    if pattern and pattern not in {p.value for p in HistoryPattern}:
        blocks.append(Para([f"Pattern: {pattern}"]))
    return Section("Loss history", blocks, "history")


def _gpus(capture: CaptureEnv) -> str | None:
    gpus = capture.gpus
    if not isinstance(gpus, list) or not gpus:
        return None
    names = [
        str(g.get("name")) + (f" ({g['sm_count']} SMs)" if g.get("sm_count") else "") if isinstance(g, dict) else str(g)
        for g in gpus
    ]
    distinct = sorted(set(names))
    return ", ".join(f"{n} ×{names.count(n)}" if names.count(n) > 1 else n for n in distinct)


def _filled(value: Any) -> Any:
    """None for a value that says nothing (None, '', [])."""
    return None if value in (None, "", []) else value


def _environment(r: Report) -> Section:
    env = r.environment
    cap, rep = env.capture, env.replay
    rows: list[list[Inline]] = [
        ["device", "n/a", str(rep.device or "n/a")],
        ["GPU", _gpus(cap) or "none", str(rep.gpu or "none")],
        ["torch", str(cap.torch or "n/a"), str(rep.torch or "n/a")],
        ["python", str(cap.python or "n/a"), str(rep.python or "n/a")],
        ["CUDA", str(cap.cuda or "none"), str(rep.cuda or "n/a")],
        ["host", str(_filled(cap.hostname) or "n/a"), str(rep.hostname or "n/a")],
        ["git commit", str(_filled(cap.git_commit) or "n/a"), ""],
    ]
    blocks: list[Block] = [Table(["", "training job (capture)", "replay"], rows)]
    warnings = env.warnings or []
    if warnings:
        blocks.append(Para([Strong("Warnings:")]))
        blocks.append(Bullets([[str(w)] for w in warnings]))
    else:
        blocks.append(Para(["No environment warnings."]))
    return Section("Environment", blocks, "environment")


def _timings(r: Report) -> Section:
    t = r.timings
    if t is None:
        return Section("Timings", [Para(["Not recorded."])], "timings")
    return Section(
        "Timings",
        [
            Para([timing_sentence(r) or ""]),
            _kv_table([("Total (s)", fmt_num(t.total_s)), ("Forward/backward passes", fmt_num(t.passes))]),
        ],
        "timings",
    )
