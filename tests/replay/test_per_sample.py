"""Tests for replay/culprits/per_sample.py: per-sample loss / grad norm on real models, per-layer grad norms."""

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers

from forensics.replay.culprits.per_sample import PerSampleError, per_sample_stats, rank_by_loss
from forensics.replay.load.samples import select_samples


@dataclass(frozen=True)
class Ref:  # the shape of forensics.replay.run.execute.SampleRef
    micro_batch: int
    index: int
    sample_id: Any


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_batches():
    g = torch.Generator().manual_seed(1)
    batches = []
    for mb in range(2):
        ids = torch.randint(1, 64, (3, 8), generator=g)
        labels = ids.clone()
        batches.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "labels": labels,
                "sample_ids": [f"mb{mb}-s{i}" for i in range(3)],
            }
        )
    batches[1]["labels"][2] = -100  # every label masked: 0/0 in the mean over tokens
    return batches


def gpt2_loss(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


def refs_of(batches):
    return [Ref(mb, i, b["sample_ids"][i]) for mb, b in enumerate(batches) for i in range(len(b["sample_ids"]))]


def test_loop_names_the_fully_masked_sample_and_leaves_grads_as_found():
    model, batches = tiny_gpt2().eval(), gpt2_batches()
    assert torch.isfinite(gpt2_loss(model, batches[1]))  # the batch mean hides it
    gpt2_loss(model, batches[0]).backward()
    before = {n: p.grad for n, p in model.named_parameters()}
    before_values = {n: g.clone() for n, g in before.items()}

    rows = per_sample_stats(
        model, refs_of(batches), lambda r: gpt2_loss(model, select_samples(batches[r.micro_batch], [r.index]))
    )

    assert [r["sample_id"] for r in rows] == [f"mb{m}-s{i}" for m in range(2) for i in range(3)]
    bad = rows[5]
    assert bad["sample_id"] == "mb1-s2" and not bad["finite"] and math.isnan(bad["loss"])
    assert all(r["finite"] and r["loss"] > 0 and r["grad_norm"] > 0 for r in rows[:5])
    assert rank_by_loss(rows)[0]["sample_id"] == "mb1-s2"
    for n, p in model.named_parameters():
        assert p.grad is before[n] and torch.equal(p.grad, before_values[n])


def gpt2_loss_no_mask(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def test_vectorised_path_matches_the_loop_and_does_not_call_run_one():
    model, batches = tiny_gpt2().eval(), gpt2_batches()
    refs = refs_of(batches)
    loop = per_sample_stats(model, refs, lambda r: gpt2_loss(model, select_samples(batches[r.micro_batch], [r.index])))

    def must_not_run(ref):
        raise AssertionError(f"vectorised path fell back to the loop for {ref}")

    vec = per_sample_stats(model, refs, must_not_run, batches=batches, loss_fn=gpt2_loss_no_mask)
    for a, b in zip(loop, vec):
        assert (a["sample_id"], a["finite"]) == (b["sample_id"], b["finite"])
        if a["finite"]:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    assert all(p.grad is None for p in model.parameters())


def test_hf_attention_mask_cannot_be_vmapped_and_falls_back_to_the_same_rows():
    model, batches = tiny_gpt2().eval(), gpt2_batches()
    refs = refs_of(batches)
    calls = []

    def run_one(r):
        calls.append(r)
        return gpt2_loss(model, select_samples(batches[r.micro_batch], [r.index]))

    rows = per_sample_stats(model, refs, run_one, batches=batches, loss_fn=gpt2_loss)
    assert calls == refs
    assert [r["finite"] for r in rows] == [True] * 5 + [False]


def test_dropout_falls_back_to_the_loop_with_the_rng_hook_each_sample():
    model, batches = tiny_gpt2().train(), gpt2_batches()  # dropout active: vmap refuses random ops
    refs = refs_of(batches)[:3]
    seen = []

    def restore_rng(ref):
        seen.append(ref)
        torch.manual_seed(1234)

    def run():
        def run_one(r):
            return gpt2_loss(model, select_samples(batches[r.micro_batch], [r.index]))

        return per_sample_stats(model, refs, run_one, before_each=restore_rng, batches=batches, loss_fn=gpt2_loss)

    first, second = run(), run()
    assert first == second  # deterministic dropout
    assert seen[-3:] == refs


def test_batchnorm_running_stats_are_restored_and_large_models_use_the_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    ).train()
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    x[4, 0] = float("nan")  # a corrupted record
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def run_one(ref):
        calls.append(ref.index)
        xs = x[[ref.index, (ref.index + 1) % 6]]  # BatchNorm needs two rows in train mode
        return torch.nn.functional.mse_loss(model(xs)[:1], y[ref.index : ref.index + 1])

    refs = [Ref(0, i, i) for i in range(6)]
    rows = per_sample_stats(
        model, refs, run_one, batches=[{"x": x}], loss_fn=lambda m, b: m(b["x"]).sum(), max_vmap_bytes=0
    )
    assert calls == list(range(6))
    assert [r["finite"] for r in rows] == [True, True, True, False, False, True]
    for k, v in model.state_dict().items():
        assert torch.equal(v, stats[k]), k


def test_a_sample_whose_forward_raises_is_recorded_not_fatal():
    model = torch.nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2], [3, 99], [4, 5]])  # 99 is out of the vocabulary

    rows = per_sample_stats(model, [Ref(0, i, f"s{i}") for i in range(3)], lambda r: model(ids[r.index]).sum())
    assert [r["finite"] for r in rows] == [True, False, True]
    assert rows[1]["loss"] is None and "index" in rows[1]["error"].lower()


def test_non_scalar_loss_is_a_clear_error():
    model = torch.nn.Linear(2, 3)
    with pytest.raises(PerSampleError, match="not a scalar"):
        per_sample_stats(model, [Ref(0, 0, "a")], lambda r: model(torch.ones(1, 2)))


def test_rank_by_loss_puts_non_finite_first_then_highest_loss():
    rows = [
        {"sample_id": "a", "loss": 1.0, "grad_norm": 2.0, "finite": True},
        {"sample_id": "b", "loss": math.inf, "grad_norm": 1.0, "finite": False},
        {"sample_id": "c", "loss": 3.0, "grad_norm": math.nan, "finite": False},
        {"sample_id": "d", "loss": 1.0, "grad_norm": 5.0, "finite": True},
        {"sample_id": "e", "loss": 7.0, "grad_norm": 0.1, "finite": True},
    ]
    assert [r["sample_id"] for r in rank_by_loss(rows)] == ["b", "c", "e", "d", "a"]
