"""Tests for replay/judge/verdict.py: each verdict kind from facts, rule order, and the words users read."""

import math

import pytest

from forensics.report import VERDICT_KINDS
from forensics.report.tree import Verdict
from forensics.replay.judge.verdict import VerdictFacts, decide_verdict
from forensics.replay.judge.verdict_facts import diverged_here

NAN = float("nan")


EVIDENCE = ["its loss replayed alone is 9.7, against 4.1-4.2 for the other 31 samples"]


def facts(**kw):
    """Facts of a reproduced step; culprits come with evidence against their record unless the test says otherwise
    (the bad-data wording); test_trigger_* below give none."""
    base = dict(
        trigger_kind="nonfinite_loss",
        reproduced=True,
        step=41217,
        rank=3,
        micro_batch=1,
        num_micro_batches=4,
        trigger_value=NAN,
        bitwise=True,
        replay_device="cuda:0",
        candidates=32,
        bisect_runs=6,
    )
    if kw.get("culprit_samples"):
        base["record_evidence"] = EVIDENCE
    base.update(kw)
    return VerdictFacts(**base)


def check_shape(v):
    assert isinstance(v, Verdict)
    assert set(v.as_dict()) == {"kind", "headline", "explanation", "suggestions"}
    assert v.kind in VERDICT_KINDS
    assert v.headline.endswith(".") and "\n" not in v.headline
    assert v.explanation and all(isinstance(s, str) and s for s in v.suggestions)
    assert len(set(v.suggestions)) == len(v.suggestions)
    return v


def test_bad_sample_names_the_sample_the_layer_and_the_search():
    v = check_shape(
        decide_verdict(
            facts(
                culprit_samples=["shard-0192/rec-55411"],
                phase="forward",
                module="model.layers.17.mlp.down_proj",
                op="aten::mm",
                inputs_absmax=3.1e38,
                history_pattern="sudden_jump",
            )
        )
    )
    assert v.kind == "bad_sample"
    assert v.headline.startswith("Sample 'shard-0192/rec-55411' alone makes the loss non-finite at step 41217")
    assert "(rank 3, micro-batch 2 of 4)" in v.headline
    assert "forward pass at `model.layers.17.mlp.down_proj` (aten::mm)" in v.headline
    assert "found in 6 replays of 32 samples" in v.explanation
    assert "input abs-max 3.1e+38" in v.explanation and "Reproduced bit for bit on cuda:0" in v.explanation
    assert "sudden jump" in v.explanation
    assert "blocklist" in v.suggestions[0] and "'shard-0192/rec-55411'" in v.suggestions[0]


def test_a_pair_that_fails_only_together_is_still_bad_sample_with_its_own_advice():
    v = check_shape(decide_verdict(facts(culprit_samples=[17, 230])))
    assert v.kind == "bad_sample"
    assert v.headline.startswith("Samples 17 and 230 together, neither alone, make")
    assert any("only together" in s for s in v.suggestions)


def test_the_only_sample_of_a_batch_is_blamed_with_a_caveat():
    v = check_shape(decide_verdict(facts(culprit_samples=["only"], candidates=1, bisect_runs=0)))
    assert v.kind == "bad_sample"
    assert "could not tell it apart from the model state" in v.explanation


def test_numerical_precision_alone_and_with_data():
    v = check_shape(
        decide_verdict(
            facts(
                fp32_reproduces=False,
                autocast_dtype="float16",
                phase="forward",
                module="h.0.mlp",
                op="aten::mm",
                candidates=0,
                bisect_runs=None,
            )
        )
    )
    assert v.kind == "numerical_precision"
    assert "only in float16" in v.headline and "in fp32 it is finite" in v.headline
    assert "precision + data" not in v.headline
    assert any("bfloat16" in s and "float16" in s for s in v.suggestions)

    v = check_shape(
        decide_verdict(
            facts(
                fp32_reproduces=False,
                autocast_dtype="bfloat16",
                culprit_samples=["rec-9"],
                phase="forward",
                module="h.1.mlp",
            )
        )
    )
    assert v.kind == "numerical_precision"
    assert "only with sample 'rec-9'" in v.headline and "precision + data" in v.headline
    assert "precision + data" in v.explanation
    assert "Filter 'rec-9'" in v.suggestions[0]
    assert any(s.startswith("Keep bfloat16") for s in v.suggestions)


def test_precision_needs_low_precision_and_an_fp32_rerun():
    for fp32, dtype in [(False, None), (True, "bfloat16"), (None, "bfloat16")]:
        v = decide_verdict(facts(fp32_reproduces=fp32, autocast_dtype=dtype, culprit_samples=["a"]))
        assert v.kind == "bad_sample"
    v = decide_verdict(facts(fp32_reproduces=False, param_dtype="torch.bfloat16", culprit_samples=["a"]))
    assert v.kind == "numerical_precision"  # pure-bf16 training, no autocast


