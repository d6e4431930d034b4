"""What replay says about a culprit sample's own data: labels all masked, an empty attention mask, NaN/Inf, values
far beyond the other samples', a field all zeros — from the micro-batch alone; and, end to end, a real job whose
micro-batch of one sample has every label masked (0/0 = NaN) gets that named in the verdict."""

from __future__ import annotations

import pytest
import torch

from forensics.core.kinds import SampleFactKind
from forensics.replay.culprits.sample_facts import describe, describe_samples, sample_facts
from forensics.replay.run.execute import SampleRef


def _text_batch(n: int = 3, seq: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (n, seq), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(n, seq, dtype=torch.long),
        "labels": ids.clone(),
        "sample_ids": [f"s{i}" for i in range(n)],
    }


def _kinds(batch, index) -> list[SampleFactKind]:
    return [fact.kind for fact in sample_facts(batch, index)]


def test_labels_all_masked_and_only_the_first_label_kept_are_named():
    batch = _text_batch()
    batch["labels"][1] = -100
    batch["labels"][2, 1:] = -100  # a causal LM's shift drops the one label left
    assert _kinds(batch, 0) == []
    [masked] = sample_facts(batch, 1)
    assert masked.kind is SampleFactKind.LABELS_MASKED and masked.field == "labels"
    assert "every one of its 6 labels is -100" in masked.words and "0/0" in masked.words
    assert "only the first of its 6 labels" in sample_facts(batch, 2)[0].words


def test_an_empty_attention_mask_is_named_before_anything_else():
    batch = _text_batch()
    batch["attention_mask"][2] = 0
    batch["labels"][2] = -100
    assert _kinds(batch, 2) == [SampleFactKind.LABELS_MASKED, SampleFactKind.NO_ATTENTION]


def test_float_fields_nonfinite_extreme_or_all_zero_compared_with_the_other_samples():
    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(4, 3, 8, 8, generator=g), "weights": torch.rand(4, 5, generator=g) + 0.1}
    batch["pixel_values"][1, 0, 2, 2] = float("nan")
    batch["pixel_values"][1, 0, 2, 3] = float("inf")
    batch["pixel_values"][2] *= 1e6
    batch["weights"][3] = 0.0
    assert describe(sample_facts(batch, 0)) is None
    assert describe(sample_facts(batch, 1)) == "its pixel_values holds 1 NaN and 1 Inf (of 192 values)"
    [extreme] = sample_facts(batch, 2)
    assert extreme.kind is SampleFactKind.EXTREME_VALUES and "x the other samples' largest" in extreme.words
    [zero] = sample_facts(batch, 3)
    assert zero.kind is SampleFactKind.ALL_ZERO and zero.field == "weights"


def test_a_hostile_field_name_is_printed_clean_and_an_unreadable_batch_gives_no_facts():
    batch = {"\x1b[31mlabels": torch.full((2, 4), -100), "x": torch.randn(2, 3)}
    words = describe(sample_facts({"\x1b[2J": {"labels": torch.full((2, 4), -100)}}, 0))
    assert "\x1b" not in words and "\\x1b" in words
    assert sample_facts(batch, 0) == []  # not a label field by name: nothing claimed
    refs = [SampleRef(0, 7, "ghost")]  # an index past the batch: skipped, never raised
    assert describe_samples([batch], refs) == {}


def test_a_micro_batch_with_every_label_masked_is_named_in_the_verdict(helpers, tmp_path):
    """Supervised fine-tuning with one sample per micro-batch: a sample whose prompt was truncated past its answer
    has every label -100, so Hugging Face's mean cross-entropy is 0/0 = NaN for its micro-batch."""
    from forensics.capture import DetectionConfig, Guard, GuardConfig
    from forensics.replay import engine

    model = helpers.make_gpt2(dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="sft", detection=DetectionConfig(on_nonfinite="skip")),
    )
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        for mb in range(4):
            ids = torch.randint(1, 60, (1, 8), generator=g)
            labels = torch.full_like(ids, -100) if (step, mb) == (1, 2) else ids.clone()
            batch = {"input_ids": ids, "labels": labels, "sample_ids": [f"doc-{step}-{mb}"]}
            guard.record_batch(batch)
            loss = model(input_ids=ids, labels=labels).loss
            guard.record_loss(loss)
            (loss / 4).backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
    guard.close()
    [dump] = guard.dumps
    report = engine.run_replay(str(dump), engine.ReplayOptions(device="cpu", rng_check=False, remedies=False))
    assert report["verdict"]["kind"] == "bad_sample"
    [culprit] = report["culprit"]["samples"]
    assert culprit["sample_id"] == "doc-1-2"
    assert culprit["description"].startswith("every one of its 8 labels is -100 (ignored)")
    assert any(
        s.startswith("'doc-1-2': every one of its 8 labels is -100") and "no supervised token" in s
        for s in report["verdict"]["suggestions"]
    ), report["verdict"]["suggestions"]


def test_a_feature_100x_the_others_is_named_first_and_a_zero_target_claims_no_division():
    """Issue 22, item 2: x = 1000 against ~3 in the other samples, and the same sample's target all zeros, under an
    MSE loss: the 1000 is named first, and nothing says a division by zero happens (MSE divides by nothing)."""
    from forensics.replay.judge.verdict import VerdictFacts, decide_verdict

    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(4, 6, generator=g).clamp(-3, 3), "y": torch.rand(4, 2, generator=g) + 0.5}
    batch["x"][1, 2] = 1000.0
    batch["y"][1] = 0.0
    facts = sample_facts(batch, 1)
    assert [f.kind for f in facts] == [SampleFactKind.EXTREME_VALUES, SampleFactKind.ALL_ZERO]
    assert facts[0].field == "x" and "reaches 1e+03" in facts[0].words
    assert not any("divide" in f.words for f in facts)
    verdict = decide_verdict(
        VerdictFacts(
            "nonfinite_loss",
            True,
            step=5,
            culprit_samples=[13],
            candidates=4,
            culprit_facts=facts,
            phase="forward",
            module="<loss>",
            op="aten::mse_loss",
        )
    )
    assert verdict.suggestions[1].startswith("13: its x reaches 1e+03")
    assert not any("divide" in s for s in verdict.suggestions)
    # where the op that failed does divide, the all-zero field is tied to it
    divided = decide_verdict(
        VerdictFacts(
            "nonfinite_loss",
            True,
            step=5,
            culprit_samples=[13],
            candidates=4,
            culprit_facts=facts[1:],
            phase="forward",
            module="<loss>",
            op="aten::div",
        )
    )
    assert "aten::div divides by its sum or norm" in divided.suggestions[1]


@pytest.mark.parametrize(
    "batch, kind",
    [
        ({"x": torch.randn(8, 4), "y": torch.randint(0, 3, (8,))}, "float"),  # features and class labels
        ({"inputs_embeds": torch.randn(2, 8, 16), "labels": torch.randint(0, 64, (2, 8))}, "float"),
        ({"pixels": torch.randn(2, 3, 4, 4)}, "float"),
        ({"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}, "tokens"),
        ([torch.randint(0, 64, (2, 8)), torch.randn(2, 8)], "tokens"),
    ],
)
def test_text_advice_is_for_token_batches_only(batch, kind):
    """Issue 42 item 10: a batch of tensors (features with integer class labels, embeddings) is not text: its records
    get the numeric hint, never 'base64, control characters'."""
    from forensics.replay.judge.assemble import batch_data_kind

    assert batch_data_kind(batch) == kind
