"""Trigger or cause (issue 41): a sample is blamed as bad data only with evidence about its record; the fp32 re-run
runs in float32 whatever autocast the user's own code enters, and says what ran; fed to an earlier state, a trigger is
healthy and a bad record is not.

The models here are small and the states constructed, so the tests run in seconds; the natural dumps made on a GPU
(tests/natural/test_gpu_dumps.py) are the runs nobody planted."""

from __future__ import annotations

import math

import pytest
import torch

from forensics.replay.culprits.earlier_state import EarlierState
from forensics.replay.culprits.evidence import loss_outlier, weigh
from forensics.replay.engine import ReplayOptions, run_session
from forensics.replay.judge.precision import fp32_check
from forensics.replay.load.samples import SampleRef
from forensics.replay.load.session import session_from_objects
from forensics.replay.run.execute import StepRunner

OPTIONS = ReplayOptions(device="cpu", rng_check=False, remedies=False)


class Scaled(torch.nn.Module):
    """y = (x * w) @ P: a per-feature gain `w` (the state) then a fixed mixing matrix, squared-error loss."""

    def __init__(self, gain: float, features: int = 8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((features,), gain))
        self.mix = torch.nn.Linear(features, features, bias=False)
        torch.nn.init.eye_(self.mix.weight)

    def forward(self, x, y):
        return ((self.mix(x * self.w) - y) ** 2).mean()


def loss_fn(model, batch):
    return model(batch["x"], batch["y"])


def loss_fn_in_fp16(model, batch):
    """The user's loss enters float16 autocast itself (the issue's setting: replay's own autocast is not the only one)."""
    with torch.autocast("cpu", dtype=torch.float16):
        return model(batch["x"], batch["y"])


def batches(n: int = 16, scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g) * scale
    return [
        {"x": x[:8], "y": torch.zeros(8, 8), "sample_ids": [f"s{i}" for i in range(8)]},
        {"x": x[8:], "y": torch.zeros(8, 8), "sample_ids": [f"s{i}" for i in range(8, 16)]},
    ]


def session(model, data, fn=loss_fn, autocast=None, trigger=None):
    return session_from_objects(
        model,
        data,
        loss_fn=fn,
        device="cpu",
        autocast={"enabled": autocast is not None, "device_type": "cpu", "dtype": autocast},
        trigger=trigger or {"kind": "nonfinite_loss", "micro_batch": 0},
    )


@pytest.mark.parametrize("recorded", ["float16", None])
def test_a_loss_that_enters_fp16_autocast_itself_gets_a_real_fp32_pass(recorded):
    """Recorded or not, the job's fp16 comes from the user's loss; the fp32 re-run must not run in fp16."""
    model = Scaled(gain=1e5)  # the matmul gives x * 1e5: beyond fp16's 65504 for |x| > 0.66, fine in fp32
    runner = StepRunner(session(model, batches(), fn=loss_fn_in_fp16, autocast=recorded))
    assert not runner.run().loss_finite  # the job's own step: inf in fp16

    block = fp32_check(runner)

    ran = block["fp32_ran"]
    assert ran["verified"] is True and ran["ops"].get("float16", 0) == 0 and ran["ops"]["float32"] > 0
    assert ran["held_autocasts"] >= 1  # the user's autocast, entered disabled
    assert block["fp32_reproduces"] is False  # finite in fp32: a precision problem
    if recorded is None:
        assert block["code_dtypes"].get("float16", 0) > 0  # found out from what the code computes


def test_the_verdict_says_what_the_fp32_pass_ran_and_blames_no_data():
    model = Scaled(gain=1e5)
    report = run_session(session(model, batches(), fn=loss_fn_in_fp16, autocast="float16"), OPTIONS)
    assert report["verdict"]["kind"] == "numerical_precision", report["verdict"]["headline"]
    assert "checked:" in report["verdict"]["explanation"] and "none in float16" in report["verdict"]["explanation"]
    assert report["culprit"]["samples"] == []  # the whole batch overflows in fp16: no sample named
    assert not any(s.startswith("Filter") for s in report["verdict"]["suggestions"])


def peak_loss(model, batch):
    """The largest squared output (a loss with no sum to overflow first: each sample meets the limit alone)."""
    return (model.mix(batch["x"] * model.w) ** 2).amax()


def edge_state():
    """A state at the edge of float32: every sample's largest squared output sits within a few x of overflow, the
    largest ordinary (Gaussian) sample crosses. The earlier state (gain 1) is healthy for every sample."""
    data = batches(seed=3)
    x = torch.cat([b["x"] for b in data])
    per_sample = x.abs().amax(1)
    largest = float(per_sample.max())
    second = float(per_sample.sort().values[-2])
    limit = math.sqrt(torch.finfo(torch.float32).max)  # a square above this overflows
    gain = limit / math.sqrt(largest * second)  # the largest crosses, the second stays below
    return Scaled(gain), data, int(per_sample.argmax())