def test_optimizer_update_names_the_parameter_and_the_state_and_suggests_eps():
    v = check_shape(
        decide_verdict(
            facts(
                phase="optimizer",
                parameter="transformer.h.0.attn.c_attn.weight",
                optimizer_state="exp_avg_sq == 0 with eps == 0",
                optimizer_class="torch.optim.adamw.AdamW",
                culprit_samples=["x"],
                fp32_reproduces=False,
                autocast_dtype="float16",
            )
        )
    )
    assert v.kind == "optimizer_update"
    assert "AdamW update made `transformer.h.0.attn.c_attn.weight` non-finite" in v.headline
    assert "(exp_avg_sq == 0 with eps == 0)" in v.headline
    assert v.suggestions[0].startswith("Raise the optimizer's eps")


def test_model_state_when_weights_are_broken_or_every_sample_fails():
    v = check_shape(
        decide_verdict(
            facts(weights_nonfinite_at_start=True, parameter="lm_head.weight", phase="optimizer", culprit_samples=["a"])
        )
    )
    assert v.kind == "model_state"
    assert "already non-finite before step 41217 (rank 3), first in `lm_head.weight`" in v.headline
    assert any("last checkpoint with finite weights" in s for s in v.suggestions)

    v = check_shape(decide_verdict(facts(all_subsets_fail=True, culprit_samples=["a"])))
    assert v.kind == "model_state" and "not the data" in v.headline


def test_no_subset_smaller_than_the_batch_is_model_state_for_nan_and_no_cause_for_spikes():
    everyone = [f"s{i}" for i in range(8)]
    v = check_shape(decide_verdict(facts(culprit_samples=everyone, candidates=8, history_pattern="exponential_growth")))
    assert v.kind == "model_state" and "whole micro-batch" in v.headline
    assert "Culprit:" not in v.explanation
    assert any("lower the learning rate" in s for s in v.suggestions)

    v = check_shape(
        decide_verdict(
            facts(
                trigger_kind="loss_spike",
                trigger_value=87234.5,
                threshold=100.0,
                culprit_samples=everyone,
                candidates=8,
            )
        )
    )
    assert v.kind == "spike_no_single_cause"


def test_no_bisection_and_no_other_finding_is_model_state_without_claiming_a_whole_batch():
    v = check_shape(decide_verdict(facts(candidates=0, bisect_runs=None)))
    assert v.kind == "model_state"
    assert "whole micro-batch" not in v.headline and "no sample, precision or optimizer finding" in v.headline


def test_spike_without_culprit_reports_value_threshold_and_top_samples():
    top = [
        {"sample_id": "a", "loss": 9.1, "grad_norm": 3.0, "finite": True},
        {"sample_id": 7, "loss": 8.0, "grad_norm": 2.0, "finite": True},
    ]
    v = check_shape(
        decide_verdict(
            facts(
                trigger_kind="loss_spike",
                trigger_value=87234.5,
                threshold=100.0,
                micro_batch=None,
                per_sample_top=top,
                bisect_runs=None,
                history_pattern="exponential_growth",
            )
        )
    )
    assert v.kind == "spike_no_single_cause"
    assert v.headline == (
        "The loss spike to 87234.5 (threshold 100) at step 41217 (rank 3) is reproduced, "
        "but no single sample, layer or update explains it."
    )
    assert "'a' (loss 9.1), 7 (loss 8)" in v.explanation
    assert v.suggestions[0].startswith("The loss grew exponentially")


def test_spike_with_a_dominant_sample_is_bad_sample():
    v = decide_verdict(
        facts(trigger_kind="loss_spike", trigger_value=87234.5, threshold=100.0, culprit_samples=["rec-1"])
    )
    assert v.kind == "bad_sample" and "makes the loss spike" in v.headline


def test_not_reproduced_wins_over_everything_and_gives_the_numbers():
    v = check_shape(
        decide_verdict(
            facts(
                trigger_kind="nonfinite_grad",
                reproduced=False,
                trigger_value=math.inf,
                replayed_value=1.23,
                replay_device="cpu",
                culprit_samples=["a"],
                weights_nonfinite_at_start=True,
                environment_warnings=["captured on NVIDIA H100, replayed on CPU"],
            )
        )
    )
    assert v.kind == "not_reproduced"
    assert v.headline == (
        "The replay on cpu did not reproduce the non-finite gradient of step 41217 "
        "(rank 3, micro-batch 2 of 4): recorded inf, replayed 1.23."
    )
    assert "captured on NVIDIA H100, replayed on CPU" in v.explanation
    assert any("silent data corruption" in s and "rank 3" in s for s in v.suggestions)
    assert any("use_deterministic_algorithms" in s for s in v.suggestions)


