"""StepRunner: bitwise reproduction with restored RNG, resets between runs, subsets keep the
original loss normalisation, loss scaling, trigger semantics, fidelity when nothing fails."""

import math

import pytest
import torch

from forensics.core.rng import restore_rng
from forensics.replay.load.samples import select_samples
from forensics.replay.run.execute import SampleRef, StepResult, StepRunner, reproduce


def test_restored_rng_reproduces_dropout_dependent_step_bitwise(kit):
    model = kit.build_gpt2(dropout=0.2)
    session = kit.make_session(model, kit.build_batches(poison=False))
    runner = StepRunner(session)

    rep = reproduce(runner)

    assert rep.fidelity["mode"] == "bitwise"
    assert rep.fidelity["bitwise_equal"] is True
    assert rep.fidelity["replayed_losses"] == session.recorded_losses
    assert rep.fidelity["replayed_grad_norm"] == session.recorded_grad_norm
    # the RNG is what makes it bitwise: without restoring it dropout draws other masks
    other = runner.run(restore_rng=False)
    assert other.losses != session.recorded_losses


def test_every_run_starts_from_pre_step_weights(kit):
    model = kit.build_gpt2()
    session = kit.make_session(model, kit.build_batches(poison=False))
    runner = StepRunner(session)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    first = runner.run(keep_grads=True)
    with torch.no_grad():  # someone (an optimizer check) changes the live weights
        for p in model.parameters():
            p.add_(1.0)
    second = runner.run()

    assert first.losses == second.losses and first.grad_norm == second.grad_norm
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_subset_keeps_the_recorded_divisor_and_skips_empty_micro_batches(kit):
    model = kit.build_gpt2()
    batches = kit.build_batches(poison=False)
    session = kit.make_session(model, batches)
    runner = StepRunner(session)

    result = runner.run([SampleRef(1, 2, "doc-1-2"), SampleRef(1, 0, "doc-1-0")])

    # by hand: micro-batch 1 restricted to samples 0 and 2, same RNG, divided by the step's divisor (2)
    model.zero_grad(set_to_none=True)
    restore_rng(session.rng_states[1])
    loss = kit.hf_loss(model, select_samples(session.micro_batches[1], [0, 2]))
    (loss / 2).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    model.zero_grad(set_to_none=True)
    assert result.losses == [None, float(loss.detach())]
    assert result.grad_norm == float(expected)


def test_loss_scale_is_applied_and_removed_like_grad_scaler(kit):
    model = kit.build_gpt2(dropout=0.0)
    batches = kit.build_batches(poison=False)
    plain = StepRunner(kit.make_session(model, batches, record=False)).run()
    scaled = StepRunner(
        kit.make_session(model, batches, record=False, scaler_state={"scale": 1024.0, "growth_factor": 2.0})
    ).run()
    # a power-of-two scale multiplies and divides exactly: the gradients are bitwise the same
    assert scaled.grad_norm == plain.grad_norm and scaled.losses == plain.losses


def test_fp32_run_puts_every_tensor_back_in_its_own_dtype(kit):
    model = kit.build_gpt2().to(torch.bfloat16)
    model.transformer.ln_f.float()  # mixed precision: a norm kept in fp32
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    session = kit.make_session(model, kit.build_batches(poison=False), record=False)
    runner = StepRunner(session)
    result = runner.run(fp32=True)
    assert result.fp32 and math.isfinite(result.grad_norm)
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes
    assert runner.run().grad_norm != result.grad_norm  # and the bf16 run really is another computation


def test_trigger_semantics(kit):
    r = StepResult(
        losses=[1.0, 3.0],
        grad_norm=5.0,
        loss_finite=True,
        grads_finite=True,
        params_finite=True,
        step_loss=2.0,
        micro_batches_run=2,
        micro_batches_total=2,
    )
    assert not r.trigger_reproduced("nonfinite_loss")
    assert r.trigger_reproduced("loss_spike", 1.5) and not r.trigger_reproduced("loss_spike", 2.5)
    assert r.trigger_reproduced("grad_norm_spike", 4.0) and not r.trigger_reproduced("grad_norm_spike", 6.0)
    # a run of one micro-batch of two stands for a step twice its (divisor-diluted) size
    half = StepResult(
        losses=[None, 3.0],
        grad_norm=2.5,
        loss_finite=True,
        grads_finite=True,
        params_finite=True,
        step_loss=1.5,
        micro_batches_run=1,
        micro_batches_total=2,
    )
    assert half.comparable_loss == 3.0 and half.comparable_grad_norm == 5.0
    assert half.trigger_reproduced("loss_spike", 2.5) and half.trigger_reproduced("grad_norm_spike", 4.0)
    bad = StepResult(
        losses=[float("nan")], grad_norm=float("nan"), loss_finite=False, grads_finite=False, params_finite=False
    )
    assert all(bad.trigger_reproduced(k) for k in ("nonfinite_loss", "nonfinite_grad", "nonfinite_param"))


def test_not_reproduced_reports_the_numbers(kit):
    model = kit.build_gpt2()
    session = kit.make_session(
        model,
        kit.build_batches(poison=False),
        trigger={"kind": "nonfinite_loss", "value": float("nan"), "micro_batch": 1},
    )
    rep = reproduce(StepRunner(session), max_attempts=3)
    assert rep.reproduced is False
    assert rep.attempts == 1  # CPU is deterministic: a second try would give the same numbers
    assert all(math.isfinite(v) for v in rep.fidelity["replayed_losses"])
    assert rep.fidelity["recorded_losses"] == session.recorded_losses


