"""The fp32 re-run gives back every autocast it held to fp32 (issue 49, item 4): a user's autocast object that outlives
the pass — a `@torch.autocast(...)` decorator (one instance for every call) or an instance kept on the module — is
enabled again after it, an exception in the user's code included; so the same step replays to the same per-sample
answer whichever way the user spelled autocast. Before, the reused object stayed disabled and the per-sample replay
ran in fp32: "0 of 8 non-finite" instead of "1 of 8"."""

from __future__ import annotations

import json

import pytest
import torch

from forensics.replay.engine import ReplayOptions, run_session
from forensics.replay.run.fp32 import Fp32Count, held_to_fp32

NAN_LOSS = {
    "kind": "nonfinite_loss",
    "value": float("nan"),
    "threshold": None,
    "micro_batch": 1,
    "detail": "loss of micro-batch 1 is nan",
}


class HalfScale(torch.nn.Module):
    """Scales by 1e3 in autocast's dtype when autocast is on: float16 overflows past 65504 (the poisoned token's 100
    x 1e3), float32 does not."""

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            return (x.to(torch.get_autocast_dtype("cpu")) * 1e3).float() / 1e3
        return x * 1e3 / 1e3


class WithAutocast(torch.nn.Module):
    """The user's model enters autocast itself: a new context each call."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **batch):
        with torch.autocast("cpu", dtype=torch.float16):
            return self.inner(**batch)


class DecoratedAutocast(WithAutocast):
    """The same, as a decorator: one autocast instance serves every call."""

    @torch.autocast("cpu", dtype=torch.float16)
    def forward(self, **batch):
        return self.inner(**batch)


class HeldAutocast(WithAutocast):
    """The same, with the instance kept on the module."""

    def __init__(self, inner):
        super().__init__(inner)
        self.autocast = torch.autocast("cpu", dtype=torch.float16)

    def forward(self, **batch):
        with self.autocast:
            return self.inner(**batch)


def _model(kit, spelling):
    model = kit.build_gpt2()
    with torch.no_grad():
        model.transformer.wte.weight[kit.POISON_TOKEN] = 100.0
    model.transformer.wte = torch.nn.Sequential(model.transformer.wte, HalfScale())
    return spelling(model)


def _replay(kit, spelling) -> dict:
    session = kit.make_session(_model(kit, spelling), kit.build_batches(), trigger=NAN_LOSS)
    report = run_session(
        session,
        ReplayOptions(),
        progress=lambda *_: None,
        dump_info={"path": "memory", "run_id": "test", "step": 7, "rank": 0, "world_size": 1, "missing_ranks": []},
        history={"step": [5, 6, 7], "loss": [4.1, 4.15, float("inf")], "grad_norm": [1.1, 0.9, None]},
    )
    json.dumps(report, allow_nan=False)
    return report


def _nonfinite(report):
    return sorted(r["sample_id"] for r in report["per_sample"] if not r["finite"])


def test_the_same_step_replays_to_the_same_answer_whichever_way_autocast_is_spelled(kit):
    reports = {
        spelling.__name__: _replay(kit, spelling) for spelling in (WithAutocast, DecoratedAutocast, HeldAutocast)
    }
    baseline = reports["WithAutocast"]
    assert _nonfinite(baseline) == ["doc-1-2"], baseline["per_sample"]
    for name, report in reports.items():
        assert _nonfinite(report) == _nonfinite(baseline), (name, report["per_sample"])
        assert report["verdict"]["kind"] == baseline["verdict"]["kind"], (name, report["verdict"])
        assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["doc-1-2"], name


@pytest.mark.parametrize("spelling", [DecoratedAutocast, HeldAutocast])
def test_a_reused_autocast_is_enabled_again_after_the_fp32_pass_even_when_the_user_code_raised(kit, spelling):
    model = _model(kit, spelling)
    batch = kit.build_batches()[1]
    enter = torch.amp.autocast_mode.autocast.__enter__

    class UserBug(Exception):
        pass

    count = Fp32Count()
    with pytest.raises(UserBug):
        with held_to_fp32(count):
            model(**{k: v for k, v in batch.items() if k != "sample_ids"})
            raise UserBug("the user's loss raised")
    assert count.held_autocasts >= 1  # the pass did run in fp32
    assert torch.amp.autocast_mode.autocast.__enter__ is enter  # the class is as it was
    out = model(**{k: v for k, v in batch.items() if k != "sample_ids"})
    assert not torch.isfinite(out.logits).all()  # float16 again: the poisoned sample overflows
