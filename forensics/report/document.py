"""The report as a document: a tiny model (sections of paragraphs, bullets, tables, code, plots) and the
one function that builds it from a report dict. report.md (render_markdown) and report.html
(render_html) render the same sections, each escaping every string for its own syntax."""

from __future__ import annotations

import json
import re
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from forensics.report.render_text import (
    bisection_phrase, culprit_ids, culprit_sentence, history_sentence, is_nonfinite, location_sentence,
    per_sample_sentence, precision_sentence, reproduction_sentence, rng_sentence, section, timing_sentence,
    top_rows, trigger_detail, trigger_sentence, where_sentence,
)
from forensics.kinds import HistoryPattern
from forensics.report.wording import clean, fmt_num, mb_number, mb_phrase, verdict_label

log = logging.getLogger(__name__)

TOP_N = 20            # rows in the per-sample and per-layer tables
HISTORY_ROWS = 12     # most recent history steps shown as a table
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


def build_sections(report: Mapping) -> list[Section]:
    """The report as a list of titled sections (shared by the Markdown and HTML renderers).

    Every string in the result is raw (unescaped) text from the report; renderers escape it.
    Each optional section says "not run" when the report has no data for it.
    """
    builders = (_summary, *((_precursor,) if report.get("precursor") else ()), *((_repro,) if report.get("repro") else ()),
                _where, _reproduction, _culprit,
                *((_exception,) if report.get("exception") else ()),
                *((_window,) if report.get("window") else ()),
                _remedies, _precision, _bisection, _per_sample, _per_layer, _history, _environment, _timings)
    out = []
    for build in builders:
        try:
            out.append(build(report))
        except Exception:  # one malformed optional section must not lose the whole report
            log.warning("could not render report section %s", build.__name__, exc_info=True)
            out.append(Section(build.__name__.strip("_").replace("_", " ").capitalize(),
                               [Para(["This section could not be rendered; see report.json."])]))
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
            parts.append(text[last:match.start()])
        parts.append(Code(match.group(1)))
        last = match.end()
    if last < len(text):
        parts.append(text[last:])
    return parts


def _summary(report: Mapping) -> Section:
    verdict = section(report, "verdict")
    kind = verdict.get("kind") or "unknown"
    blocks: list[Block] = [Para([Strong(f"Verdict: {verdict_label(kind)}."), " ",
                                 *prose(verdict.get("headline") or "")])]
    for paragraph in re.split(r"\n\s*\n", verdict.get("explanation") or ""):
        if paragraph.strip():
            blocks.append(Para(prose(" ".join(paragraph.split()))))
    facts = [where_sentence(report) + " " + trigger_sentence(report), reproduction_sentence(report)]
    for make in (location_sentence, culprit_sentence, precision_sentence, history_sentence):
        sentence = make(report)
        if sentence:
            facts.append(sentence)
    blocks.append(Bullets([[f] for f in facts]))
    suggestions = verdict.get("suggestions") or []
    if suggestions:
        blocks.append(Para([Strong("Suggested next steps:")]))
        blocks.append(Bullets([prose(s) for s in suggestions]))
    return Section("Verdict", blocks, "verdict")


def _where(report: Mapping) -> Section:
    dump, trig = section(report, "dump"), section(report, "trigger")
    rows: list[tuple[str, Inline]] = [
        ("Run id", _code_or_na(dump.get("run_id"))),
        ("Dump", _code_or_na(dump.get("path"))),
        ("Step", fmt_num(dump.get("step"))),
        ("Rank", f"{fmt_num(dump.get('rank'))} of world size {fmt_num(dump.get('world_size'))}"),
        ("Micro-batches in the step", fmt_num(dump.get("num_micro_batches"))),
        ("Missing ranks", ", ".join(str(r) for r in dump.get("missing_ranks") or []) or "none"),
        ("Trigger", _code_or_na(trig.get("kind"))),
        ("Value", fmt_num(trig.get("value"))),
        ("Threshold", fmt_num(trig.get("threshold"))),
        ("Micro-batch", mb_phrase(trig["micro_batch"], dump.get("num_micro_batches"))
         if trig.get("micro_batch") is not None else "n/a"),
        ("Detail", trigger_detail(trig) or "n/a"),
        ("Report created", report.get("created_at") or "n/a"),
    ]
    return Section("Where it happened", [_kv_table(rows)], "where")