def test_poisoned_step_reproduces_nonfinite_loss(kit):
    model = kit.build_gpt2()
    with torch.no_grad():
        model.transformer.wte.weight[63] = float("inf")
    session = kit.make_session(model, kit.build_batches(), trigger={"kind": "nonfinite_loss", "micro_batch": 1})
    rep = reproduce(StepRunner(session))
    assert rep.reproduced
    assert math.isfinite(rep.result.losses[0]) and math.isnan(rep.result.losses[kit.POISONED[0]])
    assert rep.fidelity["bitwise_equal"]  # nan == nan for fidelity purposes


def test_multi_rank_dump_compares_losses_only(kit):
    """The job's grad norm covers every rank; one rank replayed alone is judged on its losses."""
    from forensics.report import render_verdict_text
    from forensics.replay.engine import ReplayOptions, run_session

    session = kit.make_session(
        kit.build_gpt2(dropout=0.0),
        kit.build_batches(poison=False),
        trigger={"kind": "nonfinite_loss", "value": None, "threshold": None, "micro_batch": None},
    )
    session.recorded_grad_norm = session.recorded_grad_norm * 0.7  # another value (not x a recorded factor)
    alone = reproduce(StepRunner(session)).fidelity
    assert alone["bitwise_equal"] is False and alone["grad_norm_compared"] is True

    session.world_size = 2
    fidelity = reproduce(StepRunner(session)).fidelity
    assert fidelity["bitwise_equal"] is True
    assert fidelity["grad_norm_compared"] is False and "2 ranks" in fidelity["grad_norm_reason"]
    assert fidelity["recorded_grad_norm"] != fidelity["replayed_grad_norm"]

    poisoned = kit.make_session(kit.build_gpt2(dropout=0.0), kit.build_batches(poison=True), loss_fn=kit.log_zero_loss)
    poisoned.recorded_grad_norm, poisoned.world_size = 3.0, 4  # finite all-rank norm, NaN on this rank
    report = run_session(
        poisoned, ReplayOptions(device="cpu", bisect=False, fp32_check=False, rng_check=False, max_per_sample=0)
    )
    assert report["reproduced"] is True and report["fidelity"]["bitwise_equal"] is True
    assert report["dump"]["world_size"] == 4
    assert "Grad norm not compared: the recorded grad norm covers all 4 ranks" in render_verdict_text(report)


def test_any_nonfinite_is_exact_where_a_sum_overflows_or_cancels():
    from forensics.replay.run.execute import any_nonfinite

    cases = {
        "finite values whose fp32 sum overflows": (torch.full((10,), 3e38), False),
        "fp16 at its maximum": (torch.tensor([65504.0, 65504.0]).half(), False),
        "float64 beyond fp32's range": (torch.tensor([1e308, 1e308], dtype=torch.float64), False),
        "+inf and -inf": (torch.tensor([float("inf"), -float("inf")]), True),
        "one NaN in bf16": (torch.tensor([1.0, float("nan")]).bfloat16(), True),
        "empty": (torch.zeros(0, 3), False),
        "integers": (torch.tensor([1, 2]), False),
        "complex with a NaN": (torch.tensor([1 + 1j, complex("nan")]), True),
    }
    flags = any_nonfinite(t for t, _ in cases.values())
    assert dict(zip(cases, flags)) == {name: expected for name, (_, expected) in cases.items()}


@pytest.mark.parametrize("where", [0, 9_999, 5_000])
def test_any_nonfinite_finds_a_nan_anywhere_in_a_tensor_whose_sum_overflows(where):
    """A NaN first, last or in the middle of a tensor whose finite values' sum overflows is found, in the tensor and
    in strided views of it; the finite values alone are not taken for one."""
    from forensics.replay.run import execute

    overflowing = torch.full((10_000,), 3e38)
    poisoned = overflowing.clone()
    poisoned[where] = float("nan")
    strided = poisoned[::2]  # not contiguous
    transposed = poisoned.view(100, 100).t()
    assert execute.any_nonfinite([overflowing, poisoned, strided, transposed]) == [False, True, where % 2 == 0, True]


def test_nonfinite_flags_read_once_name_what_any_nonfinite_names():
    """A streamed backward flags each block gradient on the device (nonfinite_flag: no sync, no mask of its size) and
    reads the flags once, when asked: the same names any_nonfinite gives, for the cases where a sum misleads."""
    from forensics.replay.run.execute import NonfiniteNames, any_nonfinite, nonfinite_flag

    cases = {
        "sum overflows, finite": torch.full((10,), 3e38),
        "fp16 at its maximum": torch.tensor([65504.0, 65504.0]).half(),
        "+inf and -inf": torch.tensor([float("inf"), -float("inf")]),
        "one NaN in bf16": torch.tensor([1.0, float("nan")]).bfloat16(),
        "-inf alone": torch.tensor([0.0, -float("inf")]),
        "NaN in a strided view": torch.randn(8, 8).index_fill_(1, torch.tensor([3]), float("nan"))[:, 1::2],
        "empty": torch.zeros(0, 3),
        "integers": torch.tensor([1, 2]),
        "complex with a NaN": torch.tensor([1 + 1j, complex("nan")]),
    }
    names = NonfiniteNames()
    names.add("known before")
    for name, tensor in cases.items():
        names.add_flag(name, nonfinite_flag(tensor))
    expected = {n for n, bad in zip(cases, any_nonfinite(cases.values())) if bad} | {"known before"}
    assert set(names) == expected and len(expected) == 6
    assert "one NaN in bf16" in names and "sum overflows, finite" not in names
    names.clear()
    assert len(names) == 0