def test_history_signals_and_oscillation_reach_the_user():
    v = decide_verdict(
        facts(
            culprit_samples=["a"],
            history_pattern="oscillating_divergence",
            history_signals=["Gradient clipping fired on 12 of 200 recorded steps (6%)."],
        )
    )
    assert "oscillating divergence" in v.explanation
    assert v.explanation.endswith("Gradient clipping fired on 12 of 200 recorded steps (6%).")
    assert any("optimizer state" in s for s in v.suggestions)


def test_op_hints_follow_the_failing_op():
    v = decide_verdict(facts(culprit_samples=["a"], phase="forward", module="loss", op="aten::log"))
    assert any("Guard the log" in s for s in v.suggestions)
    v = decide_verdict(facts(culprit_samples=["a"], phase="forward", module="model.norm", op="aten::rsqrt"))
    assert any("eps" in s for s in v.suggestions)
    v = decide_verdict(
        facts(culprit_samples=["a"], phase="backward", module="transformer.h.0.ln_1", op="aten::native_layer_norm")
    )
    assert any("eps" in s for s in v.suggestions)
    v = decide_verdict(facts(culprit_samples=["a"], phase="forward", module="loss", op="aten::div.Tensor"))
    assert any("Guard the division" in s for s in v.suggestions)
    v = decide_verdict(
        facts(
            culprit_samples=["a"],
            phase="forward",
            module="h.1.mlp.c_proj",
            op="aten::addmm",
            autocast_dtype="float16",
            fp32_reproduces=True,
        )
    )
    assert [s for s in v.suggestions if "bfloat16" in s] == [
        "A matmul output above 65504 overflows float16: bfloat16 keeps fp32's range, or scale the activations "
        "down (e.g. a norm before this layer)."
    ]
    assert not any("Guard" in s or "Raise the normalisation eps" in s for s in v.suggestions)
    v = decide_verdict(facts(culprit_samples=["a"], step=None, autocast_dtype="float16", fp32_reproduces=True))
    assert "before the failing step with the same RNG" in v.suggestions[0]
    assert any(s.startswith("The job runs in float16") for s in v.suggestions)


def test_precision_with_a_whole_batch_culprit_is_not_precision_plus_data():
    v = decide_verdict(
        facts(fp32_reproduces=False, autocast_dtype="float16", candidates=4, culprit_samples=["a", "b", "c", "d"])
    )
    assert v.kind == "numerical_precision"
    assert "precision + data" not in v.headline + v.explanation


def test_untrusted_sample_ids_are_quoted_cut_and_escaped():
    v = decide_verdict(facts(culprit_samples=["x" * 500]))
    assert "x" * 78 + "…" in v.headline and len(v.headline) < 300
    v = decide_verdict(facts(culprit_samples=["rec\x1b[31m-1\n"]))
    assert "\x1b" not in v.headline and "'rec\\x1b[31m-1\\n'" in v.headline
    v = decide_verdict(facts(culprit_samples=[{"shard": 3, "row": 9}]))
    assert 'Sample {"shard": 3, "row": 9} alone' in v.headline


def test_facts_are_validated():
    with pytest.raises(ValueError, match="phase"):
        VerdictFacts("nonfinite_loss", True, phase="sideways")
    with pytest.raises(ValueError, match="history_pattern"):
        VerdictFacts("nonfinite_loss", True, history_pattern="wobbly")
    f = VerdictFacts("grad_norm_spike", True, culprit_samples=["a", "b"], rank=5)
    assert f.spike and f.culprit_subset_size == 2 and f.culprit_rank == 5


def test_a_rank_that_only_inherited_the_fault_points_to_the_other_rank():
    verdict = decide_verdict(
        VerdictFacts(trigger_kind="nonfinite_grad", reproduced=False, trigger_local=False, step=3, rank=0)
    )
    assert verdict.kind == "not_reproduced"
    assert "another rank" in verdict.headline and "Rank 0" in verdict.headline
    assert "hardware" not in verdict.headline
    assert any("--all-ranks" in s for s in verdict.suggestions)


def test_the_record_hint_fits_the_kind_of_data():
    common = dict(
        reproduced=True,
        step=3,
        culprit_samples=["row-7"],
        candidates=8,
        bisect_runs=5,
        phase="forward",
        module="net.0",
        record_evidence=EVIDENCE,
    )
    floats = decide_verdict(VerdictFacts("nonfinite_loss", data_kind="float", **common))
    tokens = decide_verdict(VerdictFacts("nonfinite_loss", data_kind="tokens", **common))
    assert floats.kind == tokens.kind == "bad_sample"
    assert not any("text" in s or "base64" in s for s in floats.suggestions)
    assert any("units" in s for s in floats.suggestions) and any("base64" in s for s in tokens.suggestions)