def test_an_ordinary_sample_crossing_first_on_a_state_at_the_edge_is_a_trigger_not_bad_data():
    model, data, crossing = edge_state()
    report = run_session(session(model, data, fn=peak_loss), OPTIONS)
    verdict = report["verdict"]
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [f"s{crossing}"]  # bisection finds it
    assert verdict["kind"] == "trigger_sample", verdict["headline"]
    assert report["evidence"]["bad_data"] is False and report["evidence"]["against"] == []
    assert report["culprit"]["samples"][0]["trigger"] is True
    assert "no sample is to blame" in verdict["headline"]
    assert not any(s.startswith("Filter") for s in verdict["suggestions"])


def test_fed_to_an_earlier_state_the_trigger_is_healthy_and_the_report_says_so():
    model, data, crossing = edge_state()
    earlier = EarlierState({"w": torch.ones(8), "mix.weight": torch.eye(8)}, step=40, source="a checkpoint")
    report = run_session(
        session(model, data, fn=peak_loss), OPTIONS, dump_info={"step": 104, "rank": 0}, earlier=earlier
    )
    assert report["verdict"]["kind"] == "trigger_sample"
    said = report["evidence"]["earlier_state"]
    assert said.startswith("Fed to a checkpoint, 64 steps earlier") and "is healthy" in said and "the state" in said
    assert said in report["verdict"]["explanation"]


def test_a_record_that_breaks_any_state_is_still_bad_data_and_the_earlier_state_confirms_it():
    data = batches(seed=3)
    data[1]["x"][2, 4] = float("inf")  # s10: a corrupt reading (an Inf in its features)
    model = Scaled(gain=1.0)
    earlier = EarlierState({"w": torch.full((8,), 0.5), "mix.weight": torch.eye(8)}, step=10, source="a checkpoint")
    report = run_session(session(model, data), OPTIONS, dump_info={"step": 20, "rank": 0}, earlier=earlier)
    assert report["verdict"]["kind"] == "bad_sample", report["verdict"]["headline"]
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["s10"]
    kinds = {e["kind"] for e in report["evidence"]["against"]}
    assert {"record_data", "earlier_state"} <= kinds
    assert "the data, not the state" in report["evidence"]["earlier_state"]


def test_a_sample_that_alone_goes_non_finite_far_from_the_limit_is_bad_data():
    """A log(0) its record causes: the other samples are ordinary and far from float32's limit."""
    data = batches(seed=3)
    data[0]["y"][5] = -1.0  # s5's target: a value the loss takes the log of below zero

    def log_loss(model, batch):
        out = model.mix(batch["x"] * model.w)
        return (torch.log(batch["y"] + 1.0) + out**2).mean()  # log(0) = -inf for s5 only

    report = run_session(session(Scaled(1.0), data, fn=log_loss), OPTIONS)
    assert report["verdict"]["kind"] == "bad_sample", report["verdict"]["headline"]
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["s5"]
    assert [e["kind"] for e in report["evidence"]["against"]] in (
        ["nonfinite_alone"],
        ["record_data"],
        ["record_data", "nonfinite_alone"],
    )


@pytest.mark.parametrize(
    "loss, others, outlier",
    [
        (4.198, [4.10, 4.12, 4.15, 4.17, 4.2, 4.24], False),  # issue 41's trigger: ordinary loss
        (9.7, [4.10, 4.12, 4.15, 4.17, 4.2, 4.24], True),  # a mislabeled target
        (4.5, [0.5, 1.0, 4.4, 2.0, 3.0], False),  # spread losses: the largest is not an outlier
        (math.inf, [4.1, 4.2, 4.3], False),  # a non-finite loss is not a loss outlier
        (9.0, [4.1, 4.2], False),  # too few others to tell
    ],
)
def test_the_loss_outlier_rule(loss, others, outlier):
    assert loss_outlier(loss, others) is outlier


@pytest.mark.parametrize("culprit_loss, evidence", [(40.0, True), (4.4, False)])
def test_a_loss_far_above_the_healthy_level_is_evidence_and_one_at_that_level_is_not(culprit_loss, evidence):
    """The healthy samples' losses sit tightly at 4.0 (every record of the step replayed alone); a record at ten times
    that is a mislabeled or garbage target; one at 4.4 is an ordinary record, however many of the others' tiny
    deviations it is away from them (the ratio, not only the robust spread, decides)."""
    healthy = [3.98, 3.99, 4.0, 4.0, 4.01, 4.02, 3.99]
    rows = [
        {"micro_batch": 0, "index": i, "sample_id": f"s{i}", "loss": v, "grad_norm": 1.0} for i, v in enumerate(healthy)
    ]
    rows.append({"micro_batch": 0, "index": 7, "sample_id": "s7", "loss": culprit_loss, "grad_norm": 9.0})
    culprit = SampleRef(0, 7, "s7")
    found = weigh([culprit], rows, {}, nonfinite_trigger=False, full_precision=False, isolated=True)
    assert found.bad_data is evidence
    assert [e.sample_id for e in found.against] == (["s7"] if evidence else [])


