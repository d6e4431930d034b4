"""A failure inside forensics never changes what the user's policy does to a faulty step (issue 49, item 2): a
dump_dir the Guard cannot use is refused when the Guard is built (or, unreachable, replaced by a local directory),
and whatever breaks while a faulty step is dumped, 'raise' raises and 'skip' skips. A repeated check() for the same
step answers what the first one did (a skipped NaN step must not then be applied)."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig
from forensics.capture.config import DumpConfig
from forensics.core.errors import TrainingFaultError
from forensics.format import open_dump

POISON = 5  # step 1, micro-batch 0


def _steps(helpers, n_steps=3):
    data = helpers.EmbedsDataset(n_steps * 4, poison=[POISON])
    return [[helpers.collate(data, [s * 4 + j * 2, s * 4 + j * 2 + 1]) for j in range(2)] for s in range(n_steps)]


def _guard(gpt2, dump_dir, policy, dumping=None):
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = GuardConfig(
        dump_dir=str(dump_dir),
        run_id="r",
        detection=DetectionConfig(on_nonfinite=policy),
        dumping=dumping or DumpConfig(),
    )
    return model, optimizer, Guard(model, optimizer, config=config)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("s3://AKIAEXAMPLE:hunter2@bucket/dumps", "password"),
        ("s3://bucket/dumps?token=abc123", "credential in its query"),
        ("memory://bucket/dumps?X-Amz-Signature=abc", "credential in its query"),
    ],
)
def test_a_dump_dir_with_a_credential_is_refused_when_the_guard_is_built(gpt2, url, words):
    with pytest.raises(ValueError, match=words) as info:
        _guard(gpt2, url, "skip")
    assert "hunter2" not in str(info.value) and "abc123" not in str(info.value)
    assert "GuardConfig.dump_dir" in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_dump_dir_whose_filesystem_is_not_installed_is_refused_when_the_guard_is_built(gpt2):
    with pytest.raises(ValueError, match=r"pip install 'forensics\[gcs\]'"):
        _guard(gpt2, "gs://bucket/dumps", "skip")


def test_an_unreachable_store_falls_back_to_a_local_directory_and_the_fault_is_dumped_there(
    helpers, gpt2, tmp_path, monkeypatch, caplog
):
    """A store that does not answer when the Guard is built (here: nothing listens on the endpoint's port): an error
    logged, the dumps go to DumpConfig.fallback_dir, and the NaN step is dumped there under 'skip'."""
    from forensics_test_helpers import free_port

    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "forensics-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "forensics-test-secret")
    fallback = tmp_path / "local-dumps"
    dumping = DumpConfig(storage_timeout=2.0, storage_retries=0, fallback_dir=str(fallback))
    model, optimizer, guard = _guard(gpt2, "s3://bucket/dumps", "skip", dumping)
    assert any(
        "cannot be used" in r.getMessage() and str(fallback) in r.getMessage()
        for r in caplog.records
        if r.levelname == "ERROR"
    )
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    loop.run(_steps(helpers))
    guard.close()
    assert [log.decision for log in loop.logs] == [True, False, True]
    assert len(guard.dumps) == 1 and open_dump(guard.dumps[0]).step == 1
    assert fallback in guard.dumps[0].parents


def test_an_unreachable_store_without_a_fallback_is_refused_when_the_guard_is_built(gpt2, monkeypatch):
    from forensics_test_helpers import free_port

    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "forensics-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "forensics-test-secret")
    dumping = DumpConfig(storage_timeout=2.0, storage_retries=0, fallback_dir=None)
    with pytest.raises(ValueError, match="fallback_dir"):
        _guard(gpt2, "s3://bucket/dumps", "skip", dumping)


def _broken(*args, **kwargs):
    raise RuntimeError("a bug inside forensics")


@pytest.mark.parametrize("where", ["write", "admit"])
def test_a_failure_inside_the_dump_keeps_the_skip_policy(helpers, gpt2, tmp_path, where, monkeypatch, caplog):
    """Before: check() logged "failed inside forensics" and returned True, so the NaN step was applied."""
    model, optimizer, guard = _guard(gpt2, tmp_path / "dumps", "skip")
    monkeypatch.setattr(guard.dumper, "_write" if where == "write" else "admit", _broken)
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    loop.run(_steps(helpers))
    guard.close()
    assert [log.decision for log in loop.logs] == [True, False, True]
    assert guard.dumps == []
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the NaN step was not applied
    assert any("a bug inside forensics" in (r.exc_text or "") or r.exc_info for r in caplog.records)


@pytest.mark.parametrize("where", ["write", "admit"])
def test_a_failure_inside_the_dump_keeps_the_raise_policy(helpers, gpt2, tmp_path, where, monkeypatch):
    model, optimizer, guard = _guard(gpt2, tmp_path / "dumps", "raise")
    monkeypatch.setattr(guard.dumper, "_write" if where == "write" else "admit", _broken)
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    with pytest.raises(TrainingFaultError, match="NO dump was written") as info:
        loop.run(_steps(helpers))
    assert info.value.dump_path is None and "forensics failed" in info.value.dump_error
    assert len(loop.logs) == 2  # stopped at the NaN step


def test_a_detection_that_breaks_keeps_the_last_decision(helpers, gpt2, tmp_path, monkeypatch):
    """Detection itself broke (no fault known): the step gets the last decision, here the skip of the NaN step."""
    model, optimizer, guard = _guard(gpt2, tmp_path / "dumps", "skip")
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    steps = _steps(helpers)
    loop.run(steps[:2])
    assert [log.decision for log in loop.logs] == [True, False]
    monkeypatch.setattr(guard.checks, "incidents", _broken)
    loop.run(steps[2:])
    guard.close()
    assert loop.logs[-1].decision is False


def test_a_repeated_check_returns_the_skip_of_the_nan_step(helpers, gpt2, tmp_path, caplog):
    """A loop that calls check() twice for the NaN step (nothing recorded, no optimizer step in between) must get the
    skip again: a True would apply the NaN step."""
    model, optimizer, guard = _guard(gpt2, tmp_path / "dumps", "skip")
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    steps = _steps(helpers)
    loop.run(steps[:2])
    assert loop.logs[-1].decision is False
    with caplog.at_level(logging.WARNING):
        again = guard.check()
    assert again is False
    assert any("check() was called again" in r.getMessage() for r in caplog.records)
    guard.close()


def test_a_repeated_check_after_a_caught_training_fault_does_not_apply_the_step(helpers, gpt2, tmp_path):
    """'raise': a loop that catches the TrainingFaultError and calls check() again for the same step gets False (it
    got True, the answer of the step before, and applied the NaN step)."""
    model, optimizer, guard = _guard(gpt2, tmp_path / "dumps", "raise")
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    steps = _steps(helpers)
    loop.run(steps[:1])
    with pytest.raises(TrainingFaultError):
        loop.run(steps[1:2])
    assert guard.check() is False
    guard.close()