def test_out_of_memory_that_a_larger_replay_device_does_not_reproduce_still_names_the_long_sample():
    big = {"sample_id": "doc-9", "micro_batch": 1, "index": 2, "tokens": 65536}
    v = check_shape(
        decide_verdict(
            facts(
                trigger_kind="exception",
                reproduced=False,
                out_of_memory=True,
                size_outliers=[big],
                median_size=512.0,
                replay_device="cuda:0",
            )
        )
    )
    assert v.kind == "not_reproduced"
    assert "Sample 'doc-9' (65,536 tokens, 128x the step's median of 512): the likely cause" in v.explanation
    assert v.suggestions[0].startswith("Filter or truncate 'doc-9' (blocklist.jsonl lists it), and cap")
    assert not any("DCGM" in s or "deterministic" in s for s in v.suggestions)  # not a hardware question
    alone = check_shape(decide_verdict(facts(trigger_kind="exception", reproduced=False, out_of_memory=True)))
    assert alone.suggestions[0].startswith("Lower the micro-batch size")  # no outlier: the step as a whole


@pytest.mark.parametrize(
    "extra",
    [
        dict(culprit_samples=["step5/rank0/mb1/2"], phase="forward", module="model.fc", op="aten::mm"),  # bad_sample
        dict(culprit_samples=["step5/rank0/mb1/2"], trigger_kind="exception", exception_type="IndexError"),
        dict(culprit_samples=["step5/rank0/mb1/2"], fp32_reproduces=False, autocast_dtype="float16"),  # precision
        dict(
            trigger_kind="exception",
            reproduced=False,
            out_of_memory=True,
            median_size=512.0,
            size_outliers=[{"sample_id": "step5/rank0/mb1/2", "micro_batch": 1, "index": 2, "tokens": 65536}],
        ),
    ],
)
def test_positional_ids_are_never_promised_a_blocklist_and_the_verdict_says_how_to_record_ids(extra):
    named = check_shape(decide_verdict(facts(**extra)))
    positional = check_shape(decide_verdict(facts(ids_are_positional=True, **extra)))
    assert any("blocklist.jsonl lists" in s for s in named.suggestions)
    assert not any("blocklist.jsonl lists" in s for s in positional.suggestions)
    assert (
        positional.suggestions[-1].startswith(
            "No blocklist entry for 'step5/rank0/mb1/2': the job recorded no sample IDs"
        )
        and "sample_ids=ids" in positional.suggestions[-1]
    )
    assert not any(s.startswith("No blocklist entry") for s in named.suggestions)
    assert positional.kind == named.kind


def test_spike_advice_for_numeric_features_speaks_of_their_scale_not_of_text():
    from forensics.replay.judge.verdict import VerdictFacts, decide_verdict

    common = dict(trigger_kind="loss_spike", reproduced=True, trigger_value=50.0, threshold=3.0)
    numeric = " ".join(decide_verdict(VerdictFacts(**common, data_kind="float")).suggestions)
    tokens = " ".join(decide_verdict(VerdictFacts(**common, data_kind="tokens")).suggestions)
    assert "scale and range of its features" in numeric and "sequence lengths" not in numeric
    assert "sequence lengths" in tokens


def test_every_sample_failing_alone_but_finite_in_fp32_is_precision_not_model_state():
    v = check_shape(decide_verdict(facts(all_subsets_fail=True, fp32_reproduces=False, autocast_dtype="float16")))
    assert v.kind == "numerical_precision" and "with every sample on its own" in v.headline
    v = check_shape(
        decide_verdict(
            facts(
                trigger_kind="grad_norm_spike",
                trigger_value=9.0,
                threshold=3.0,
                fp32_reproduces=False,
                autocast_dtype="float16",
            )
        )
    )
    assert v.kind == "numerical_precision" and "spikes only in float16" in v.headline
    assert "In fp32 the step does not spike" in v.explanation


def test_not_reproduced_by_a_recorded_factor_names_it_and_never_suspects_the_hardware():
    v = check_shape(
        decide_verdict(
            facts(
                trigger_kind="grad_norm_spike",
                reproduced=False,
                trigger_value=7.288e4,
                threshold=2e4,
                replayed_value=1.112,
                unit_factor="the recorded grad norm is the replayed one times the loss scale (65536)",
            )
        )
    )
    assert v.kind == "not_reproduced"
    text = " ".join([v.headline, v.explanation, *v.suggestions])
    assert "loss scale (65536)" in text and "scaler.unscale_" in text
    assert "DCGM" not in text and "hardware (silent" not in text