def _reproduction(report: Mapping) -> Section:
    fid = section(report, "fidelity")
    blocks: list[Block] = [Para([reproduction_sentence(report)])]
    rec, rep = fid.get("recorded_losses") or [], fid.get("replayed_losses") or []
    if rec or rep:
        rows: list[list[Inline]] = []
        for i in range(max(len(rec), len(rep))):
            a = rec[i] if i < len(rec) else None
            b = rep[i] if i < len(rep) else None
            same = "n/a" if a is None or b is None else _yes_no(fmt_num(a, 17) == fmt_num(b, 17))
            rows.append([mb_number(i), fmt_num(a, 8), fmt_num(b, 8), same])
        compared = fid.get("grad_norm_compared") is not False
        rows.append(["grad norm", fmt_num(fid.get("recorded_grad_norm"), 8),
                     fmt_num(fid.get("replayed_grad_norm"), 8), "" if compared else "not compared"])
        blocks.append(Table(["micro-batch", "recorded loss", "replayed loss", "equal"], rows))
    blocks.append(_kv_table([
        ("Reproduced", _yes_no(report.get("reproduced"))),
        ("Comparison", fid.get("mode") or "n/a"),
        ("Tolerance", fmt_num(fid.get("tolerance"))),
        ("Attempts", fmt_num(fid.get("attempts"))),
        ("Max abs diff", fmt_num(fid.get("max_abs_diff"))),
        ("Bitwise equal", _yes_no(fid.get("bitwise_equal"))),
    ]))
    rng = rng_sentence(report)
    if rng:
        blocks.append(Para([rng]))
    return Section("Reproduction", blocks, "reproduction")


def _culprit(report: Mapping) -> Section:
    c = section(report, "culprit")
    blocks: list[Block] = []
    samples = [s for s in c.get("samples") or [] if isinstance(s, dict)]
    sentence = culprit_sentence(report)
    if sentence:
        blocks.append(Para([sentence]))
    if samples:
        rows = [[_sid(s.get("sample_id")), mb_number(s.get("micro_batch")), fmt_num(s.get("index")),
                 fmt_num(s.get("rank")), s.get("description") or ""] for s in samples]
        blocks.append(Table(["sample id", "micro-batch", "index (0-based)", "rank", "description"], rows))
    elif not sentence:
        blocks.append(Para(["No culprit sample was identified."]))
    loc = location_sentence(report)
    if loc:
        blocks.append(Para([loc]))
    stats = section(c, "stats")
    blocks.append(_kv_table([
        ("Module", _code_or_na(c.get("module"))),
        ("Op", _code_or_na(c.get("op"))),
        ("Phase", c.get("phase") or "n/a"),
        ("Parameter", _code_or_na(c.get("parameter"))),
        ("Optimizer state", _code_or_na(c.get("optimizer_state"))),
        ("Input abs-max", fmt_num(stats.get("inputs_absmax"))),
        ("Output abs-max", fmt_num(stats.get("outputs_absmax"))),
        ("Weight abs-max", fmt_num(stats.get("params_absmax"))),
    ]))
    if c.get("traceback"):
        blocks.append(Para(["Forward traceback of the op (anomaly mode):"]))
        blocks.append(CodeBlock(str(c["traceback"])))
    return Section("Culprit", blocks, "culprit")


def _exception(report: Mapping) -> Section:
    """A step that raised: what, where, the values that made it raise, the memory picture, the traceback."""
    exc = section(report, "exception")
    rows = [("Exception", _code_or_na(exc.get("type"))), ("Message", clean(exc.get("message") or "n/a", 300)),
            ("Raised during", clean(exc.get("during") or "n/a")), ("Module", _code_or_na(exc.get("module"))),
            ("Op", _code_or_na(exc.get("op"))), ("Data", clean(exc.get("detail") or "n/a", 300))]
    blocks: list[Block] = [_kv_table(rows)]
    bad = [b for b in exc.get("bad_values") or [] if isinstance(b, dict)]
    if bad:
        blocks.append(Table(["value", "limit", "sample", "position"],
                            [[fmt_num(b.get("value")), fmt_num(b.get("limit")), _sid(b.get("sample_id")),
                              clean(b.get("position"))] for b in bad[:TOP_N]]))
    memory = exc.get("memory")
    if isinstance(memory, dict):
        sizes: list[list[Inline]] = [[mb_number(m.get("index")), fmt_num(m.get("bytes"))] for m in memory.get("micro_batches") or []
                 if isinstance(m, dict)]
        blocks.append(Para([f"Memory when it raised: allocated {fmt_num(memory.get('allocated'))} B, reserved "
                            f"{fmt_num(memory.get('reserved'))} B of {fmt_num(memory.get('total'))} B."]))
        if sizes:
            blocks.append(Table(["micro-batch", "bytes of its tensors"], sizes))
    if exc.get("traceback"):
        blocks.append(CodeBlock(clean_block(str(exc["traceback"])[-6000:])))
    return Section("Exception", blocks, "exception")


