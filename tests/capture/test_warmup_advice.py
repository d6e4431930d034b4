"""The spike warm-up advice works when followed (issue 50, item 5).

With SpikeConfig(warmup=8) the Guard used to say, at the first early spike, "lower the warm-up, e.g.
SpikeConfig(warmup=8)" — the value already set — and the spikes after it (loss 4e5 -> 1e11) were never dumped nor
mentioned again. Now the advice names a warm-up that judges the spike (smaller than the current one, at most the
step where it came), or says that none can and what the smallest one catches; the later spikes of the same warm-up
are said in one line (when it ends, or when a fault comes first); and following the advice dumps them."""

from __future__ import annotations

import logging

import pytest
import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig, SpikeConfig
from forensics.capture.detection.detectors import StepDetectors
from forensics.core.errors import TrainingFaultError
from forensics.format import open_dump


def _detectors(warmup: int) -> StepDetectors:
    return StepDetectors(GuardConfig(detection=DetectionConfig(loss_spike=SpikeConfig(warmup=warmup))))


def _feed(detectors: StepDetectors, losses: list[float]) -> list:
    """Each loss as one step's; the triggers that fired."""
    fired = []
    for step, loss in enumerate(losses):
        trigger = detectors.detect([loss], 1.0, loss, None)
        detectors.note_suppressed(step, fault=trigger is not None)
        fired.append(trigger)
    return fired


def test_the_advised_warmup_is_smaller_than_the_current_one_and_catches_the_spike(caplog):
    caplog.set_level(logging.WARNING)
    losses = [4.0, 4.1, 3.9, 4.2, 4.0, 400.0, 4.1]  # a spike at step 5, inside a warm-up of 8
    assert not any(_feed(_detectors(8), losses))
    [warning] = [r.getMessage() for r in caplog.records if "warming up" in r.getMessage()]
    assert "SpikeConfig(warmup=5)" in warning and "(now 8)" in warning, warning
    fired = _feed(_detectors(5), losses)  # the advice, followed
    assert fired[5] is not None and fired[5].kind == "loss_spike"


def _gpt2_at_lr_18(tmp_path, warmup: int):
    """The issue's run: a GPT-2 of 2 layers x 32 from a config, SGD at lr 18, bf16 autocast on the CPU, eight
    samples per step; it diverges within ~10 steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=18.0)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path), run_id="lr18", detection=DetectionConfig(loss_spike=SpikeConfig(warmup=warmup))
        ),
    )
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(40):
            start, stride = torch.randint(1, 64, (8, 1), generator=gen), torch.randint(1, 6, (8, 1), generator=gen)
            ids = (start + stride * torch.arange(16)) % 63 + 1
            batch = {"input_ids": ids, "labels": ids, "sample_ids": torch.arange(8) + 8 * step}
            guard.record_batch(batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
                guard.record_loss(loss)
            loss.backward()
            if guard.check():
                optimizer.step()
            optimizer.zero_grad()
    except TrainingFaultError:
        pass
    guard.close()
    return guard


def test_following_the_advice_dumps_the_spikes_a_warmup_of_8_missed(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    guard = _gpt2_at_lr_18(tmp_path / "eight", warmup=8)
    kinds = [open_dump(p).trigger.kind for p in guard.dumps]
    assert kinds and all(not k.spike for k in kinds)  # only the NaN: the growth before it fell in the warm-up
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("forensics.capture")]
    [first] = [m for m in messages if "warming up (" in m]
    assert "SpikeConfig(warmup=8)" not in first, first  # never the value already set
    advised = int(first.split("SpikeConfig(warmup=")[1].split(")")[0])
    assert 4 <= advised < 8
    later = [m for m in messages if "more step(s) during warm-up" in m]
    assert len(later) == 1, messages  # the later spikes, said once (here the NaN came before the warm-up ended)

    followed = _gpt2_at_lr_18(tmp_path / "advised", warmup=advised)
    spikes = [d for d in map(open_dump, followed.dumps) if d.trigger.kind.spike]
    crash = max(d.step for d in map(open_dump, followed.dumps))
    assert spikes and all(d.step < crash for d in spikes), [(d.step, d.trigger.kind) for d in spikes]


@pytest.mark.parametrize("position,warmup", [(2, 8), (3, 4)])
def test_a_spike_before_any_warmup_can_judge_it_says_so(position, warmup):
    from forensics.capture.detection.detectors import warmup_advice
    from forensics.core.kinds import TriggerKind

    text = warmup_advice(TriggerKind.LOSS_SPIKE, position, warmup)
    assert "No warm-up can judge a value this early" in text
    assert f"SpikeConfig(warmup={warmup})" not in text