ORDINARY = "its loss 4.198 against 4.10-4.24 for the other 15; its gradient norm 17.7 against 0.24-0.8"


@pytest.mark.parametrize(
    "trigger_kind, value", [("grad_norm_spike", 17.7), ("loss_spike", 9.0), ("nonfinite_loss", NAN)]
)
def test_trigger_a_culprit_without_evidence_is_named_as_the_first_to_cross_and_never_to_filter(trigger_kind, value):
    v = check_shape(
        decide_verdict(
            facts(
                trigger_kind=trigger_kind,
                trigger_value=value,
                threshold=3.0,
                culprit_samples=["s138-i4"],
                record_evidence=[],
                ordinary_record=ORDINARY,
                lr=0.03,
                history_pattern="sudden_jump",
            )
        )
    )
    assert v.kind == "trigger_sample"
    assert "'s138-i4'" in v.headline and "no sample is to blame" in v.headline
    text = " ".join([v.headline, v.explanation, *v.suggestions])
    assert "First to cross" in v.explanation and ORDINARY in v.explanation
    assert "Filter" not in text and "blocklist.jsonl" not in text and "Do not filter 's138-i4'" in text
    assert "learning rate" in text and "next sample like it" in text
    assert "earlier state" in text  # how to confirm it: an earlier state, the Guard's snapshot or a checkpoint


def test_trigger_with_evidence_is_bad_sample_and_shows_the_evidence():
    v = check_shape(decide_verdict(facts(culprit_samples=["doc-9"], record_evidence=EVIDENCE)))
    assert v.kind == "bad_sample"
    assert "Evidence against the record: " + EVIDENCE[0] in v.explanation
    assert v.suggestions[0].startswith("Filter 'doc-9'")


def test_precision_with_a_trigger_sample_names_no_data_and_says_not_to_filter():
    v = check_shape(
        decide_verdict(
            facts(
                culprit_samples=["s1017-i3"],
                record_evidence=[],
                fp32_reproduces=False,
                autocast_dtype="float16",
                fp32_ran="214 ops in float32, none in float16 or bfloat16 (the code's own autocast held off 2 time(s))",
            )
        )
    )
    assert v.kind == "numerical_precision"
    assert "precision + data" not in v.headline + v.explanation
    assert "checked: 214 ops in float32" in v.explanation
    assert not any(s.startswith("Filter") for s in v.suggestions)
    assert any(s.startswith("Do not filter 's1017-i3'") for s in v.suggestions)


def test_an_fp32_rerun_that_did_not_run_in_fp32_draws_no_conclusion():
    v = check_shape(
        decide_verdict(
            facts(
                culprit_samples=["x"],
                fp32_reproduces=None,
                fp32_unverified=True,
                autocast_dtype="float16",
                fp32_ran="0 ops in float32, but 12 in float16",
            )
        )
    )
    assert "could not be held to float32" in v.explanation and "no conclusion" in v.explanation
    assert "fails in fp32 too" not in v.explanation and "In fp32" not in v.explanation


def test_a_norm_that_overflows_with_finite_gradients_is_the_diverged_state_not_the_hardware():
    v = check_shape(
        decide_verdict(
            facts(
                trigger_kind="nonfinite_grad",
                trigger_value=math.inf,
                grad_norm_overflow=3.2e20,
                history_pattern="exponential_growth",
            )
        )
    )
    assert v.kind == "model_state"
    text = " ".join([v.headline, v.explanation, *v.suggestions])
    assert "overflows float32" in v.headline and "3.2e+20" in v.headline
    assert "learning rate" in text and "DCGM" not in text and "hardware" not in text


@pytest.mark.parametrize("pattern", ["exponential_growth", "diverged"])  # a loss that grew, or sat far above its start
def test_a_nan_at_the_end_of_exponential_growth_is_the_divergence_whoever_crossed_first(pattern):
    v = check_shape(
        decide_verdict(
            facts(
                trigger_kind="nonfinite_grad",
                culprit_samples=["s9-i1"],
                record_evidence=[],
                history_pattern=pattern,
                lr=300.0,
                phase="backward",
                module="transformer.h.1.ln_1",
                op="aten::native_layer_norm_backward",
            )
        )
    )
    assert v.kind == "model_state"
    assert v.headline.startswith("The run diverged at a learning rate of 300")
    text = " ".join([v.headline, v.explanation, *v.suggestions])
    assert "no sample is to blame" in v.headline and "Filter" not in text
    assert "normalisation eps" not in text  # not the normalisation's fault: the weights are far gone


