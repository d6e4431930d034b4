"""Dumps written and read on cuda:1 hold exactly the job's tensors, element by element (2 GPUs; skipped elsewhere).

The bug this guards against: a writer thread's current CUDA device is 0 whatever the job chose, so a copy of a
cuda:1 tensor into the reused pinned staging buffer ran on cuda:1's stream while its completion event was recorded
on cuda:0's; the file then held the buffer's previous contents (the LayerNorm weights written just before), and its
sha256 was taken of those stale bytes, so it verified. A hash of stale bytes verifies: these tests compare values.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, RecordConfig, SpikeConfig
from forensics.format import open_dump, verify_dump

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (the job runs on cuda:1)",
)

WIDTH = 4096  # a 4096 x 4096 fp32 weight is 64 MiB (one staging chunk); LayerNorm vectors of 16 KiB between them
DUMPS = 20


class Mixed(nn.Module):
    """LayerNorm-sized tensors next to 64 MiB ones, every value distinct (a stale byte cannot go unseen)."""

    def __init__(self, blocks: int = 3):
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(blocks) for m in (nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))])
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).float().pow(2).mean()


def _host_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    moments = {
        names[id(p)]: {k: v.detach().cpu().clone() for k, v in s.items() if torch.is_tensor(v)}
        for p, s in optimizer.state.items()
    }
    return weights, moments


def _assert_dump_holds(path, weights: dict, moments: dict, device: str = "cpu") -> None:
    dump = open_dump(path)
    seen = 0
    for name, tensor in dump.iter_model_tensors(device):
        assert str(tensor.device) == device
        expected = weights[name].to(device)
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
        assert torch.equal(tensor, expected), (
            f"{path}: {name} differs from the job's tensor "
            f"({int((tensor != expected).sum())} of {tensor.numel()} elements)"
        )
        seen += 1
    assert seen == len(weights)
    for name, state in moments.items():
        stored = dump.optimizer_tensors(name, device)
        for key, expected in state.items():
            assert torch.equal(stored[key], expected.to(device)), f"{path}: optimizer {name}/{key} differs"


def test_twenty_dumps_from_cuda1_match_the_job_element_by_element_and_read_back_on_cuda1(tmp_path):
    torch.cuda.set_device(1)
    device = torch.device("cuda", 1)
    torch.manual_seed(0)
    model = Mixed().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path),
            run_id="cuda1",
            detection=DetectionConfig(on_nonfinite="skip"),
            dumping=DumpConfig(max_dumps=DUMPS + 1),
            recording=RecordConfig(capture_exceptions=False),
        ),
    )
    checked = 0
    for step in range(DUMPS + 2):
        x = torch.randn(8, WIDTH, device=device)
        if step >= 2:
            x[0, 0] = float("nan")  # a NaN loss: dumped, step skipped (weights stay; moments differ per tensor)
        guard.record_batch({"x": x}, sample_ids=[f"s{step}-{i}" for i in range(8)])
        loss = model(x)
        guard.record_loss(loss)
        loss.backward()
        weights, moments = _host_state(model, optimizer)
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
        if step >= 2:
            path = guard.dumps[-1]
            assert verify_dump(path).ok
            _assert_dump_holds(path, weights, moments)
            if step == DUMPS + 1:  # the reader onto cuda:1 (replay --device cuda:1), element by element
                _assert_dump_holds(path, weights, moments, device="cuda:1")
            shutil.rmtree(path)
            checked += 1
    guard.close()
    assert checked == DUMPS


def test_background_spike_dumps_from_cuda1_hold_the_pre_step_state(tmp_path):
    """Spike dumps are written by the background thread from device clones while training goes on."""
    torch.cuda.set_device(1)
    device = torch.device("cuda", 1)
    torch.manual_seed(1)
    model = Mixed(blocks=2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spikes = {12, 16}
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path),
            run_id="spikes",
            detection=DetectionConfig(loss_spike=SpikeConfig(warmup=4), grad_norm_spike=SpikeConfig(enabled=False)),
            dumping=DumpConfig(min_spike_gap=1, max_dumps=4),
            recording=RecordConfig(capture_exceptions=False),
        ),
    )
    expected = {}
    for step in range(20):
        x = torch.randn(8, WIDTH, device=device)
        guard.record_batch({"x": x}, sample_ids=[f"s{step}-{i}" for i in range(8)])
        loss = model(x)
        guard.record_loss(loss * (1e4 if step in spikes else 1.0))
        loss.backward()
        if step in spikes:
            expected[step] = _host_state(model, optimizer)
        guard.check()
        optimizer.step()  # the spike step is applied (policy continue) while the dump is written
        optimizer.zero_grad()
    guard.close()
    assert sorted(open_dump(p).step for p in guard.dumps) == sorted(spikes)
    for path in guard.dumps:
        assert verify_dump(path).ok
        _assert_dump_holds(path, *expected[open_dump(path).step])
