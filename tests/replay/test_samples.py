"""Tests for replay/load/samples.py: batch-size inference and per-sample slicing of batch trees."""

from collections import namedtuple

import pytest
import torch
import transformers

from forensics.core.errors import ForensicsError
from forensics.replay.load.samples import BatchSizeError, SampleSelectionError, batch_size, select_samples


def hf_batch(b=4, t=6):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (b, t), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(b, t, dtype=torch.long),
        "labels": ids.clone(),
        "sample_ids": [f"s{i}" for i in range(b)],
    }


def test_hf_batch_slices_every_per_sample_leaf_in_the_order_asked():
    batch = hf_batch()
    assert batch_size(batch) == 4
    sub = select_samples(batch, [3, 1])
    assert sub["sample_ids"] == ["s3", "s1"]
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(sub[key], batch[key][[3, 1]])
    assert list(sub) == list(batch)


def test_sliced_batch_gives_the_same_per_sample_loss_in_a_real_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    batch = hf_batch()
    with torch.no_grad():
        logits_all = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        sub = select_samples(batch, [2])
        logits_one = model(input_ids=sub["input_ids"], attention_mask=sub["attention_mask"]).logits
    torch.testing.assert_close(logits_one[0], logits_all[2], rtol=1e-5, atol=1e-5)


def test_other_leaves_are_kept_as_they_are():
    pos = torch.arange(6).unsqueeze(0)  # (1, T): broadcast, not per sample
    scalar = torch.tensor(0.5)
    batch = {
        "x": torch.randn(3, 6),
        "position_ids": pos,
        "temperature": scalar,
        "split": "train",
        "n": 7,
        "vocab": ["a", "b"],
        "meta": None,
    }
    sub = select_samples(batch, [0, 2])
    assert sub["x"].shape == (2, 6)
    assert sub["position_ids"] is pos and sub["temperature"] is scalar
    assert sub["split"] == "train" and sub["n"] == 7 and sub["meta"] is None
    assert sub["vocab"] == ["a", "b"]  # a list of another length is not per sample


def test_nested_tuples_lists_and_named_tuples_keep_their_types():
    Pair = namedtuple("Pair", "inputs targets")
    batch = [Pair(torch.arange(5).float(), torch.arange(5) * 10), {"ids": (1, 2, 3, 4, 5)}, (torch.zeros(5, 2), "tag")]
    assert batch_size(batch) == 5
    sub = select_samples(batch, [4, 0])
    assert isinstance(sub, list) and isinstance(sub[0], Pair)
    assert sub[0].inputs.tolist() == [4.0, 0.0] and sub[0].targets.tolist() == [40, 0]
    assert sub[1]["ids"] == (5, 1) and isinstance(sub[1]["ids"], tuple)
    assert isinstance(sub[2], tuple) and sub[2][0].shape == (2, 2) and sub[2][1] == "tag"


def test_bare_tensor_and_list_only_batches():
    assert batch_size(torch.zeros(7, 3)) == 7
    assert select_samples(torch.arange(7), [6, 5]).tolist() == [6, 5]
    assert batch_size({"text": ["a", "b", "c"]}) == 3
    assert select_samples({"text": ["a", "b", "c"]}, [1]) == {"text": ["b"]}


def test_disagreeing_tensors_vote_and_the_majority_wins():
    batch = {"a": torch.zeros(1, 4), "b": torch.zeros(4, 2), "c": torch.zeros(4)}
    assert batch_size(batch) == 4
    sub = select_samples(batch, [1])
    assert sub["a"].shape == (1, 4) and sub["b"].shape == (1, 2) and sub["c"].shape == (1,)


def test_no_batch_size_raises_a_clear_forensics_error():
    with pytest.raises(BatchSizeError, match="cannot infer the batch size") as info:
        batch_size({"temperature": torch.tensor(1.0), "name": "x"})
    assert isinstance(info.value, ForensicsError)
    with pytest.raises(BatchSizeError):
        select_samples("just a string", [0])


def test_out_of_range_indices_are_refused():
    with pytest.raises(SampleSelectionError, match="out of range"):
        select_samples(hf_batch(), [0, 4])
    with pytest.raises(SampleSelectionError):
        select_samples(hf_batch(), [-1])


def test_empty_selection():
    assert select_samples(hf_batch(), [])["input_ids"].shape == (0, 6)
