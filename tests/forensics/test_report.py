"""Tests of the report model, the text / Markdown / HTML renderers and the writers (forensics.report)."""

from __future__ import annotations

import base64
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from forensics.core.errors import ForensicsError
from forensics.report import (
    VERDICT_KINDS,
    ReportError,
    load_report,
    render_html,
    render_markdown,
    render_verdict_text,
    to_json_safe,
    validate_report,
    write_blocklist,
    write_report_files,
)

sys.path.insert(0, str(Path(__file__).parent))
from report_factory import GPT2_MODULES, make_report

from forensics.report.write import report_json_text

XSS = "<script>alert(1)</script>"


def _md_table(md: str, heading_prefix: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table under the heading starting with heading_prefix."""
    section = md.split("## " + heading_prefix, 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in lines[2:]]


def _assert_self_contained(html: str) -> None:
    low = html.lower()
    assert low.count("<html") == 1 and low.rstrip().endswith("</html>")
    assert "<script" not in low
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", low)
    assert "http://" not in low and "https://" not in low
    assert "@import" not in low and "url(" not in low
    assert "<link" not in low


# ---- one test per verdict kind: what the user reads first ----


def test_bad_sample_text_names_sample_module_op_and_evidence():
    report = make_report("bad_sample")
    text = render_verdict_text(
        report,
        files={
            "md": "out/report.md",
            "html": "out/report.html",
            "json": "out/report.json",
            "blocklist": "out/blocklist.jsonl",
        },
    )
    assert text.startswith("Verdict: bad sample — ")
    assert "'shard-0192/rec-55415'" in text
    assert "transformer.h.1.mlp.c_fc" in text and "aten::addmm" in text and "forward pass" in text
    assert "Step 41217, rank 3 of 8, micro-batch 2 of 2." in text
    assert "found in 5 replays of 8 samples (budget 10)" in text
    assert "input abs-max 3.1e+38" in text
    assert "still non-finite in fp32 → data, not precision" in text
    assert "Loss history: sudden jump" in text
    assert "  - Filter this sample (blocklist written)." in text
    assert "Report: out/report.md (also report.html, report.json)" in text
    assert "Blocklist of culprit samples: out/blocklist.jsonl" in text


def test_numerical_precision_text_says_finite_in_fp32():
    text = render_verdict_text(make_report("numerical_precision"))
    assert text.startswith("Verdict: numerical precision — ")
    assert "transformer.h.0.attn.c_attn" in text and "aten::baddbmm" in text
    assert "autocast float16; in fp32 the step is finite → precision." in text


def test_optimizer_update_text_names_parameter_and_state():
    text = render_verdict_text(make_report("optimizer_update"))
    assert "The optimizer update broke parameter lm_head.weight (exp_avg_sq == 0 with eps == 0)" in text
    assert "aten::_foreach_div" in text


def test_not_reproduced_text_shows_losses_and_warnings_and_md_says_not_run():
    report = make_report("not_reproduced")
    text = render_verdict_text(report)
    assert "NOT reproduced on cpu after 3 attempts: recorded losses [3.51, nan], replayed [3.51, 3.49]" in text
    assert "Warning: replayed on cpu, captured on NVIDIA H100 80GB HBM3" in text
    assert "fp32" not in text  # nothing failed, so no fp32 triage to report
    md = render_markdown(report)
    bisection = md.split("## Bisection", 1)[1].split("\n## ", 1)[0]
    assert "Not run." in bisection
    html = render_html(report)
    _assert_self_contained(html)
    assert html.count("data:image/png;base64,") == 1  # history only: no per-sample / per-layer data


def test_spike_text_and_tables_point_at_highest_loss_sample():
    report = make_report("spike_no_single_cause")
    text = render_verdict_text(report)
    assert "Verdict: spike, no single cause" in text
    assert "highest loss: 'shard-0192/rec-55412' loss 9.5e+04 (next highest 5e+04)" in text
    assert "Reproduced bitwise on cpu" in text
    rows = _md_table(render_markdown(report), "Per-sample losses")
    assert rows[0][1] == "`shard-0192/rec-55412`" and rows[0][4] == "9.5e+04"
    assert rows[1][1] == "`shard-0192/rec-55413`"


@pytest.mark.parametrize("kind", VERDICT_KINDS)
def test_every_kind_validates_and_renders(kind, tmp_path):
    report = make_report(kind)
    files = write_report_files(report, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.json", "report.md"]
    loaded = load_report(files["json"])
    assert loaded["verdict"]["kind"] == kind
    text = render_verdict_text(loaded)
    assert report["verdict"]["headline"] in text
    md = files["md"].read_text(encoding="utf-8")
    for heading in (
        "## Verdict",
        "## Where it happened",
        "## Reproduction",
        "## Culprit",
        "## Precision triage",
        "## Bisection",
        "## Per-sample",
        "## Per-layer",
        "## Loss history",
        "## Environment",
        "## Timings",
    ):
        assert heading in md
    _assert_self_contained(files["html"].read_text(encoding="utf-8"))


# ---- Markdown tables ----


def test_markdown_tables_hold_top_20_with_culprit_first():
    ids = [f"doc-{i}" for i in range(50)]
    report = make_report("bad_sample", sample_ids=ids, culprits=["doc-37"])
    report["per_layer"] = [
        {"module": f"blocks.{i}.mlp", "grad_norm": float(i), "output_absmax": 1.0} for i in range(30)
    ] + [{"module": "blocks.7.attn", "grad_norm": math.inf, "output_absmax": math.nan}]
    report["culprit"]["module"] = "blocks.7.attn"
    md = render_markdown(report)
    samples = _md_table(md, "Per-sample losses")
    assert "## Per-sample losses (top 20 of 50 by loss)" in md
    assert len(samples) == 20
    assert samples[0][1] == "`doc-37`" and samples[0][4] == "nan" and samples[0][7] == "**culprit**"
    losses = [float(r[4]) for r in samples[1:]]
    assert losses == sorted(losses, reverse=True)
    layers = _md_table(md, "Per-layer gradients")
    assert "## Per-layer gradients (top 20 of 31 by grad norm)" in md
    assert len(layers) == 20
    assert layers[0][1] == "`blocks.7.attn`" and layers[0][2] == "inf" and layers[0][4] == "**culprit module**"
    assert [r[1] for r in layers[1:3]] == ["`blocks.29.mlp`", "`blocks.28.mlp`"]
    # environment warnings and timings are in the full report
    assert "- replayed on cpu, captured on NVIDIA H100 80GB HBM3: kernels differ" in md
    assert "Replay took 12.5 s (9 forward/backward passes)." in md


def test_markdown_escapes_untrusted_text():
    markdown_it = pytest.importorskip("markdown_it")
    evil = "x|y *bold* [link](javascript:alert(1)) " + XSS
    report = make_report("bad_sample", sample_ids=[evil, "ok"], culprits=[evil])
    report["verdict"]["headline"] = f"# Sample {evil} is bad"
    report["culprit"]["samples"][0]["description"] = "<img src=x onerror=alert(1)> | ` ``"
    md = render_markdown(report)
    rows = _md_table(md, "Per-sample losses")
    assert len(rows[0]) == 8  # the | inside the id did not split the table row
    # Rendered by a CommonMark renderer that passes raw HTML through: no tag, link or emphasis leaks.
    html = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(md)
    assert "<script" not in html and "<img" not in html and "<a " not in html and "<em>bold" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count("<h1>") == 1  # the headline's "#" did not make a heading
    assert "<td><code>x|y *bold* [link](javascript:alert(1)) &lt;script&gt;" in html


def test_markdown_traceback_is_a_code_block():
    report = make_report("bad_sample")
    report["culprit"]["traceback"] = '  File "model.py", line 12, in forward\n    x = torch.log(x)\n```'
    md = render_markdown(report)
    assert '````text\n  File "model.py", line 12, in forward\n    x = torch.log(x)\n```\n````' in md


# ---- HTML ----


def test_html_is_one_self_contained_file_with_plots(tmp_path):
    files = write_report_files(make_report("bad_sample"), tmp_path)
    html = files["html"].read_text(encoding="utf-8")
    _assert_self_contained(html)
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 3  # history, per-layer, per-sample
    for data in images:
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")
    assert "Content-Security-Policy" in html
    assert "transformer.h.1.mlp.c_fc" in html and "shard-0192/rec-55415" in html


def test_html_escapes_sample_ids_and_every_other_string():
    report = make_report("bad_sample", sample_ids=[XSS, "a&b", 'q"uote'], culprits=[XSS])
    report["culprit"]["module"] = "<img src=x onerror=alert(1)>"
    report["verdict"]["headline"] = f"Sample {XSS} is bad"
    report["environment"]["warnings"] = ["<b>bold</b>"]
    html = render_html(report)
    _assert_self_contained(html)
    assert XSS not in html and "<img src=x" not in html and "<b>bold</b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "a&amp;b" in html


def test_html_without_matplotlib_says_so(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    html = render_html(make_report("bad_sample"))
    _assert_self_contained(html)
    assert "data:image/png" not in html
    assert "matplotlib is not installed" in html
    assert "shard-0192/rec-55415" in html  # the rest of the report is still there


# ---- report.json ----


def test_json_round_trips_with_nonfinite_as_strings(tmp_path):
    report = make_report("bad_sample")
    files = write_report_files(report, tmp_path)
    raw = files["json"].read_text(encoding="utf-8")
    assert "NaN" not in raw and "Infinity" not in raw
    data = json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert list(data)[:9] == [
        "schema",
        "created_at",
        "dump",
        "trigger",
        "environment",
        "reproduced",
        "fidelity",
        "verdict",
        "culprit",
    ]
    assert data["trigger"]["value"] == "nan"
    assert data["culprit"]["stats"]["outputs_absmax"] == "inf"
    assert data["history"]["grad_norm"][-1] == "inf"
    assert data == to_json_safe(report)
    assert load_report(tmp_path) == data  # a directory holding report.json works too
    assert raw.startswith('{\n  "schema": "forensics-report/1"')


def test_to_json_safe_converts_torch_numpy_and_unknown_values():
    class Opaque:
        def __repr__(self):
            return "Opaque()"

    loop: list = []
    loop.append(loop)
    value = {
        "t_nan": torch.tensor(float("nan")),
        "t_int": torch.tensor(7),
        "t_bool": torch.tensor(True),
        "t_bf16": torch.tensor(-float("inf"), dtype=torch.bfloat16),
        "t_big": torch.zeros(3),
        "np_inf": np.float32("inf"),
        "np_int": np.int64(5),
        "np_arr1": np.array([2.5]),
        "tuple": (1, 2.0, (math.nan,)),
        "path": Path("/tmp/x"),
        3: "int key",
        "obj": Opaque(),
        "loop": loop,
    }
    safe = to_json_safe(value)
    json.dumps(safe, allow_nan=False)
    assert safe["t_nan"] == "nan" and safe["t_int"] == 7 and safe["t_bool"] is True
    assert safe["t_bf16"] == "-inf" and safe["t_big"].startswith("tensor(")
    assert safe["np_inf"] == "inf" and safe["np_int"] == 5 and safe["np_arr1"] == 2.5
    assert safe["tuple"] == [1, 2.0, ["nan"]]
    assert safe["path"] == "/tmp/x" and safe["3"] == "int key" and safe["obj"] == "Opaque()"
    assert safe["loop"] == ["<cycle: list>"]


def test_report_from_a_real_gpt2_backward_renders(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    )
    names = {n for n, _ in model.named_modules()}
    assert set(GPT2_MODULES) <= names  # the factory's module names are the real ones
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    per_layer = []
    for name in GPT2_MODULES:
        grads = [p.grad.flatten() for p in model.get_submodule(name).parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.cat(grads)) if grads else None
        per_layer.append({"module": name, "grad_norm": norm, "output_absmax": torch.tensor(1.0)})
    per_layer[4]["grad_norm"] = torch.tensor(float("nan"))  # transformer.h.0.attn.c_proj
    report = make_report("bad_sample", per_layer=per_layer)
    report["culprit"]["module"] = "transformer.h.0.attn.c_proj"
    files = write_report_files(report, tmp_path, plots=False)
    data = load_report(files["json"])
    assert data["per_layer"][4]["grad_norm"] == "nan"
    assert isinstance(data["per_layer"][0]["grad_norm"], float)
    layers = _md_table(files["md"].read_text(encoding="utf-8"), "Per-layer gradients")
    assert layers[0][1] == "`transformer.h.0.attn.c_proj`" and layers[0][2] == "nan"


# ---- validation and loading ----


def test_a_schema_1_report_cannot_carry_a_verdict_kind_added_in_schema_2():
    report = to_json_safe(make_report("exception"))
    report["schema"] = "forensics-report/1"
    with pytest.raises(ReportError, match="unknown verdict.kind 'exception'"):
        validate_report(report)
    report["schema"] = "forensics-report/2"
    validate_report(report)


def test_validate_rejects_newer_schema_naming_both_versions():
    report = to_json_safe(make_report("bad_sample"))
    report["schema"] = "forensics-report/6"
    with pytest.raises(ReportError, match=r"forensics-report/6.*forensics-report/5.*upgrade"):
        validate_report(report)
    assert issubclass(ReportError, ForensicsError)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.update(schema="forensics-dump"), "not a forensics report"),
        (lambda r: r.pop("schema"), "no 'schema' key"),
        (lambda r: r.pop("verdict"), "missing 'verdict'"),
        (lambda r: r["dump"].pop("step"), "missing 'dump.step'"),
        (lambda r: r["dump"].update(rank=True), "'dump.rank' must be int"),
        (lambda r: r["verdict"].update(kind="gremlins"), "unknown verdict.kind 'gremlins'"),
        (lambda r: r["culprit"].update(samples=[{"index": 1}]), r"culprit.samples\[0\]"),
        (lambda r: r.update(per_sample={"a": 1}), "'per_sample' must be list or null"),
        (lambda r: r.update(reproduced="yes"), "'reproduced' must be bool"),
    ],
)
def test_validate_names_the_bad_field_and_nothing_is_written(mutate, message, tmp_path):
    report = make_report("bad_sample")
    mutate(report)
    with pytest.raises(ReportError, match=message):
        validate_report(to_json_safe(report))
    with pytest.raises(ReportError):
        write_report_files(report, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_validate_accepts_missing_optional_sections_and_unknown_keys(tmp_path):
    report = to_json_safe(make_report("model_state"))
    for key in ("precision", "bisection", "per_sample", "per_layer", "history", "history_pattern", "timings"):
        report.pop(key)
    report["added_by_a_newer_writer"] = {"x": 1}
    assert validate_report(report) is report
    files = write_report_files(report, tmp_path)
    md = files["md"].read_text(encoding="utf-8")
    assert "## Bisection\n\nNot run." in md
    assert list(json.loads(files["json"].read_text()))[-1] == "added_by_a_newer_writer"
    render_verdict_text(report)
    _assert_self_contained(files["html"].read_text(encoding="utf-8"))


def test_load_report_errors_say_what_to_do(tmp_path):
    with pytest.raises(ReportError, match="no report at .*forensics replay"):
        load_report(tmp_path / "nope.json")
    files = write_report_files(make_report("bad_sample"), tmp_path, plots=False)
    raw = files["json"].read_bytes()
    files["json"].write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ReportError, match="not valid JSON.*truncated"):
        load_report(files["json"])


def test_writes_leave_no_temporary_files_and_overwrite(tmp_path):
    write_report_files(make_report("not_reproduced"), tmp_path, plots=False)
    write_report_files(make_report("bad_sample"), tmp_path, plots=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.json", "report.md"]
    assert load_report(tmp_path)["verdict"]["kind"] == "bad_sample"


# ---- blocklist ----


def test_blocklist_lines_are_json_values_equal_to_culprit_ids(tmp_path):
    culprits = ["shard-1/rec-2", 17, ["shard", 3], "line\nbreak \u2028 sep", XSS, "shard-1/rec-2"]
    ids = culprits[:5] + ["fine"]
    report = make_report("bad_sample", sample_ids=ids, culprits=culprits)
    path = write_blocklist(report, tmp_path / "blocklist.jsonl")
    lines = path.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == 6  # 5 distinct ids, newline-terminated
    assert [json.loads(ln) for ln in lines[:-1]] == culprits[:5]
    report2 = make_report("bad_sample", sample_ids=["new", 17], culprits=["new", 17])
    write_blocklist(report2, path, append=True)
    assert [json.loads(ln) for ln in path.read_text().splitlines()] == culprits[:5] + ["new"]


def test_blocklist_without_culprits_is_empty(tmp_path):
    path = write_blocklist(make_report("spike_no_single_cause"), tmp_path / "b.jsonl")
    assert path.read_text() == ""


# ---- terminal safety ----


def test_text_escapes_control_characters_and_cuts_long_ids():
    evil = "rec-1\x1b[2J\x1b[31mred\r\n\u202eevil"
    long_id = "x" * 5000
    report = make_report("bad_sample", sample_ids=[evil, long_id], culprits=[evil, long_id])
    text = render_verdict_text(report)
    assert "\x1b" not in text and "\r" not in text and "\u202e" not in text
    assert "rec-1\\x1b[2J" in text
    assert max(len(line) for line in text.splitlines()) < 600
    assert "Culprit: 2 samples together" in text


# ---- micro-batches: 0-based in JSON, counted from 1 in everything a person reads ----


def test_prose_counts_micro_batches_from_one_and_json_keeps_the_index():
    report = make_report("bad_sample")  # trigger.micro_batch == 1 of 2, detail "loss of micro-batch 1 is nan"
    assert report["trigger"]["micro_batch"] == 1
    text = render_verdict_text(report)
    assert "micro-batch 2 of 2." in text and "loss of micro-batch 2 is nan" in text
    assert "micro-batch 1 of 2" not in text and "micro-batch 1 is" not in text
    md = render_markdown(report)
    assert "micro-batch 2 of 2" in md and "loss of micro-batch 2 is nan" in md
    assert "index (0-based)" in md
    assert json.loads(report_json_text(report))["trigger"]["micro_batch"] == 1


def test_trigger_detail_already_one_based_is_left_alone():
    from forensics.report.render_text import mb_phrase
    from forensics.core.trigger import trigger_detail

    assert (
        trigger_detail({"micro_batch": 0, "detail": "loss of micro-batch 0 is nan"}) == "loss of micro-batch 1 is nan"
    )
    assert (
        trigger_detail({"micro_batch": 0, "detail": "loss of micro-batch 1 is nan"}) == "loss of micro-batch 1 is nan"
    )
    assert mb_phrase(1, 2) == "micro-batch 2 of 2" and mb_phrase(0) == "micro-batch 1"


def test_inspect_summary_counts_micro_batches_from_one():
    from forensics.commands.summary import render_summary

    summary = {
        "path": "d",
        "run_id": "r",
        "step": 7,
        "rank": 0,
        "world_size": 1,
        "missing_ranks": [],
        "trigger": {
            "kind": "nonfinite_loss",
            "value": math.inf,
            "threshold": None,
            "micro_batch": 1,
            "detail": "loss of micro-batch 1 is inf",
        },
        "micro_batches": [
            {"index": 0, "sample_ids": ["a"], "loss": 1.5, "unreplayable": []},
            {"index": 1, "sample_ids": ["b"], "loss": math.inf, "unreplayable": []},
        ],
        "precision": {},
        "recipe": {},
        "recheck": None,
        "total_bytes": 10,
        "files": {},
        "environment": {},
        "history_tail": {"step": [], "loss": [], "grad_norm": [], "lr": []},
        "format_version": 1,
        "created_at": "now",
    }
    text = render_summary(summary)
    assert "micro-batch 2 of 2" in text and "loss of micro-batch 2 is inf" in text
    assert "micro-batch 1 of 2: loss 1.5" in text and "micro-batch 2 of 2: loss inf" in text
    assert "[0]" not in text and "[1]" not in text


def test_rng_block_is_optional_and_rendered():
    report = make_report("model_state")
    validate_report(report)
    report["rng"] = {"checked": True, "seeds": [1234], "failed": [False], "rng_dependent": True}
    validate_report(report)
    assert "Random state: the failure needs the dump's RNG" in render_verdict_text(report)
    assert (
        list(json.loads(report_json_text(report))).index("rng")
        == list(json.loads(report_json_text(report))).index("fidelity") + 1
    )


def test_names_in_backticks_render_as_code_not_as_escaped_backticks():
    report = make_report("bad_sample")
    report["verdict"]["headline"] = "The first NaN appears at `model.embed_tokens.weight` in the forward pass."
    report["verdict"]["suggestions"] = ["Look at `transformer.h.0.ln_1` first."]
    markdown = render_markdown(report)
    assert "`model.embed_tokens.weight`" in markdown and "\\`" not in markdown and "embed\\_tokens" not in markdown
    assert "`transformer.h.0.ln_1`" in markdown
    assert "<code>model.embed_tokens.weight</code>" in render_html(report, plots=False)


def test_no_per_layer_plot_when_every_value_is_non_finite():
    from forensics.report.plots import plot_per_layer

    report = make_report("model_state")
    report["per_layer"] = [{"module": f"layer{i}", "grad_norm": "nan", "output_absmax": "nan"} for i in range(5)]
    assert plot_per_layer(report) is None
    report["per_layer"][2]["grad_norm"] = 3.0
    assert plot_per_layer(report) is not None


@pytest.mark.parametrize(
    "phase, words",
    [
        ("forward", "Non-finite parameter feeding it: transformer.h.0.mlp.c_fc.weight."),
        ("backward", "First parameter with a non-finite gradient: transformer.h.0.mlp.c_fc.weight."),
    ],
)
def test_the_parameter_is_described_by_the_phase_that_named_it(phase, words):
    from forensics.report.render_text import location_sentence

    report = {
        "trigger": {"kind": "nonfinite_loss"},
        "culprit": {
            "module": "transformer.h.0.mlp.c_fc",
            "op": "aten::addmm",
            "phase": phase,
            "parameter": "transformer.h.0.mlp.c_fc.weight",
            "stats": {},
        },
    }
    text = location_sentence(report)
    assert words in text and text.count("parameter") == 1


def test_a_window_replay_is_a_step_by_step_table_in_markdown_and_html():
    """The window replay's steps are in report.md and report.html, not only in report.json."""
    report = make_report("bad_sample")
    report["window"] = {
        "checkpoint": "the dump's host snapshot",
        "from_step": 4,
        "dumped_step": 7,
        "broke_at": 6,
        "why": "its update made transformer.wte.weight non-finite",
        "steps_before_crash": 1,
        "steps": [
            {
                "step": s,
                "recorded_loss": 2.0 + s,
                "replayed_loss": 2.0 + s,
                "recorded_grad_norm": 1.0,
                "replayed_grad_norm": 1.0,
                "weights_finite": s < 6,
                "relative_change": 0.01,
                "broke": "its update made transformer.wte.weight non-finite" if s == 6 else None,
            }
            for s in (4, 5, 6)
        ],
    }
    rows = _md_table(render_markdown(report), "Window replay")
    assert [r[0] for r in rows] == ["4", "5", "6"] and rows[2][5] == "no" and "non-finite" in rows[2][7]
    assert "Window replay" in render_html(report) and "step 6 broke the run" in render_markdown(report)


@pytest.mark.parametrize("trigger", ["exception", "precursor"])
def test_no_failing_value_no_outlier_words(trigger):
    """'the failing step is an outlier' only where a value failed: a step that raised, or a precursor of a healthy
    step, has none (issue 31)."""
    report = make_report(
        "exception" if trigger == "exception" else "instability_ahead",
        history_pattern="stable",
        trigger={"kind": trigger, "value": None, "micro_batch": None, "detail": "raised"},
    )
    text = render_verdict_text(report)
    assert "stable until the failure" in text and "outlier" not in text
    assert "outlier" in render_verdict_text(make_report("bad_sample", history_pattern="stable"))


def test_a_bisection_where_every_subset_fails_is_not_called_one_that_found_none():
    """The terminal summary must not say 'found no subset that fails on its own' beside '12 of 16 samples
    non-finite' when every subset tried failed (issue 41, no contradictions in one report)."""
    from forensics.report.render_text import culprit_sentence

    report = to_json_safe(make_report("model_state"))
    report["culprit"]["samples"] = []
    report["per_sample"] = []  # no per-sample table: nothing says otherwise
    report["bisection"] = {
        "runs": 5,
        "candidates": 16,
        "culprit_size": 0,
        "budget": 12,
        "test": "isolation",
        "all_subsets_fail": True,
    }
    sentence = culprit_sentence(report)
    assert "fails on its own, down to single samples" in sentence and "found no subset" not in sentence