def clean_block(text: str) -> str:
    """Multi-line text from a dump, each line escaped (control characters shown, not obeyed)."""
    return "\n".join(clean(line) for line in text.splitlines())


def _precision(report: Mapping) -> Section:
    prec = report.get("precision")
    if not isinstance(prec, dict):
        return Section("Precision triage", [Para(["Not run."])], "precision")
    return Section("Precision triage", [
        Para([precision_sentence(report) or ""]),
        _kv_table([("Autocast dtype", _code_or_na(prec.get("autocast_dtype"))),
                   ("Still non-finite in fp32", _yes_no(prec.get("fp32_reproduces")))]),
    ], "precision")


def _remedies(report: Mapping) -> Section:
    block = report.get("remedies")
    if not isinstance(block, dict):
        return Section("Remedies tried", [Para(["Not run."])], "remedies")
    rows: list[list[Inline]] = []
    for row in block.get("tested") or []:
        if not isinstance(row, dict):
            continue
        verdict = {True: "healthy", False: "not enough", None: "not tried"}.get(row.get("healthy"), "n/a")
        rows.append([str(row.get("words")), verdict, fmt_num(row.get("step_loss")), fmt_num(row.get("grad_norm")),
                     _yes_no(row.get("weights_finite")), fmt_num(row.get("relative_change")),
                     _following(row.get("following")),
                     str(row.get("change")) + (f" — {row.get('note')}" if row.get("note") else "")])
    return Section("Remedies tried", [
        Para([f"Each change re-runs the step and applies its update; {block.get('criteria') or ''}. "
              f"Following steps: {block.get('following_steps') or 'n/a'}."]),
        Table(["remedy", "result", "step loss", "grad norm", "weights finite", "update / weights", "following steps",
               "change"], rows),
    ], "remedies")


def _following(following: Any) -> str:
    """A remedy carried over the next recorded steps: 'healthy (6, 7)', 'breaks at 6', or '' (not tried)."""
    if not isinstance(following, dict) or not following.get("tested"):
        return ""
    if following.get("healthy"):
        return "healthy (" + ", ".join(fmt_num(s) for s in following.get("steps") or []) + ")"
    return f"breaks at {fmt_num(following.get('first_unhealthy'))}"


def _bisection(report: Mapping) -> Section:
    bis = report.get("bisection")
    if not isinstance(bis, dict):
        return Section("Bisection", [Para(["Not run."])], "bisection")
    phrase = bisection_phrase(bis)
    blocks: list[Block] = [Para([f"Culprit set of {fmt_num(bis.get('culprit_size'))} sample(s) "
                                 + (phrase or "") + "."])] if phrase else []
    blocks.append(_kv_table([("Replays run", fmt_num(bis.get("runs"))),
                             ("Candidate samples", fmt_num(bis.get("candidates"))),
                             ("Culprit set size", fmt_num(bis.get("culprit_size"))),
                             ("Budget (2·log2 n + 4)", fmt_num(bis.get("budget")))]))
    return Section("Bisection", blocks, "bisection")


