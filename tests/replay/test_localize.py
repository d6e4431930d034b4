"""Localisation on a real tiny GPT-2: forward module/op (incl. the loss's own aten::log), -inf masks,
backward anomaly (module, op, parameter, traceback), the optimizer update (Adam eps=0), per-layer stats,
and the fp32 triage of an fp16 overflow."""

import math

import pytest
import torch
import torch.nn.functional as F

from forensics.replay.judge.precision import fp32_check
from forensics.replay.localize.forward_backward import (
    LOSS_MODULE,
    MASK_OPS,
    localize_backward,
    localize_forward,
    node_to_op,
)
from forensics.replay.localize.update import localize_optimizer, per_layer_stats
from forensics.replay.run.execute import SampleRef, StepRunner


def poisoned_embedding_model(kit, value=float("inf")):
    model = kit.build_gpt2()
    with torch.no_grad():
        model.transformer.wte.weight[kit.POISON_TOKEN] = value
    return model


def test_forward_names_the_embedding_whose_weight_row_is_inf(kit):
    runner = StepRunner(kit.make_session(poisoned_embedding_model(kit), kit.build_batches(), record=False))

    finding = localize_forward(runner)

    assert finding.module == "transformer.wte"
    assert finding.op == "aten::embedding"
    assert finding.micro_batch == kit.POISONED[0]
    assert finding.nonfinite_inputs == ["transformer.wte.weight"]
    assert finding.stats["params_absmax"] == math.inf


def test_forward_names_aten_log_in_a_custom_loss(kit):
    runner = StepRunner(
        kit.make_session(kit.build_gpt2(), kit.build_batches(), loss_fn=kit.log_zero_loss, record=False)
    )

    finding = localize_forward(runner)

    assert (finding.module, finding.op, finding.phase) == (LOSS_MODULE, "aten::log", "forward")
    assert finding.op_inputs_finite is True
    assert finding.micro_batch == kit.POISONED[0]
    # only the poisoned sample makes it: the others alone are finite
    assert localize_forward(runner, [SampleRef(1, 0), SampleRef(1, 1)]) is None


def masked_softmax_loss(model, batch):
    scores = model(input_ids=batch["input_ids"]).logits
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[..., ::2] = True
    return scores.masked_fill(mask, float("-inf")).log_softmax(-1).amax(-1).mean()


def test_neg_inf_from_mask_ops_is_allowed_unless_asked(kit):
    runner = StepRunner(
        kit.make_session(kit.build_gpt2(), kit.build_batches(poison=False), loss_fn=masked_softmax_loss, record=False)
    )
    assert runner.run(backward=False).loss_finite
    assert localize_forward(runner) is None
    strict = localize_forward(runner, allow_neg_inf_masks=False)
    # strict: the first -inf is GPT-2's own causal attention mask, made by a mask op
    assert strict.op in MASK_OPS and strict.module == "transformer.h.0.attn"


class WhereSqrt(torch.nn.Module):
    """gelu where x > -1e4, else sqrt(x): forward finite, but sqrt of the negative inputs it discards
    is NaN, and where's backward multiplies that NaN by 0 -> NaN gradients (the classic where-NaN)."""

    def forward(self, x):
        return torch.where(x > -1e4, F.gelu(x), torch.sqrt(x))


def test_backward_names_module_op_parameter_and_forward_traceback(kit):
    model = kit.build_gpt2()
    model.transformer.h[1].mlp.act = WhereSqrt()
    runner = StepRunner(kit.make_session(model, kit.build_batches(poison=False), record=False))
    result = runner.run()
    assert result.loss_finite and not result.grads_finite

    finding = localize_backward(runner)

    assert finding.module == "transformer.h.1.mlp.act"
    assert finding.op == "aten::sqrt" and finding.backward_node == "SqrtBackward0"
    # the first parameter to receive a NaN gradient in backward is the one feeding the act
    assert finding.parameter == "transformer.h.1.mlp.c_fc.bias"
    assert finding.first_parameter_in_order == "transformer.wte.weight"
    assert "torch.sqrt(x)" in finding.traceback
    assert all(p.grad is None for p in model.parameters())  # hooks gone, state reset