def test_samples_found_on_a_state_at_the_edge_of_fp16_are_not_blamed():
    """Issue 44: the verdict, not the engine, decides that the samples bisection found on a state at the edge of fp16
    are not to blame; the explanation says why, with the margin measured without them."""
    from forensics.replay.judge.verdict import withheld

    found = dict(culprit_samples=["rec-9"], fp32_reproduces=False, autocast_dtype="float16", phase="forward")
    blamed = check_shape(decide_verdict(facts(**found)))
    assert "'rec-9'" in blamed.headline
    v = check_shape(decide_verdict(facts(**found, edge_share=0.62, edge_excluded=1)))
    assert v.kind == "numerical_precision"
    assert "rec-9" not in v.headline and not any("rec-9" in s for s in v.suggestions)
    assert v.explanation.endswith(
        "Without the 1 sample(s) bisection isolated, the rest of the step still reaches 62 % of fp16's max (65,504): "
        "the model's state is at the edge of fp16, and whichever sample crosses first is not to blame."
    )
    assert withheld(False, 0.62, None) and withheld(False, None, None) is None


def test_samples_found_for_a_spike_in_a_run_diverged_long_before_are_not_blamed():
    from forensics.replay.judge.verdict import withheld

    diverged = "the loss has been 40x its start since step 120"
    v = check_shape(
        decide_verdict(
            facts(trigger_kind="loss_spike", trigger_value=91.0, culprit_samples=["rec-3"], run_diverged=diverged)
        )
    )
    assert v.kind == "spike_no_single_cause"
    assert "rec-3" not in v.headline and not any("rec-3" in s for s in v.suggestions)
    assert withheld(True, None, diverged) and withheld(False, None, diverged) is None  # a NaN is not a spike


def test_the_context_of_the_step_is_worded_by_the_verdict_itself():
    """The window replay, a host snapshot the replay could not use and the history before the crash are facts handed
    to decide_verdict (issue 54), not sentences added to its verdict afterwards: the step that broke leads the
    headline, the window's start and the history close the explanation, the snapshot's advice leads the suggestions
    and how to look before the window closes them; the rule's kind and own words stay."""
    from forensics.replay.judge.verdict_context import VerdictContext, WindowFacts
    from forensics.replay.run.window import SnapshotUnused

    plain = decide_verdict(facts(culprit_samples=[17]))
    history = {"sentence": "the q-k logit of `layers.1` grew first", "lead": 9, "fired": [], "earlier_dumps": [{}]}
    context = VerdictContext(
        window=WindowFacts(
            step=41210,
            dumped_step=41217,
            broke="the update moved the weights 1e3x",
            at_window_start=True,
            source="step.pt",
            first_step=0,
        ),
        snapshot_unused=SnapshotUnused(step=41200, no_data_recipe=False),
        crash_history=history,
    )
    v = check_shape(decide_verdict(facts(culprit_samples=[17]), context))
    assert v.kind == plain.kind
    assert v.headline == (
        "The weights broke at step 41210 (7 steps before the crash at step 41217): the update moved the weights "
        "1e3x. " + plain.headline
    )
    assert v.explanation.startswith(plain.explanation)
    assert "Step 41210 is the first step the window replay re-executed (it starts at step.pt)" in v.explanation
    assert v.explanation.endswith(
        "Before it, the q-k logit of `layers.1` grew first. Replay them (`forensics replay STEP_DIR`) to see how it "
        "built up."
    )
    assert v.suggestions[0].startswith("Re-run with --trust: the dump holds the Guard's host snapshot of step 41200")
    assert v.suggestions[1:-1] == plain.suggestions and v.suggestions[-1].startswith("To look before step 41210")
    assert decide_verdict(facts(culprit_samples=[17]), VerdictContext()) == plain


# -- a NaN gradient norm replayed finite on another device (issue 50: the new user's GPT-2, GPU dumps on the CPU) -----
DIVERGED_ON_CPU = dict(  # numbers of tests/data/natural_gpu/gpt2_newuser_bf16_lr18 replayed on the CPU
    trigger_kind="nonfinite_grad",
    reproduced=False,
    step=4,
    rank=0,
    micro_batch=None,
    num_micro_batches=1,
    trigger_value=NAN,
    replayed_value=9.70846e6,
    replay_device="cpu",
    candidates=8,
    environment_warnings=["captured on GPU NVIDIA H100 80GB HBM3, replaying on the CPU"],
    replayed_grad_norm=9.70846e6,
    recorded_step_loss=1.8027e9,
    replayed_step_loss=1.7703e9,
    healthy_grad_norm=2.934,
    healthy_loss_ceiling=6.25,
    healthy_steps=2,  # the run left its start at step 2: two healthy steps, and the Guard's snapshot of step 0
    sample_grad_norms=[6.23e6, 7.47e6, 1.01e7, 1.28e7],
    sample_losses=[1.62e9, 1.71e9, 1.83e9, 1.92e9],
    earlier_state_source="the Guard's host snapshot of step 0 (in the dump), 4 steps earlier",
    earlier_sample_grad_norms=[1.02, 1.31, 0.87, 1.44],
    earlier_sample_losses=[4.11, 4.23, 4.05, 4.19],
    history_pattern="exponential_growth",
)
NO_EARLIER = dict(earlier_state_source=None, earlier_sample_grad_norms=None, earlier_sample_losses=None)


