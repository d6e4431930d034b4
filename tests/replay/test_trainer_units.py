"""Per-sample losses under the Hugging Face Trainer are in the step loss's units (issue 50, item 6).

The Trainer passes `num_items_in_batch` (the label tokens of the whole step) and the model divides its summed loss
by it. A sample replayed alone with the step's count gave 1/8 of its loss (0.67 against a step loss of 5.38), and
the "drop the culprit samples" remedy a mis-normalised step loss. The selection now carries its own share."""

from __future__ import annotations

import torch

from forensics.replay.load.samples import select_samples


def _model_and_batch(helpers):
    model = helpers.make_gpt2(dropout=0.0).eval()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (8, 12), generator=gen)
    labels = ids.clone()
    labels[2, 5:] = -100  # one shorter record: per-token means differ from per-sample sums
    items = labels[..., 1:].ne(-100).sum()
    return model, {"input_ids": ids, "labels": labels, "num_items_in_batch": items}


def _loss(model, batch) -> float:
    with torch.no_grad():
        return float(model(**batch).loss)


def test_a_sample_alone_has_its_own_mean_loss_per_token(helpers):
    model, batch = _model_and_batch(helpers)
    step = _loss(model, batch)
    alone = [_loss(model, select_samples(batch, [i])) for i in range(8)]
    plain = [_loss(model, {k: v[i : i + 1] for k, v in batch.items() if k != "num_items_in_batch"}) for i in range(8)]
    assert all(abs(a - p) < 1e-5 for a, p in zip(alone, plain)), (alone, plain)  # each its own mean per token
    assert 0.5 * step < sum(alone) / 8 < 2 * step  # the step's units, not 1/8 of them


def test_the_step_without_some_samples_is_in_the_steps_units(helpers):
    model, batch = _model_and_batch(helpers)
    rest = select_samples(batch, [0, 1, 3, 4, 5, 6, 7])
    without = {k: v[[0, 1, 3, 4, 5, 6, 7]] for k, v in batch.items() if k != "num_items_in_batch"}
    assert abs(_loss(model, rest) - _loss(model, without)) < 1e-5
    assert select_samples(batch, list(range(8)))["num_items_in_batch"] is batch["num_items_in_batch"]