def _per_sample(report: Mapping) -> Section:
    rows = [r for r in report.get("per_sample") or [] if isinstance(r, dict)]
    if not rows:
        return Section("Per-sample losses", [Para(["Not run."])], "per-sample")
    culprits = culprit_ids(report)
    top = top_rows(rows, "loss", TOP_N)
    table = Table(["#", "sample id", "micro-batch", "index (0-based)", "loss", "grad norm", "finite", "culprit"],
                  [], [])
    for i, r in enumerate(top, 1):
        is_culprit = r.get("sample_id") in culprits
        finite = r.get("finite")
        if finite is None:
            finite = not (is_nonfinite(r.get("loss")) or is_nonfinite(r.get("grad_norm")))
        table.rows.append([str(i), _sid(r.get("sample_id")), mb_number(r.get("micro_batch")),
                           fmt_num(r.get("index")), fmt_num(r.get("loss")),
                           fmt_num(r.get("grad_norm")), _yes_no(finite),
                           Strong("culprit") if is_culprit else ""])
        table.highlight.append(is_culprit)
    title = f"Per-sample losses (top {len(top)} of {len(rows)} by loss)"
    return Section(title, [Para([per_sample_sentence(report) or ""]), Plot("per_sample"), table],
                   "per-sample")


def _precursor(report: Mapping) -> Section:
    """A precursor report: the statistics that grew, earliest start first."""
    block = section(report, "precursor")
    rows = [r for r in block.get("ranking") or [] if isinstance(r, dict)]
    fired = block.get("fired") if isinstance(block.get("fired"), dict) else None
    blocks: list[Block] = []
    if fired:
        blocks.append(Para(["In the job, ", Code(clean(fired.get("statistic"), MAX_CELL_CHARS)), " of ",
                            Code(clean(fired.get("layer"), MAX_CELL_CHARS)), f" fired at step {fmt_num(fired.get('step'))}"
                            f" (started at step {fmt_num(fired.get('started'))})."]))
    blocks.append(Plot("precursor"))
    table = Table(["#", "layer", "statistic", "started at step", "baseline", "at the dump", "growth"], [], [])
    for i, r in enumerate(rows, 1):
        table.rows.append([str(i), _code_or_na(r.get("layer")), clean(r.get("words") or r.get("statistic")),
                           fmt_num(r.get("started")), fmt_num(r.get("baseline")), fmt_num(r.get("last")),
                           f"{fmt_num(r.get('growth'), 3)}x"])
        table.highlight.append(i == 1)
    blocks.append(table if rows else Para(["No statistic shows a sustained growth in the recorded window."]))
    title = f"Precursors ({fmt_num(block.get('ranked'))} of {fmt_num(block.get('columns'))} statistics grew)"
    return Section(title, blocks, "precursor")


def _repro(report: Mapping) -> Section:
    """`forensics repro`: where the standalone scripts are."""
    block = section(report, "repro")
    files = section(block, "files")
    rows: list[tuple[str, Inline]] = [("Directory", _code_or_na(block.get("directory"))),
                                      ("Op", _code_or_na(block.get("op")))]
    rows += [(clean(key), _code_or_na(path)) for key, path in files.items()]
    text = ("Standalone reproduction: each script fails with an AssertionError while the bug is there "
            "(op_repro.py needs only torch; model_repro.py needs the model code).")
    return Section("Standalone reproduction", [Para([text]), _kv_table(rows)], "repro")


def _per_layer(report: Mapping) -> Section:
    rows = [r for r in report.get("per_layer") or [] if isinstance(r, dict)]
    if not rows:
        return Section("Per-layer gradients", [Para(["Not run."])], "per-layer")
    module = section(report, "culprit").get("module")
    top = top_rows(rows, "grad_norm", TOP_N)
    table = Table(["#", "module", "grad norm", "output abs-max", ""], [], [])
    for i, r in enumerate(top, 1):
        hit = module is not None and r.get("module") == module
        table.rows.append([str(i), _code_or_na(r.get("module")), fmt_num(r.get("grad_norm")),
                           fmt_num(r.get("output_absmax")), Strong("culprit module") if hit else ""])
        table.highlight.append(hit)
    title = f"Per-layer gradients (top {len(top)} of {len(rows)} by grad norm)"
    return Section(title, [Plot("per_layer"), table], "per-layer")