def test_node_to_op():
    assert node_to_op("NativeLayerNormBackward0") == "aten::native_layer_norm"
    assert node_to_op("LogBackward0") == "aten::log"
    assert node_to_op("torch::autograd::AccumulateGrad") is None


def test_optimizer_update_names_parameter_and_state_for_adam_eps_zero(kit):
    model = kit.build_gpt2()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    runner = StepRunner(kit.make_session(model, kit.build_batches(poison=False), optimizer=optimizer, record=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    finding = localize_optimizer(runner)

    # position rows beyond the sequence length (8 of 32) never get a gradient: exp_avg_sq stays 0
    assert "transformer.wpe.weight" in finding.parameters
    assert "exp_avg_sq is 0 and eps is 0: 0/0" in finding.explanations["transformer.wpe.weight"]
    assert finding.optimizer_class == "torch.optim.adam.Adam"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert optimizer.state == {}  # the job's optimizer was never stepped

    healthy = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    runner = StepRunner(kit.make_session(model, kit.build_batches(poison=False), optimizer=healthy, record=False))
    assert localize_optimizer(runner) is None


def test_per_layer_stats_show_the_inf_embedding(kit):
    runner = StepRunner(kit.make_session(poisoned_embedding_model(kit, 1e4), kit.build_batches(), record=False))
    rows = {r["module"]: r for r in per_layer_stats(runner)}
    assert rows["transformer.wte"]["output_absmax"] == pytest.approx(1e4)
    assert rows["transformer.h.0.mlp.c_fc"]["grad_norm"] > 0
    assert rows["transformer.drop"]["grad_norm"] is None  # no parameters of its own


class HalfScale(torch.nn.Module):
    """Multiplies its input by 1e3 in the autocast dtype (fp16 overflows above 65504)."""

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            return (x.to(torch.get_autocast_dtype("cpu")) * 1e3).float() / 1e3
        return x * 1e3 / 1e3


def test_fp16_overflow_is_localised_and_vanishes_in_fp32(kit):
    model = poisoned_embedding_model(kit, 100.0)  # finite, but 100 * 1e3 > 65504
    model.transformer.wte = torch.nn.Sequential(model.transformer.wte, HalfScale())
    runner = StepRunner(
        kit.make_session(
            model,
            kit.build_batches(),
            autocast_dtype=torch.float16,
            record=False,
            trigger={"kind": "nonfinite_loss", "micro_batch": 1},
        )
    )
    assert not runner.run().loss_finite

    finding = localize_forward(runner)
    assert (finding.module, finding.op) == ("transformer.wte.1", "aten::mul")
    assert finding.op_inputs_finite is True
    assert finding.op_stats["inputs_absmax"] == pytest.approx(100.0)

    culprit = [SampleRef(*kit.POISONED)]
    block = fp32_check(runner, culprit)
    ran = block.pop("fp32_ran")
    assert block == {
        "autocast_dtype": "float16",
        "fp32_reproduces": False,
        "param_dtype": "float32",
        "grad_scaler": False,
    }
    assert ran["verified"] and ran["ops"]["float32"] > 0 and set(ran["ops"]) == {"float32"}  # it ran as it says
    assert runner.run(culprit).trigger_reproduced("nonfinite_loss")  # still fails under fp16


def test_a_batch_input_that_is_already_non_finite_is_named_as_the_source(kit):
    """A NaN already in `inputs_embeds` is the data's fault: it is named, not the first module it reaches."""
    from forensics.replay.localize.forward_backward import INPUT_MODULE, localize_forward
    from forensics.replay.run.execute import StepRunner

    model = kit.build_gpt2()
    batches = [
        {
            "inputs_embeds": model.transformer.wte(b["input_ids"]).detach(),
            "labels": b["labels"],
            "sample_ids": b["sample_ids"],
        }
        for b in kit.build_batches(poison=False)
    ]
    batches[1]["inputs_embeds"][2, 3, 0] = float("nan")

    def embeds_loss(m, batch):
        return m(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss

    session = kit.make_session(model, batches, loss_fn=embeds_loss)
    finding = localize_forward(StepRunner(session))
    assert finding.module == f"{INPUT_MODULE}.inputs_embeds" and finding.micro_batch == 1
    assert finding.op_inputs_finite is False
