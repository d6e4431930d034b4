"""Counterfactual fixes (replay/judge/remedies.py) on real models and optimizers: which change makes the failing step
healthy, with numbers, ranked — and the verdict's suggestions start from what was tested."""

import math

import torch

from forensics.replay.engine import ReplayOptions, run_session
from forensics.replay.run.execute import StepRunner

NAN_LOSS = {
    "kind": "nonfinite_loss",
    "value": float("nan"),
    "threshold": None,
    "micro_batch": 1,
    "detail": "loss of micro-batch 1 is nan",
}
HISTORY = {"step": [4, 5, 6, 7], "loss": [4.2, 4.1, 4.15, float("inf")], "grad_norm": [1.0, 1.1, 0.9, None]}


def replay(session) -> dict:
    report = run_session(
        session,
        ReplayOptions(rng_check=False),
        dump_info={"path": "memory", "run_id": "test", "step": 7, "rank": 0, "world_size": 1, "missing_ranks": []},
        history=HISTORY,
    )
    return report


def rows(report) -> dict:
    return {row["kind"]: row for row in report["remedies"]["tested"]}


def test_a_bad_sample_is_fixed_by_dropping_it_not_by_a_lower_lr_or_clipping(kit):
    model = kit.build_gpt2()
    session = kit.make_session(
        model,
        kit.build_batches(),
        loss_fn=kit.log_zero_loss,
        trigger=NAN_LOSS,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
    )
    report = replay(session)

    tested = rows(report)
    assert report["remedies"]["tested"][0]["kind"] == "drop_samples"  # ranked: the fix of the cause first
    assert tested["drop_samples"]["healthy"] is True and tested["drop_samples"]["weights_finite"] is True
    assert "doc-1-2" in tested["drop_samples"]["change"] and math.isfinite(tested["drop_samples"]["step_loss"])
    for kind in ("as_recorded", "lower_lr", "clip_grad"):
        assert tested[kind]["healthy"] is False, kind
    assert tested["clip_grad"]["change"].endswith("max_norm=1) (the median grad norm of the healthy recorded steps)")
    assert tested["skip_step"]["healthy"] is True
    suggestions = report["verdict"]["suggestions"]
    assert suggestions[0].startswith("Tested fix (drop the culprit samples): leave out samples ['doc-1-2']")
    assert not any("only skipping the step" in s for s in suggestions)


def test_adam_eps_zero_is_fixed_by_a_non_zero_eps_and_not_by_a_lower_lr(kit):
    model = kit.build_gpt2()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    trigger = {
        "kind": "nonfinite_param",
        "value": float("nan"),
        "threshold": None,
        "micro_batch": None,
        "detail": "the optimizer update made a parameter non-finite",
    }
    report = replay(kit.make_session(model, kit.build_batches(poison=False), optimizer=optimizer, trigger=trigger))

    tested = rows(report)
    assert report["verdict"]["kind"] == "optimizer_update"
    assert (
        tested["adam_eps"]["healthy"] is True and tested["adam_eps"]["change"] == "eps=1e-08 in the optimizer (was 0)"
    )
    assert tested["as_recorded"]["healthy"] is False and tested["as_recorded"]["weights_finite"] is False
    assert tested["lower_lr"]["healthy"] is False  # 0/0 stays NaN at any learning rate
    assert report["verdict"]["suggestions"][0].startswith("Tested fix (a non-zero Adam eps): eps=1e-08")
    # what the remedies showed useless is not suggested
    assert not any(s.startswith("Lower the learning rate") for s in report["verdict"]["suggestions"])


def embeds_batches(culprit_scale: float | None):
    g = torch.Generator().manual_seed(3)
    batches = [
        {
            "inputs_embeds": torch.randn(4, 8, 32, generator=g),
            "labels": torch.randint(0, 64, (4, 8), generator=g),
            "sample_ids": [f"m{m}-{i}" for i in range(4)],
        }
        for m in range(2)
    ]
    if culprit_scale is not None:
        batches[1]["inputs_embeds"][2] *= culprit_scale
    return batches