def _window(report: Mapping) -> Section:
    """The window replay step by step: recorded vs replayed loss and grad norm, whether the weights stayed finite,
    the update's size, and the step that broke the run."""
    window = section(report, "window")
    steps = window.get("steps") or []
    broke = window.get("broke_at")
    intro = (f"Re-executed steps {fmt_num(window.get('from_step'))} to {fmt_num(steps[-1].get('step'))} from "
             f"{window.get('checkpoint') or 'the checkpoint'}; "
             + (f"step {fmt_num(broke)} broke the run: {window.get('why')}." if broke is not None
                else "no step before the dumped one broke the weights.")) if steps else \
        "The window replay re-executed no step."
    rows = [[fmt_num(s.get("step")), fmt_num(s.get("recorded_loss")), fmt_num(s.get("replayed_loss")),
             fmt_num(s.get("recorded_grad_norm")), fmt_num(s.get("replayed_grad_norm")),
             _yes_no(s.get("weights_finite")), fmt_num(s.get("relative_change")), s.get("broke") or ""]
            for s in steps[-HISTORY_ROWS:]]
    blocks: list[Block] = [Para(prose(intro))]
    if rows:
        blocks.append(Table(["step", "recorded loss", "replayed loss", "recorded grad norm", "replayed grad norm",
                             "weights finite", "update / weights", "broke the run"], rows))
    return Section("Window replay", blocks, "window")


def _history(report: Mapping) -> Section:
    hist = section(report, "history")
    steps = hist.get("step") or []
    blocks: list[Block] = []
    sentence = history_sentence(report)
    if sentence:
        blocks.append(Para([sentence]))
    if not steps:
        blocks.append(Para(["No history recorded."]))
        return Section("Loss history", blocks, "history")
    blocks.append(Plot("history"))
    loss, gn = hist.get("loss") or [], hist.get("grad_norm") or []
    first = max(0, len(steps) - HISTORY_ROWS)
    rows: list[list[Inline]] = [[fmt_num(steps[i]), fmt_num(loss[i] if i < len(loss) else None),
             fmt_num(gn[i] if i < len(gn) else None)] for i in range(first, len(steps))]
    note = f"Last {len(rows)} of {len(steps)} recorded steps (all of them are in report.json)."
    blocks.extend([Para([note]), Table(["step", "loss", "grad norm"], rows)])
    pattern = report.get("history_pattern")
    if pattern and pattern not in {p.value for p in HistoryPattern}:
        blocks.append(Para([f"Pattern: {pattern}"]))
    return Section("Loss history", blocks, "history")


def _env_value(d: Mapping, *keys: str) -> Any:
    for k in keys:
        if d.get(k) not in (None, "", []):
            return d[k]
    return None


def _gpus(capture: Mapping) -> str | None:
    gpus = capture.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        return None
    names = [str(g.get("name")) + (f" ({g['sm_count']} SMs)" if g.get("sm_count") else "")
             if isinstance(g, dict) else str(g) for g in gpus]
    distinct = sorted(set(names))
    return ", ".join(f"{n} ×{names.count(n)}" if names.count(n) > 1 else n for n in distinct)


def _environment(report: Mapping) -> Section:
    env = section(report, "environment")
    cap, rep = section(env, "capture"), section(env, "replay")
    rows: list[list[Inline]] = [
        ["device", "n/a", str(rep.get("device") or "n/a")],
        ["GPU", _gpus(cap) or "none", str(rep.get("gpu") or "none")],
        ["torch", str(cap.get("torch") or "n/a"), str(rep.get("torch") or "n/a")],
        ["python", str(cap.get("python") or "n/a"), str(rep.get("python") or "n/a")],
        ["CUDA", str(cap.get("cuda") or "none"), str(rep.get("cuda") or "n/a")],
        ["host", str(_env_value(cap, "hostname") or "n/a"), str(rep.get("hostname") or "n/a")],
        ["git commit", str(_env_value(cap, "git_commit") or "n/a"), ""],
    ]
    blocks: list[Block] = [Table(["", "training job (capture)", "replay"], rows)]
    warnings = env.get("warnings") or []
    if warnings:
        blocks.append(Para([Strong("Warnings:")]))
        blocks.append(Bullets([[str(w)] for w in warnings]))
    else:
        blocks.append(Para(["No environment warnings."]))
    return Section("Environment", blocks, "environment")


def _timings(report: Mapping) -> Section:
    t = report.get("timings")
    if not isinstance(t, dict):
        return Section("Timings", [Para(["Not recorded."])], "timings")
    return Section("Timings", [Para([timing_sentence(report) or ""]),
                               _kv_table([("Total (s)", fmt_num(t.get("total_s"))),
                                          ("Forward/backward passes", fmt_num(t.get("passes")))])],
                   "timings")
