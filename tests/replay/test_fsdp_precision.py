"""FSDP2's mixed precision replayed on one device (replay/load/fsdp_precision.py): parameters in each unit's
param_dtype, inputs and outputs cast as FSDP2 casts them, fp32 parameters and gradients back afterwards; and a
manifest whose `precision.fsdp` is malformed is refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from forensics.cli import main
from forensics.replay.load.fsdp_precision import FsdpUnit, compute_dtype, fsdp_compute, parse_units


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        self.seen.append(x.dtype)
        return self.linear(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.to(self.head.weight.dtype)).float().sum()


def _units(**root) -> list[FsdpUnit]:
    rows = [
        {
            "module": "",
            "param_dtype": "bfloat16",
            "reduce_dtype": "float32",
            "output_dtype": None,
            "cast_forward_inputs": True,
            **root,
        },
        {
            "module": "blocks.0",
            "param_dtype": "bfloat16",
            "reduce_dtype": "float32",
            "output_dtype": None,
            "cast_forward_inputs": True,
        },
        {
            "module": "blocks.1",
            "param_dtype": "float32",
            "reduce_dtype": "float32",
            "output_dtype": "float32",
            "cast_forward_inputs": True,
        },  # a unit kept in fp32 (a norm, a router)
        {
            "module": "no.such.module",
            "param_dtype": "float16",
            "reduce_dtype": None,
            "output_dtype": None,
            "cast_forward_inputs": True,
        },
    ]
    return parse_units(rows)


def test_each_unit_computes_in_its_dtype_and_the_fp32_parameters_come_back_with_fp32_gradients():
    torch.manual_seed(0)
    net = Net()
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    units = _units()
    assert compute_dtype(units) == torch.bfloat16
    with fsdp_compute(net, units):
        assert net.blocks[0].linear.weight.dtype == torch.bfloat16
        assert net.blocks[1].linear.weight.dtype == torch.float32  # its own unit says fp32
        assert net.head.weight.dtype == torch.bfloat16  # the root unit holds it
        loss = net(torch.randn(3, 4))
        loss.backward()
    assert net.blocks[0].seen == [torch.bfloat16]  # the root's and its unit's input cast
    assert net.blocks[1].seen == [torch.float32]
    for name, param in net.named_parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, name
        assert torch.equal(param.detach(), before[name]), name  # the fp32 masters, untouched


def test_the_parameters_come_back_when_the_step_raises():
    net = Net()
    with pytest.raises(RuntimeError, match="boom"):
        with fsdp_compute(net, _units()):
            raise RuntimeError("boom")
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert not net.blocks[0]._forward_pre_hooks


@pytest.mark.parametrize(
    "unit, field",
    [
        ({"module": 3}, "precision.fsdp[0].module"),
        ({"module": "", "param_dtype": "int8"}, "precision.fsdp[0].param_dtype"),
        ({"module": "", "cast_forward_inputs": "yes"}, "precision.fsdp[0].cast_forward_inputs"),
        ("not a unit", "precision.fsdp[0]"),
    ],
)
def test_a_malformed_fsdp_policy_in_the_manifest_exits_2_naming_the_field(helpers, tmp_path, unit, field):
    path = helpers.write_synthetic_dump(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["precision"]["fsdp"] = [unit]
    (path / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2 and field in result.output, result.output


class Rotary(torch.nn.Module):
    """A complex rotary table as a non-persistent buffer (torchtitan's Llama keeps freqs_cis so)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        angles = torch.arange(4, dtype=torch.float32)
        self.register_buffer("freqs_cis", torch.polar(torch.ones(4), angles), persistent=False)

    def forward(self, x):
        return (self.proj(x) * torch.view_as_real(self.freqs_cis)[:, 1]).sum()


def test_the_fp32_rerun_leaves_a_complex_rotary_buffer_complex():
    """The precision triage re-runs the step in fp32; a complex buffer must not be cast to real on the way (its
    imaginary part, the rotary sines, would be gone for every later replay of the step)."""
    from forensics.replay.load.session import session_from_objects
    from forensics.replay.run.execute import StepRunner

    torch.manual_seed(0)
    model = Rotary()
    table = model.freqs_cis.clone()
    session = session_from_objects(
        model,
        [{"x": torch.randn(2, 4)}],
        loss_fn=lambda m, b: m(b["x"]),
        autocast={"enabled": True, "device_type": "cpu", "dtype": "bfloat16"},
    )
    runner = StepRunner(session)
    first = runner.run().losses
    runner.run(fp32=True)
    assert model.freqs_cis.dtype == torch.complex64 and torch.equal(model.freqs_cis, table)
    assert runner.run().losses == first
