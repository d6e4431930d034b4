"""An exception after the optimizer update (issue 22, item 4): the user's batch building raises an IndexError
after check() and optimizer.step(). The Guard knows the optimizer stepped (its step hooks), so the dump says
"between steps (data loading or user code)", holds the updated weights as the NEXT step's pre-step state
under that step's number, and replay names the exception and the line of the user's code instead of
"not reproduced"."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from forensics.capture import Guard, GuardConfig
from forensics.capture.raised.optimizer_steps import OptimizerSteps, torch_optimizer
from forensics.cli import main
from forensics.format import open_dump, verify_dump

WIDTH, SAMPLES = 6, 20


def build_batch(data: torch.Tensor, order: list[int], step: int) -> dict:
    """The user's batch building: step 5 asks for rows past the end of the data (the IndexError of the issue)."""
    rows = [order[step * 4 + i] for i in range(4)]
    return {"x": data[rows], "y": data[rows].sum(dim=1, keepdim=True), "sample_ids": [f"row-{r}" for r in rows]}


def loss_fn(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def train_until_the_index_error(tmp_path, optimizer_kwargs: dict, use_scaler: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **optimizer_kwargs)
    scaler = torch.amp.GradScaler("cpu") if use_scaler else None
    guard = Guard(
        model,
        optimizer,
        scaler=scaler,
        loss_fn=loss_fn,
        config=GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="between"),
    )
    data = torch.randn(SAMPLES, WIDTH, generator=torch.Generator().manual_seed(1))
    order = list(range(SAMPLES))
    weights_after_step_4 = None
    with pytest.raises(IndexError, match="list index out of range"):  # the job fails as it would have
        for step in range(10):
            with guard.capture_errors():
                batch = build_batch(data, order, step)
                guard.record_batch(batch)
                loss = loss_fn(model, batch)
                guard.record_loss(loss)
                (scaler.scale(loss) if scaler else loss).backward()
                if guard.check():
                    if scaler:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                optimizer.zero_grad()
                weights_after_step_4 = {k: v.clone() for k, v in model.state_dict().items()}
    guard.close()
    return guard, weights_after_step_4


@pytest.mark.parametrize(
    "optimizer_kwargs, use_scaler",
    [({}, False), ({"fused": True}, False), ({"foreach": True}, True)],
    ids=["adamw", "fused-adamw", "foreach-adamw+gradscaler"],
)
def test_an_index_error_in_batch_building_after_the_update_is_between_steps(tmp_path, optimizer_kwargs, use_scaler):
    guard, updated = train_until_the_index_error(tmp_path, optimizer_kwargs, use_scaler)
    assert len(guard.dumps) == 1
    dump = open_dump(guard.dumps[0])
    assert verify_dump(dump.path).ok
    exception = dump.manifest["exception"]
    assert exception["type"] == "IndexError" and exception["during"] == "between_steps"
    assert exception["state_holds"] == "after_update" and exception["state_may_be_partial"] is False
    assert exception["user_frame"]["function"] == "build_batch"
    assert "between steps (data loading or user code)" in dump.trigger.detail
    # step 4 was checked and applied: the dump holds its updated weights as step 5's pre-step state
    assert dump.step == 5 and dump.num_micro_batches == 0
    state = dump.model_state()
    assert all(torch.equal(state[name], value) for name, value in updated.items())


def test_replay_names_the_exception_and_the_user_line_instead_of_not_reproduced(tmp_path):
    guard, _ = train_until_the_index_error(tmp_path, {})
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["replay", str(guard.dumps[0]), "--device", "cpu", "-o", str(out)])
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    report = json.loads((out / "report.json").read_text())
    verdict = report["verdict"]
    assert verdict["kind"] == "exception" and "not reproduced" not in result.stdout
    assert "IndexError" in verdict["headline"] and "between steps" in verdict["headline"]
    assert "build_batch" in verdict["headline"] and "test_between_steps.py" in verdict["headline"]
    # the samples recorded so far: step 4's, the last step that ran
    assert "row-16" in verdict["explanation"] and "step 4" in verdict["explanation"]
    # the suggestion names the samples itself: the terminal prints no list "above" it (issue 31)
    assert "row-16" in verdict["suggestions"][1] and "above" not in verdict["suggestions"][1]
    assert report["exception"]["during"] == "between_steps"