def penalty_loss(model, batch):
    """LM loss plus an activation penalty: a sample with huge inputs makes the loss spike (finite)."""
    out = model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"], output_hidden_states=True)
    return out.loss + 1e-2 * out.hidden_states[1].pow(2).mean()


def spike_session(kit, model, optimizer):
    healthy = StepRunner(kit.make_session(model, embeds_batches(None), loss_fn=penalty_loss, record=False)).run(
        backward=False
    )
    trigger = {
        "kind": "loss_spike",
        "value": None,
        "threshold": 1.5 * healthy.step_loss,
        "micro_batch": 1,
        "detail": "spike",
    }
    return kit.make_session(model, embeds_batches(50.0), loss_fn=penalty_loss, trigger=trigger, optimizer=optimizer)


def test_a_harmless_spike_needs_no_action(kit):
    model = kit.build_gpt2()
    report = replay(spike_session(kit, model, torch.optim.AdamW(model.parameters(), lr=1e-4)))

    assert report["reproduced"] is True
    tested = rows(report)
    assert tested["as_recorded"]["healthy"] is True and tested["as_recorded"]["relative_change"] < 0.05
    assert report["remedies"]["tested"][0]["kind"] == "as_recorded"
    suggestions = report["verdict"]["suggestions"]
    if (
        report["verdict"]["kind"] == "bad_sample"
    ):  # a harmless step, but a bad record: never "no action" beside "filter"
        assert suggestions[0].startswith("Filter") and not any(s.startswith("No action needed") for s in suggestions)
        assert any(s.startswith("The job survives this step (replayed as recorded") for s in suggestions)
    else:
        assert suggestions[0].startswith("No action needed: replayed as recorded")


def test_a_spike_that_wrecks_the_weights_is_fixed_by_a_lower_learning_rate(kit):
    """SGD whose learning rate makes this spike's update twice the weights' norm: as recorded the step wrecks the
    model (finite, but a 200 % change); at a tenth of the rate it is healthy."""
    model = kit.build_gpt2()
    probe = StepRunner(spike_session(kit, model, None))
    run = probe.run(keep_grads=True)
    weights = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in model.parameters()))
    lr = 2.0 * weights / run.grad_norm
    probe.reset()
    report = replay(spike_session(kit, model, torch.optim.SGD(model.parameters(), lr=lr)))

    tested = rows(report)
    assert tested["as_recorded"]["healthy"] is False and tested["as_recorded"]["weights_finite"] is True
    assert 1.5 < tested["as_recorded"]["relative_change"] < 2.5
    assert "moves the weights by" in tested["as_recorded"]["note"]
    assert tested["lower_lr"]["healthy"] is True and 0.15 < tested["lower_lr"]["relative_change"] < 0.25
    assert any(s.startswith("Tested fix (a 10x lower learning rate)") for s in report["verdict"]["suggestions"][:3])


class HalfScale(torch.nn.Module):
    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            return (x.to(torch.get_autocast_dtype("cpu")) * 1e3).float() / 1e3
        return x * 1e3 / 1e3


def test_an_fp16_overflow_is_fixed_by_fp32(kit):
    model = kit.build_gpt2()
    with torch.no_grad():
        model.transformer.wte.weight[kit.POISON_TOKEN] = 100.0
    model.transformer.wte = torch.nn.Sequential(model.transformer.wte, HalfScale())
    session = kit.make_session(
        model,
        kit.build_batches(),
        autocast_dtype=torch.float16,
        trigger=NAN_LOSS,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
    )
    report = replay(session)

    tested = rows(report)
    assert report["verdict"]["kind"] == "numerical_precision"
    assert tested["fp32"]["healthy"] is True
    assert tested["fp32"]["change"].startswith("keep `transformer.wte.1` in fp32")
    assert tested["lower_lr"]["healthy"] is False