def test_a_nan_grad_norm_replayed_finite_but_diverging_as_the_run_did_is_the_model_state():
    v = decide_verdict(VerdictFacts(**DIVERGED_ON_CPU))
    check_shape(v)
    assert v.kind == "model_state"
    assert "not the data" in v.headline and "9.70846e+06" in v.headline and "3.31e+06 x" in v.headline
    assert "Not reproduced bit for bit" in v.explanation and "H100" in v.explanation  # why: another device
    assert "each of the 4 samples run alone" in v.explanation and "no single record is to blame" in v.explanation
    assert "Fed to the Guard's host snapshot of step 0" in v.explanation and "healthy" in v.explanation
    assert not any(s.startswith("Filter") for s in v.suggestions)
    assert not any("DCGM" in s for s in v.suggestions)  # no hardware advice for a diverged state
    assert not any("snapshot_every" in s for s in v.suggestions)  # the test that tells state from data ran


def test_a_diverged_step_whose_samples_diverge_on_the_earlier_state_too_is_not_the_model_state():
    """A batch whose records are all bad (unnormalised inputs) fails alone on any weights: fed to the Guard's snapshot
    of step 0, the samples diverge there too, so the state is not to blame; no record evidence names a sample either,
    so the rule does not fire and the verdict stays not reproduced (no data is blamed without record evidence)."""
    for earlier in ([5.1e6, 6.2e6, 4.4e6, 7.0e6], [1.02, 1.31, 4.4e6, 1.44], [1.02, NAN, 0.87, 1.44]):
        v = decide_verdict(VerdictFacts(**{**DIVERGED_ON_CPU, "earlier_sample_grad_norms": earlier}))
        assert v.kind == "not_reproduced", (earlier, v.headline)
        assert "Guard's host snapshot of step 0" in v.explanation and "no sample is named" in v.explanation
    raised = decide_verdict(VerdictFacts(**{**DIVERGED_ON_CPU, "earlier_sample_losses": [4.11, None, 4.05, 4.19]}))
    assert raised.kind == "not_reproduced"  # a sample that raised on the earlier state is not healthy there


def test_a_diverged_step_with_no_earlier_state_says_which_test_would_tell_state_from_data():
    v = decide_verdict(VerdictFacts(**{**DIVERGED_ON_CPU, **NO_EARLIER, "healthy_steps": 3}))
    assert v.kind == "model_state"
    assert "not the data" not in v.headline and "no single record is to blame" in v.headline
    assert "no earlier state was at hand" in v.explanation and "unnormalised inputs" in v.explanation
    assert any("RecordConfig(snapshot_every=" in s and "--from" in s for s in v.suggestions), v.suggestions


def test_a_diverged_step_needs_three_healthy_steps_without_an_earlier_state():
    """MIN_HEALTHY_STEPS: a median of two healthy steps is no range; with no earlier state to measure one, the rule
    does not fire."""
    for steps in (0, 1, 2):
        v = decide_verdict(VerdictFacts(**{**DIVERGED_ON_CPU, **NO_EARLIER, "healthy_steps": steps}))
        assert v.kind == "not_reproduced", steps


@pytest.mark.parametrize(
    "norms, losses, why",
    [
        ([6.23e6, NAN, 1.01e7, 1.28e7], [1.62e9, None, 1.83e9, 1.92e9], "a row that raised (no loss)"),
        ([6.23e6, NAN, 1.01e7, 1.28e7], [1.62e9, NAN, 1.83e9, 1.92e9], "a row with a non-finite loss"),
        ([NAN, NAN, NAN, NAN], [1.62e9, 1.71e9, 1.83e9, 1.92e9], "no row finite: nothing measured past the bar"),
        ([6.23e6, 7.47e6, 1.01e7, 1.28e7], None, "no losses: the rows cannot be read"),
    ],
)
def test_a_per_sample_row_that_raised_or_lost_its_loss_blocks_the_diverged_rule(norms, losses, why):
    v = decide_verdict(VerdictFacts(**{**DIVERGED_ON_CPU, "sample_grad_norms": norms, "sample_losses": losses}))
    assert v.kind == "not_reproduced", why