class HalfInside(torch.nn.Module):
    """A forward that casts to float16 itself (`.half()` on its input and weight), as some custom kernels do."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, bias=False)
        torch.nn.init.constant_(self.lin.weight, 3e4)

    def forward(self, x, y):
        out = torch.nn.functional.linear(x.half(), self.lin.weight.half())  # 3e4 x sum(x): beyond 65504
        return ((out.float() - y) ** 2).mean()


def test_casts_to_float16_inside_the_forward_are_held_to_fp32_and_counted():
    runner = StepRunner(session(HalfInside(), batches()))
    assert not runner.run().loss_finite
    block = fp32_check(runner)
    assert block["code_dtypes"]["float16"] > 0  # the dump says nothing of fp16: the code does it
    ran = block["fp32_ran"]
    assert ran["verified"] and ran["held_casts"] >= 2 and ran["ops"].get("float16", 0) == 0
    assert block["fp32_reproduces"] is False


# -- a NaN gradient norm replayed finite and far out of range (verdict_facts.diverged_here): state or data? -------------
HEALTHY_HISTORY = {
    "step": [0, 1, 2, 3, 4],
    "loss": [1.0, 0.98, 1.02, 0.97, None],
    "grad_norm": [1.1, 0.9, 1.0, 1.05, None],
}


def _diverged_report(
    gain: float, scale: float, earlier_gain: float | None, history: dict = HEALTHY_HISTORY, earlier_step: int = 0
) -> dict:
    """The job's step 4: a NaN gradient norm with a finite loss (its kernels overflowed), replayed here finite but huge;
    `earlier_gain`: the Guard's host snapshot of step 0 fed to the replay (None: no snapshot)."""
    model, data = Scaled(gain=gain), batches(scale=scale)
    with torch.no_grad():
        losses = [float(loss_fn(model, b)) for b in data]
    run = session_from_objects(
        model,
        data,
        loss_fn=loss_fn,
        device="cpu",
        trigger={"kind": "nonfinite_grad", "value": math.nan},
        recorded_losses=losses,
    )
    earlier = (
        EarlierState(
            {"w": torch.full((8,), earlier_gain), "mix.weight": torch.eye(8)},
            earlier_step,
            f"the host snapshot of step {earlier_step}",
        )
        if earlier_gain is not None
        else None
    )
    return run_session(run, OPTIONS, dump_info={"step": 4}, history=history, earlier=earlier)


def test_a_diverged_step_whose_samples_are_healthy_on_the_snapshot_is_the_broken_state():
    report = _diverged_report(gain=1e4, scale=1.0, earlier_gain=1.0)  # weights blown up, ordinary records
    assert not report["reproduced"] and report["verdict"]["kind"] == "model_state", report["verdict"]["headline"]
    diverged = report["fidelity"]["diverged"]
    assert "host snapshot of step 0" in diverged["earlier_state"] and diverged["earlier_largest_grad_norm"] < 1000
    assert "not the data" in report["verdict"]["headline"] and not report["culprit"]["samples"]


def test_a_diverged_step_whose_samples_diverge_on_the_snapshot_too_blames_neither_state_nor_a_record():
    """Every record of the batch unnormalised (x 1e4) on ordinary weights: each sample alone diverges on the snapshot
    of step 0 too, so the state is not to blame; no record evidence either, so no sample is named."""
    report = _diverged_report(gain=1.0, scale=1e4, earlier_gain=1.0)
    verdict = report["verdict"]
    assert verdict["kind"] == "not_reproduced" and "diverged" not in report["fidelity"], verdict["headline"]
    assert "host snapshot of step 0" in verdict["explanation"] and "no sample is named" in verdict["explanation"]
    assert not report["culprit"]["samples"] and (report.get("evidence") or {}).get("bad_data") in (None, False)


def test_a_diverged_step_with_no_snapshot_stays_the_state_and_names_the_test_that_would_tell():
    report = _diverged_report(gain=1.0, scale=1e4, earlier_gain=None)  # the same bad batch, nothing to tell it by
    verdict = report["verdict"]
    assert verdict["kind"] == "model_state" and report["fidelity"]["diverged"]["earlier_state"] is None
    assert "not the data" not in verdict["headline"]
    assert any("snapshot_every" in s for s in verdict["suggestions"]), verdict["suggestions"]


def test_a_snapshot_from_after_the_loss_left_its_start_is_no_counterfactual():
    """The loss left its start at step 3 and the snapshot is of step 3: the samples failing there says nothing about
    the records (that state was diverging too), so it is not fed, and the verdict says no earlier state ran."""
    history = {**HEALTHY_HISTORY, "loss": [1.0, 0.98, 1.02, 5e3, None], "grad_norm": [1.1, 0.9, 1.0, 4e3, None]}
    report = _diverged_report(gain=1e4, scale=1.0, earlier_gain=1e4, history=history, earlier_step=3)
    verdict = report["verdict"]
    assert verdict["kind"] == "model_state" and report["fidelity"]["diverged"]["earlier_state"] is None
    assert any("snapshot_every" in s for s in verdict["suggestions"]), verdict["suggestions"]
