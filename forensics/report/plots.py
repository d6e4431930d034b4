"""PNG plots for report.html (loss / grad-norm history, per-layer and per-sample bars); matplotlib is optional.

matplotlib is imported lazily, and only through `matplotlib.figure.Figure` with an explicit Agg
canvas: the global pyplot backend of the caller's process (a notebook, a training job) is never
changed.
"""

from __future__ import annotations

import io
import logging
import math
from typing import Any, Callable, Mapping

from forensics.report.model import as_float
from forensics.report.render_text import row_nonfinite, top_rows
from forensics.report.tree import LayerRow, Report, parse_report

log = logging.getLogger(__name__)

TOP_LAYERS = 20
MAX_SAMPLES = 64  # bars in the per-sample chart; more samples -> the highest losses only
LABEL_CHARS = 28  # tick labels are cut to this many characters
DPI = 100
RED, BLUE, ORANGE, GREY = "#c0392b", "#2e86c1", "#e67e22", "#7f8c8d"


def matplotlib_available() -> bool:
    """True if matplotlib can be imported (plots are skipped otherwise)."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        return False
    return True


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    # No "Software" metadata: the PNG then holds no URL, and bytes do not depend on the version.
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _label(value: Any) -> str:
    """Tick label text: cut, and `$` escaped so matplotlib does not parse it as mathtext."""
    text = value if isinstance(value, str) else repr(value)
    text = "".join(c if c.isprintable() else "?" for c in text)
    if len(text) > LABEL_CHARS:
        text = text[: LABEL_CHARS - 1] + "…"
    return text.replace("$", r"\$")


def _log_axis(axis, set_scale) -> None:
    """Log scale with plain tick labels (3.5, 40, 1e+04) instead of 3.5×10⁰ mathtext."""
    from matplotlib.ticker import LogFormatter

    set_scale("log")
    axis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _nonfinite_word(x: float | None) -> str:
    return "nan" if x is None or math.isnan(x) else ("inf" if x > 0 else "-inf")


def _plot_series(ax, steps: list, values: list, name: str, color: str, trigger_step: Any) -> None:
    from matplotlib.transforms import blended_transform_factory

    xs, ys, bad = [], [], []
    for s, v in zip(steps, values):
        x = as_float(v)
        if x is None or as_float(s) is None:
            continue
        if math.isfinite(x):
            xs.append(s)
            ys.append(x)
        else:
            bad.append((s, _nonfinite_word(x)))
    if ys:
        ax.plot(xs, ys, color=color, marker="." if len(ys) < 60 else None, linewidth=1.2, label=name)
        if all(y > 0 for y in ys):
            _log_axis(ax.yaxis, ax.set_yscale)
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for s, word in bad:  # non-finite values: a red marker at the top of the axes, labelled
        ax.plot([s], [0.96], marker="v", color=RED, markersize=9, transform=top, clip_on=False)
        ax.annotate(
            word,
            (s, 0.96),
            xycoords=top,
            xytext=(0, -14),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            color=RED,
        )
    if as_float(trigger_step) is not None:
        ax.axvline(trigger_step, color=RED, linestyle="--", linewidth=1, label=f"trigger (step {trigger_step})")
    ax.set_ylabel(name + (" (log)" if ax.get_yscale() == "log" else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)


def plot_history(report: Mapping | Report) -> bytes | None:
    """Loss and grad norm per step (log y), trigger step marked, non-finite values marked at the top.

    Returns PNG bytes, or None when the report has no history.
    """
    r = parse_report(report)
    hist = r.history
    steps = (hist.step if hist else None) or []
    if not steps or hist is None:
        return None
    trigger_step = r.dump.step
    fig = _new_figure(8, 5)
    ax_loss, ax_gn = fig.subplots(2, 1, sharex=True)
    _plot_series(ax_loss, steps, hist.loss or [], "loss", BLUE, trigger_step)
    _plot_series(ax_gn, steps, hist.grad_norm or [], "grad norm", ORANGE, trigger_step)
    ax_gn.set_xlabel("step")
    ax_loss.set_title("Training history up to the failing step")
    return _png(fig)


def _bar_values(values: list[Any]) -> tuple[list[float], list[bool]]:
    """Bar lengths for a log axis: non-finite drawn as the largest finite value × 10."""
    xs = [as_float(v) for v in values]
    finite = [x for x in xs if x is not None and math.isfinite(x) and x > 0]
    cap = max(finite) * 10 if finite else 1.0
    lengths, flags = [], []
    for x in xs:
        if x is None:
            lengths.append(0.0)
            flags.append(False)
        elif not math.isfinite(x):
            lengths.append(cap)
            flags.append(True)
        else:
            lengths.append(abs(x))
            flags.append(False)
    return lengths, flags


def plot_per_layer(report: Mapping | Report) -> bytes | None:
    """Horizontal bars: grad norm and output abs-max of the top layers by grad norm (log x).

    The culprit module's label is red; non-finite values are red bars labelled nan/inf.
    Returns PNG bytes, or None when the report has no per-layer data or none of it is finite.
    """
    r = parse_report(report)
    rows = top_rows(r.per_layer, lambda row: row.grad_norm, TOP_LAYERS)
    if not rows:
        return None
    values = [as_float(v) for row in rows for v in (row.grad_norm, row.output_absmax)]
    if not any(x is not None and math.isfinite(x) for x in values):
        return None  # every bar would be the same "non-finite" stub: the table says it better
    culprit_module = r.culprit.module
    rows = rows[::-1]  # largest at the top
    fig = _new_figure(9, max(2.5, 0.32 * len(rows) + 1.2))
    ax = fig.subplots()
    h = 0.4
    ypos = list(range(len(rows)))
    drew_log = False
    bars: tuple[tuple[float, Callable[[LayerRow], Any], str, str], ...] = (
        (h / 2, lambda row: row.grad_norm, ORANGE, "grad norm"),
        (-h / 2, lambda row: row.output_absmax, BLUE, "output abs-max"),
    )
    for offset, value, color, name in bars:
        lengths, bad = _bar_values([value(row) for row in rows])
        if not any(lengths):
            continue
        colors = [RED if b else color for b in bad]
        ax.barh([y + offset for y in ypos], lengths, height=h, color=colors, label=name)
        for y, length, b, row in zip(ypos, lengths, bad, rows):
            if b:
                ax.text(
                    length, y + offset, " " + _nonfinite_word(as_float(value(row))), va="center", fontsize=7, color=RED
                )
        drew_log = drew_log or all(v > 0 for v in lengths)
    if drew_log:
        _log_axis(ax.xaxis, ax.set_xscale)
    ax.set_yticks(ypos)
    labels = ax.set_yticklabels([_label(row.module) for row in rows], fontsize=7)
    for lab, row in zip(labels, rows):
        if culprit_module is not None and row.module == culprit_module:
            lab.set_color(RED)
            lab.set_fontweight("bold")
    ax.set_title("Per-layer gradient norm and output abs-max (red: non-finite / culprit)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def plot_per_sample(report: Mapping | Report) -> bytes | None:
    """Bars: replayed loss of each sample; culprit samples red, non-finite samples (loss or gradients, as the
    per-sample table counts them) hatched and labelled.

    Returns PNG bytes, or None when the report has no per-sample data.
    """
    fig = per_sample_figure(report)
    return _png(fig) if fig is not None else None


def per_sample_figure(report: Mapping | Report) -> Any:
    """plot_per_sample's matplotlib figure (None without per-sample data)."""
    r = parse_report(report)
    rows = r.per_sample
    if not rows:
        return None
    if len(rows) > MAX_SAMPLES:
        rows = top_rows(rows, lambda row: row.loss, MAX_SAMPLES)
    culprits = r.culprit.ids()
    xs = [as_float(row.loss) for row in rows]
    finite = [x for x in xs if x is not None and math.isfinite(x)]
    use_log = bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 100
    cap = (max(finite) * (10 if use_log else 1.15)) if finite and max(finite) > 0 else 1.0
    fig = _new_figure(max(6, 0.28 * len(rows) + 2), 4)
    ax = fig.subplots()
    for i, (row, x) in enumerate(zip(rows, xs)):
        is_culprit = row.sample_id in culprits
        color = RED if is_culprit else BLUE
        bad = row_nonfinite(row)
        if x is None and not bad:
            continue
        if x is not None and math.isfinite(x) and not bad:
            ax.bar(i, x, color=color)
        elif x is not None and math.isfinite(x):  # a finite loss with non-finite gradients: non-finite all the same
            ax.bar(i, x, color=color, alpha=0.45, hatch="//", edgecolor=RED)
            ax.text(
                i,
                x,
                "grad " + _nonfinite_word(as_float(row.grad_norm)),
                ha="center",
                va="bottom",
                fontsize=7,
                color=RED,
            )
        else:
            ax.bar(i, cap, color=color, alpha=0.45, hatch="//", edgecolor=RED)
            ax.text(i, cap, _nonfinite_word(x), ha="center", va="bottom", fontsize=8, color=RED)
    if use_log:
        _log_axis(ax.yaxis, ax.set_yscale)
    ax.set_xticks(range(len(rows)))
    labels = ax.set_xticklabels([_label(row.sample_id) for row in rows], rotation=60, ha="right", fontsize=7)
    for lab, row in zip(labels, rows):
        if row.sample_id in culprits:
            lab.set_color(RED)
            lab.set_fontweight("bold")
    ax.set_ylabel("loss" + (" (log)" if use_log else ""))
    ax.set_title("Per-sample loss (red: culprit; hatched: non-finite)")
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def plot_precursors(report: Mapping | Report) -> bytes | None:
    """A precursor report: the leading statistics over the recorded window, each divided by its baseline (log y),
    the step each started to grow marked with a dot, the dumped step with a line. None without series."""
    r = parse_report(report)
    block = r.precursor
    steps, series = (block.steps if block else None) or [], block.series if block else []
    if not steps or not series:
        return None
    fig = _new_figure(9, 4.5)
    ax = fig.subplots()
    colors = (RED, ORANGE, BLUE, GREY, "#8e44ad", "#27ae60")
    for i, row in enumerate(series):
        baseline = as_float(row.baseline)
        if not baseline or not math.isfinite(baseline) or baseline <= 0:
            continue
        values = [(s, as_float(v)) for s, v in zip(steps, row.values or [])]
        points = [(s, v / baseline) for s, v in values if v is not None and math.isfinite(v) and v > 0]
        if not points:
            continue
        color = colors[i % len(colors)]
        label = f"{i + 1}. {_label(row.layer)} {_label(row.statistic)}"
        ax.plot([p[0] for p in points], [p[1] for p in points], color=color, lw=2.2 if i == 0 else 1.2, label=label)
        start = next((p for p in points if p[0] == row.started), None)
        if start is not None:
            ax.plot([start[0]], [start[1]], "o", color=color)
    _log_axis(ax.yaxis, ax.set_yscale)
    step = r.dump.step
    if isinstance(step, int):
        ax.axvline(step, color=RED, ls="--", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("value / baseline (log)")
    ax.set_title("Per-layer statistics that grew, in the order they started (dot: start; dashed: dumped step)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    return _png(fig)


PLOTS: dict[str, tuple[str, Callable[[Mapping | Report], bytes | None]]] = {
    "precursor": ("Per-layer statistics over the window, the first to grow marked", plot_precursors),
    "history": ("Loss and grad-norm history, trigger step marked", plot_history),
    "per_layer": ("Per-layer grad norm and output abs-max", plot_per_layer),
    "per_sample": ("Per-sample loss, culprit highlighted", plot_per_sample),
}


def render_plots(report: Mapping | Report) -> dict[str, bytes]:
    """Every plot the report has data for, as {name: PNG bytes} (names: history, per_layer, per_sample).

    Returns {} if matplotlib is not installed. A plot that fails is logged and left out, so a
    strange value in the report never costs the whole report.
    """
    if not matplotlib_available():
        log.info("matplotlib is not installed; report.html will have no plots")
        return {}
    out = {}
    report = parse_report(report)
    for name, (_, make) in PLOTS.items():
        try:
            png = make(report)
        except Exception:
            log.warning("could not draw the %s plot; leaving it out", name, exc_info=True)
            continue
        if png:
            out[name] = png
    return out