def test_an_optimizer_without_step_hooks_is_said_once_and_labelled_as_before(caplog):
    class Handmade:  # a duck-typed optimizer: step() and state_dict(), no torch.optim.Optimizer
        def step(self):
            pass

    caplog.set_level("INFO", logger="forensics.capture.raised.optimizer_steps")
    steps = OptimizerSteps(Handmade(), lambda handle: None)
    assert not steps.known and "not (and does not wrap) a torch.optim.Optimizer" in caplog.text
    assert steps.after_check().state_holds == "maybe_partial"


def test_wrapped_optimizers_are_hooked_on_the_torch_optimizer_inside():
    inner = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)

    class ZeroLike:  # DeepSpeed's ZeRO optimizer: holds the torch optimizer as .optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

    assert torch_optimizer(ZeroLike(ZeroLike(inner))) is inner


def test_an_exception_after_the_guard_stopped_the_job_is_not_claimed_as_a_step(tmp_path, caplog):
    """Issue 30, item 6: the loop ends with TrainingFaultError (a NaN loss at step 3); code after the loop raises
    FileNotFoundError. The Guard does not dump or describe it as 'step N raised ... between steps'."""
    from forensics.core.errors import TrainingFaultError

    caplog.set_level("WARNING", logger="capture")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(
        model, optimizer, loss_fn=loss_fn, config=GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="after")
    )
    data = torch.randn(SAMPLES, WIDTH, generator=torch.Generator().manual_seed(1))
    with pytest.raises(FileNotFoundError):
        try:
            for step in range(5):
                with guard.capture_errors():
                    batch = build_batch(data, list(range(SAMPLES)), step)
                    guard.record_batch(batch)
                    loss = loss_fn(model, batch) * (float("nan") if step == 3 else 1.0)
                    guard.record_loss(loss)
                    loss.backward()
                    if guard.check():
                        optimizer.step()
                    optimizer.zero_grad()
        except TrainingFaultError:
            with guard.capture_errors():  # the user's clean-up after the failed run
                open(tmp_path / "no-such-checkpoint.pt", "rb")
    guard.close()
    assert [open_dump(p).trigger.kind for p in guard.dumps] == ["nonfinite_loss"]
    messages = [r.getMessage() for r in caplog.records]
    assert not any("FileNotFoundError" in m and "between steps" in m for m in messages)
    assert any("FileNotFoundError raised after the Guard stopped the job at step 3" in m for m in messages)


def test_an_exception_before_the_first_recorded_step_says_how_to_guard_it_or_is_dumped_when_recorded(tmp_path, caplog):
    """An evaluation before training raises: without a recorded batch the log says how to have it dumped; with
    record_batch inside capture_errors() it is dumped (trigger exception, the evaluation batch's samples)."""
    caplog.set_level("WARNING", logger="capture")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(
        model, optimizer, loss_fn=loss_fn, config=GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="eval")
    )
    wrong = {"x": torch.randn(4, WIDTH + 1), "y": torch.zeros(4, 1), "sample_ids": [f"eval-{i}" for i in range(4)]}
    with pytest.raises(RuntimeError):
        with guard.capture_errors():
            loss_fn(model, wrong)  # evaluation, no batch recorded
    assert guard.dumps == []
    hint = [r.getMessage() for r in caplog.records if "outside a recorded step" in r.getMessage()]
    assert (
        len(hint) == 1
        and "before the first record_batch" in hint[0]
        and "guard.capture_errors()" in hint[0]
        and "record_batch" in hint[0]
    )
    with pytest.raises(RuntimeError):
        with guard.capture_errors():
            guard.record_batch(wrong)
            loss_fn(model, wrong)
    guard.close()
    [path] = guard.dumps
    dump = open_dump(path)
    assert dump.trigger.kind == "exception" and dump.sample_ids(0) == [f"eval-{i}" for i in range(4)]
