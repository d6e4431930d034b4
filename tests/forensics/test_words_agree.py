"""Words agree with the numbers (issue 50, items 4 and 6): each sentence below sat beside a table or a model that
said otherwise — "down to single samples" beside "1 of 8 samples non-finite", "raise the eps (1e-5 rather than
1e-8)" for a model whose eps is 1e-5, "Filter 46, 48, 3" with 27 in the blocklist too, "highest loss: 1 loss nan",
"data, not precision" for samples the verdict names as triggers, a module called `<root>`, a plot that hatched no
sample while the table counted 4 non-finite."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from forensics.core.kinds import VerdictKind
from forensics.report.model import to_json_safe
from forensics.report.render_text import (
    culprit_sentence,
    location_sentence,
    per_sample_sentence,
    precision_sentence,
    row_nonfinite,
)
from forensics.replay.judge.verdict import VerdictFacts, decide_verdict
from forensics.replay.judge.verdict_words import op_hints

sys.path.insert(0, str(Path(__file__).parent))
from report_factory import make_report

NAN = math.nan


def _with_rows(report: dict, losses: list, grad_norms: list | None = None) -> dict:
    report["per_sample"] = [
        {
            "sample_id": i,
            "micro_batch": 0,
            "index": i,
            "loss": loss,
            "grad_norm": (grad_norms or [1.0] * len(losses))[i],
            "finite": math.isfinite(loss) and math.isfinite((grad_norms or [1.0] * len(losses))[i]),
        }
        for i, loss in enumerate(losses)
    ]
    return report


def test_every_subset_failing_is_not_called_single_samples_beside_a_table_that_says_one_of_eight():
    report = _with_rows(to_json_safe(make_report("model_state")), [NAN] + [4.0 + i for i in range(7)])
    report["culprit"]["samples"] = []
    report["bisection"] = {"runs": 4, "candidates": 8, "culprit_size": 0, "test": "isolation", "all_subsets_fail": True}
    sentence = culprit_sentence(report)
    assert "down to single samples" not in sentence and "only 1 of 8 samples is non-finite" in sentence, sentence


def test_the_model_state_reading_counts_what_the_table_counts():
    facts = VerdictFacts(
        "nonfinite_loss",
        True,
        step=7,
        candidates=8,
        bisect_runs=4,
        all_subsets_fail=True,
        samples_failing=[3],
        samples_checked=8,
    )
    explanation = decide_verdict(facts).explanation
    assert "down to single samples" not in explanation and "only 1 of 8 samples is non-finite" in explanation


def test_the_highest_loss_is_a_number_not_a_nan():
    report = _with_rows(to_json_safe(make_report("model_state")), [NAN, 3.7e14, NAN, 1.7e14])
    sentence = per_sample_sentence(report)
    assert "loss nan" not in sentence and "highest finite loss: 1 loss 3.7e+14 (next highest 1.7e+14)" in sentence


def test_fp32_does_not_say_data_for_samples_named_as_triggers():
    report = to_json_safe(make_report("model_state", culprits=["shard-0192/rec-55413"]))
    report["culprit"]["samples"][0]["trigger"] = True
    report["evidence"] = {"bad_data": False, "against": [], "ordinary": None, "earlier_state": None}
    report["precision"]["autocast_dtype"], report["precision"]["fp32_reproduces"] = "bfloat16", True
    sentence = precision_sentence(report)
    assert "data, not precision" not in sentence and "not precision" in sentence, sentence


def test_the_root_module_is_named_in_words():
    report = to_json_safe(make_report("model_state"))
    report["culprit"]["module"], report["culprit"]["op"] = "<root>", "aten::nll_loss_forward"
    sentence = location_sentence(report)
    assert "<root>" not in sentence and "the model's own forward" in sentence, sentence
    facts = VerdictFacts("nonfinite_loss", True, step=3, phase="forward", module="<root>", op="aten::nll_loss_forward")
    assert "<root>" not in decide_verdict(facts).headline


def test_the_plot_hatches_every_sample_the_table_counts_non_finite():
    from forensics.report.plots import per_sample_figure

    report = _with_rows(to_json_safe(make_report("model_state")), [4.0, 3.7e14, 4.1, 1.7e14], [1.0, NAN, 1.2, NAN])
    rows = report["per_sample"]
    counted = sum(row_nonfinite(type("Row", (), row)) for row in rows)
    ax = per_sample_figure(report).axes[0]
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert counted == 2 and len(hatched) == counted


def test_the_eps_advice_reads_the_models_eps():
    base = dict(step=5, phase="backward", module="transformer.h.1.ln_1", op="aten::native_layer_norm")
    fine = " ".join(op_hints(VerdictFacts("nonfinite_grad", True, norm_eps=1e-5, **base)))
    assert "Raise the normalisation eps" not in fine and "already 1e-05" in fine, fine
    tiny = " ".join(op_hints(VerdictFacts("nonfinite_grad", True, norm_eps=0.0, **base)))
    assert "Raise the normalisation eps from 0 to 1e-5 or 1e-6" in tiny, tiny


def test_the_eps_is_read_from_the_norm_module(helpers):
    from forensics.replay.judge.assemble import _norm_eps

    model = helpers.make_gpt2()
    assert _norm_eps(model, "transformer.h.0.ln_2") == model.config.layer_norm_epsilon == 1e-5
    assert _norm_eps(model, "transformer.h.0.mlp.c_fc") is None and _norm_eps(model, "<root>") is None


def test_filter_names_every_sample_the_blocklist_lists():
    facts = VerdictFacts(
        "nonfinite_loss",
        True,
        step=7,
        culprit_samples=[46, 48, 3, 27],
        candidates=16,
        bisect_runs=9,
        record_evidence=["every one of its labels is -100"],
    )
    verdict = decide_verdict(facts)
    assert verdict.kind == VerdictKind.BAD_SAMPLE
    line = next(s for s in verdict.suggestions if s.startswith("Filter"))
    assert "46, 48, 3 and 1 more" in line and "blocklist.jsonl lists all 4" in line, line