def test_a_per_sample_row_non_finite_as_the_job_was_does_not_block_the_diverged_rule():
    facts = VerdictFacts(**{**DIVERGED_ON_CPU, "sample_grad_norms": [6.23e6, NAN, 1.01e7, 1.28e7]})
    d = diverged_here(facts)
    assert d is not None and d.samples_over == 3 and d.samples_nonfinite == 1
    v = decide_verdict(facts)
    assert v.kind == "model_state" and "1 more non-finite alone as the job's step was" in v.explanation


def test_per_sample_norms_meet_the_bar_in_the_steps_units():
    """A per-sample row is the gradient of one sample's own loss, not divided by the job's loss_divisor: with a step
    loss 8 x below the samples' own (a divisor of 8), a norm of 4000 alone is 500 in the step's units, under the
    1000 x 2.934 bar; with a summed loss (the step loss 4 x the samples' own), 1000 alone is 4000 there, over it."""
    divided = {"sample_grad_norms": [3.0e3, 3.5e3, 4.0e3, 5.0e3], "sample_losses": [1.4e10] * 4}
    assert decide_verdict(VerdictFacts(**{**DIVERGED_ON_CPU, **divided})).kind == "not_reproduced"
    summed = {"sample_grad_norms": [1.0e3, 1.1e3, 1.2e3, 1.3e3], "sample_losses": [4.4e8] * 4}
    d = diverged_here(VerdictFacts(**{**DIVERGED_ON_CPU, **summed}))
    assert d is not None and d.sample_scale == pytest.approx(1.7703e9 / 4.4e8)
    assert d.smallest_sample_norm == pytest.approx(1.0e3 * 1.7703e9 / 4.4e8)


@pytest.mark.parametrize(
    "change, why",
    [
        (
            dict(replayed_grad_norm=3.1, replayed_value=3.1, sample_grad_norms=[2.0, 3.5, 2.2, 2.9]),
            "in the run's normal range",
        ),
        (dict(replayed_grad_norm=290.0, replayed_value=290.0), "under 1000 x the healthy norm"),
        (dict(healthy_grad_norm=None), "no healthy history to compare with"),
        (dict(sample_grad_norms=[6.23e6, 2.9, 1.01e7, 1.28e7]), "a sample is healthy alone"),
        (dict(sample_grad_norms=None), "no per-sample test ran"),
        (dict(replayed_step_loss=2.0e10), "another loss than the job's for the step"),
        (dict(recorded_step_loss=5.0, replayed_step_loss=5.1), "the loss did not explode"),
        (dict(trigger_kind="nonfinite_loss", micro_batch=0), "a non-finite loss (no finite loss to compare)"),
        (dict(trigger_local=False), "another rank's fault"),
    ],
)
def test_a_genuinely_unreproduced_nan_grad_norm_stays_not_reproduced(change, why):
    v = decide_verdict(VerdictFacts(**{**DIVERGED_ON_CPU, **change}))
    assert v.kind == "not_reproduced", why


def test_the_per_sample_rows_the_diverged_rule_reads_keep_raised_and_lossless_rows():
    """A row that raised, or is marked non-finite with no loss, reaches the rule with no loss (it blocks it); before,
    a raised row was dropped and a lossless non-finite one read as past the bar."""
    from forensics.replay.judge.assemble import _sample_grad_norms, _sample_losses

    rows = [
        {"sample_id": 0, "micro_batch": 0, "index": 0, "loss": 1.7e9, "grad_norm": 6.2e6, "finite": True},
        {"sample_id": 1, "micro_batch": 0, "index": 1, "loss": None, "grad_norm": None, "finite": False},
        {"sample_id": 2, "micro_batch": 0, "index": 2, "loss": None, "grad_norm": None, "finite": False, "error": "E"},
        {"sample_id": 3, "micro_batch": 0, "index": 3, "loss": 1.8e9, "grad_norm": NAN, "finite": False},
    ]
    norms, losses = _sample_grad_norms(rows), _sample_losses(rows)
    assert norms is not None and len(norms) == 4 and norms[0] == 6.2e6
    assert all(math.isnan(v) for v in norms[1:])
    assert losses == [1.7e9, None, None, 1.8e9]
    facts = VerdictFacts(**{**DIVERGED_ON_CPU, "sample_grad_norms": norms, "sample_losses": losses})
    assert decide_verdict(facts).kind == "not_reproduced"
    kept = [rows[0], rows[3]]  # the job-like row (finite loss, non-finite norm) does not block
    facts = VerdictFacts(
        **{**DIVERGED_ON_CPU, "sample_grad_norms": _sample_grad_norms(kept), "sample_losses": _sample_losses(kept)}
    )
    assert decide_verdict(facts).kind == "model_state"
