"""A real GPT-2 trained with AdamW, LambdaLR warm-up and gradient accumulation hits a poisoned sample:
the Guard writes exactly one dump of that step, with the pre-step state, the batches and the RNG to replay it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

from forensics.capture import DetectionConfig, Guard, GuardConfig, IndexedDataset
from forensics.core.errors import TrainingFaultError
from forensics.format import open_dump, verify_dump
from forensics.recipes import default_loss, huggingface_model
from forensics.core.rng import restore_rng

ACCUM = 2  # micro-batches per optimizer step
MICRO = 2  # samples per micro-batch
POISON = 13  # dataset index of the bad sample: step 3, micro-batch 0 (samples 12, 13)
BAD_STEP, BAD_MB = POISON // (ACCUM * MICRO), (POISON // MICRO) % ACCUM
STEPS = 6


def _setup(helpers, gpt2, tmp_path, policy, scaler=None, **config_changes):
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    config = GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="run", detection=DetectionConfig(on_nonfinite=policy))
    guard = Guard(model, optimizer, scheduler, scaler, config=config.replace(**config_changes))
    loader = DataLoader(
        IndexedDataset(helpers.EmbedsDataset(STEPS * ACCUM * MICRO, poison=[POISON])), batch_size=MICRO, shuffle=False
    )
    batches = list(loader)
    steps = [batches[i : i + ACCUM] for i in range(0, len(batches), ACCUM)]
    return model, optimizer, scheduler, guard, steps


def test_poisoned_sample_gives_one_dump_of_the_pre_step_state_batches_and_rng(helpers, gpt2, tmp_path):
    model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, tmp_path, "skip")
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler, draw=True)
    loop.run(steps)
    guard.close()

    assert [log.decision for log in loop.logs] == [step != BAD_STEP for step in range(STEPS)]
    [path] = guard.dumps
    assert path == tmp_path / "dumps" / "run" / f"step-{BAD_STEP:09d}" / "rank-00000"
    assert sorted(p.name for p in (tmp_path / "dumps" / "run").iterdir()) == [f"step-{BAD_STEP:09d}"]
    assert verify_dump(path).ok
    dump = open_dump(path)
    log = loop.logs[BAD_STEP]

    # what fired, and where
    assert dump.step == BAD_STEP and dump.trigger.kind == "nonfinite_loss"
    assert dump.trigger.micro_batch == BAD_MB and math.isnan(dump.trigger.value)
    assert dump.manifest["grad_accum"] == ACCUM and dump.manifest["loss"]["divisor"] == ACCUM

    # the micro-batches and sample IDs the loader produced
    assert dump.num_micro_batches == ACCUM
    for index, batch in enumerate(log.micro_batches):
        assert helpers.trees_equal(dump.micro_batch(index), batch)
        assert dump.sample_ids(index) == batch["sample_ids"].tolist()
    assert POISON in dump.sample_ids(BAD_MB)
    recorded = [meta["loss"] for meta in dump.micro_batches_meta]
    assert math.isnan(recorded[BAD_MB])

    # weights, optimizer and scheduler state from right before the optimizer step, bitwise
    helpers.assert_dump_holds_pre_step_state(dump, log, model, optimizer)
    assert dump.scheduler_state()["state"]["last_epoch"] == log.scheduler_state["last_epoch"] == BAD_STEP
    assert dump.scheduler_state()["state"]["_last_lr"] == log.scheduler_state["_last_lr"]
    history = dump.history()
    assert history["step"] == list(range(BAD_STEP + 1)) and math.isnan(history["loss"][-1])
    assert history["skipped"] == [False] * BAD_STEP + [True]

    # the RNG: restoring entry i replays what the loop drew before micro-batch i's forward ...
    for index in range(ACCUM):
        restore_rng(dump.rng_state(index))
        assert torch.equal(torch.rand(4), log.draws[index])

    # ... and a model rebuilt from the dump's recipe and weights recomputes the step's losses bitwise,
    # dropout masks included (the model is in train mode)
    recipe = dump.recipe
    assert recipe["factory"] == "forensics.recipes:huggingface_model"
    rebuilt = huggingface_model(**recipe["factory_kwargs"])
    rebuilt.load_state_dict(dump.model_state())
    rebuilt.train()
    for index in range(ACCUM):
        restore_rng(dump.rng_state(index))
        torch.rand(4)  # the loop's draw
        with torch.no_grad():
            loss = default_loss(rebuilt, dump.micro_batch(index), **recipe["loss_kwargs"]).item()
        if index == BAD_MB:
            assert not math.isfinite(loss)
        else:
            assert loss == recorded[index] == log.losses[index].item()
            restore_rng(dump.rng_state(index))  # and a different dropout mask gives a different loss
            with torch.no_grad():
                assert default_loss(rebuilt, dump.micro_batch(index), ["sample_ids"]).item() != recorded[index]


def test_skip_policy_leaves_the_parameters_and_optimizer_untouched(helpers, gpt2, tmp_path):
    model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, tmp_path, "skip")
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler)
    loop.run(steps)
    guard.close()
    before, after = loop.logs[BAD_STEP], loop.logs[BAD_STEP + 1]
    assert before.decision is False and after.decision is True
    for name, tensor in before.model_state.items():
        assert helpers.bitwise_equal(after.model_state[name], tensor), name
    for index, entries in before.optimizer_state["state"].items():
        assert helpers.bitwise_equal(after.optimizer_state["state"][index]["exp_avg"], entries["exp_avg"])
        assert after.optimizer_state["state"][index]["step"] == entries["step"] == BAD_STEP
    final = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in final.values())
    assert not helpers.bitwise_equal(
        final["transformer.wte.weight"].detach(), before.model_state["transformer.wte.weight"]
    )  # training went on
    assert len(guard.dumps) == 1


def test_raise_policy_stops_with_the_dump_path(helpers, gpt2, tmp_path):
    model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, tmp_path, "raise")
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler)
    with pytest.raises(TrainingFaultError, match=f"step {BAD_STEP}: loss of micro-batch {BAD_MB + 1} is nan") as info:
        loop.run(steps)
    guard.close()
    error = info.value
    assert isinstance(error, FloatingPointError)
    assert error.dump_path == guard.dumps[0] and error.dump_error is None
    assert error.trigger["kind"] == "nonfinite_loss" and error.trigger["micro_batch"] == BAD_MB
    assert f"forensics replay {error.dump_path}" in str(error)
    assert len(loop.logs) == BAD_STEP + 1 and len(guard.dumps) == 1
    dump = open_dump(error.dump_path)
    helpers.assert_dump_holds_pre_step_state(dump, loop.logs[BAD_STEP], model, optimizer)


def test_continue_policy_dumps_and_goes_on_up_to_the_cap(helpers, gpt2, tmp_path):
    model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, tmp_path, "continue", max_dumps=2)
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler, snapshot=False)
    loop.run(steps)  # the NaN update poisons every later step: more triggers than the cap
    guard.close()
    assert all(log.decision for log in loop.logs)
    assert [open_dump(p).step for p in guard.dumps] == [BAD_STEP, BAD_STEP + 1]


def test_gradient_accumulation_with_autocast_and_grad_scaler(helpers, gpt2, tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, tmp_path, "skip", scaler=scaler)
    loop = helpers.TrainLoop(model, optimizer, guard, scheduler, scaler=scaler, autocast_dtype=torch.bfloat16)
    loop.run(steps)
    guard.close()
    assert [log.decision for log in loop.logs] == [step != BAD_STEP for step in range(STEPS)]
    [path] = guard.dumps
    dump = open_dump(path)
    log = loop.logs[BAD_STEP]
    assert dump.step == BAD_STEP and dump.trigger.kind == "nonfinite_loss"
    helpers.assert_dump_holds_pre_step_state(dump, log, model, optimizer)
    assert dump.scaler_state() == {k: (float(v) if isinstance(v, float) else v) for k, v in log.scaler_state.items()}
    precision = dump.precision
    assert precision["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "bfloat16"}
    assert precision["grad_scaler"]["scale"] == log.scaler_state["scale"]
    history = dump.history()
    assert history["loss_scale"][-1] == log.scaler_state["scale"]
    healthy = 1 - BAD_MB
    assert dump.micro_batches_meta[healthy]["loss"] == log.losses[healthy].float().item()


def test_grad_scaler_overflow_is_not_a_fault_until_the_scale_collapses(helpers, gpt2, tmp_path):
    # float16 autocast with a 2**30 loss scale: backward overflows, the scaler skips the step and halves
    # the scale. That is the scaler doing its job, not a fault, until the scale reaches min_loss_scale.
    def run(directory, **config):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
        model, optimizer, scheduler, guard, steps = _setup(helpers, gpt2, directory, "raise", scaler=scaler, **config)
        loop = helpers.TrainLoop(
            model,
            optimizer,
            guard,
            None,
            scaler=scaler,
            snapshot=False,  # every step is skipped
            autocast_dtype=torch.float16,
        )
        return guard, loop, steps

    guard, loop, steps = run(tmp_path / "a")
    loop.run(steps[:2])
    history = guard.history.to_dict()
    assert guard.dumps == [] and [log.decision for log in loop.logs] == [True, True]
    assert history["skipped"] == [True, True]  # the scaler's own overflow skips are recorded, not dumped
    assert history["loss_scale"] == [2.0**30, 2.0**29] and not math.isfinite(history["grad_norm"][0])

    guard, loop, steps = run(tmp_path / "b", min_loss_scale=2.0**29)
    with pytest.raises(TrainingFaultError, match="loss scale has collapsed") as info:
        loop.run(steps[:2])
    assert info.value.trigger["kind"] == "nonfinite_grad" and len(loop.logs) == 2
    dump = open_dump(info.value.dump_path)
    assert dump.step == 1 and dump.scaler_state()["scale"] == 2.0**29
    assert dump.precision["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "float16"}


def test_verify_update_dumps_the_pre_step_state_of_an_update_that_makes_weights_nan(helpers, gpt2, tmp_path):
    # AdamW with eps=0: position-embedding rows past the sequence length get zero gradients, so their
    # update is 0 / (sqrt(0) + 0) = NaN although every loss and gradient is finite
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="u", detection=DetectionConfig(verify_update=True)),
    )
    data = helpers.EmbedsDataset(4)
    loop = helpers.TrainLoop(model, optimizer, guard)
    with pytest.raises(TrainingFaultError, match="transformer.wpe.weight non-finite") as info:
        loop.run([[helpers.collate(data, [0, 1]), helpers.collate(data, [2, 3])]])
    guard.close()
    assert info.value.trigger["kind"] == "nonfinite_param"
    dump = open_dump(info.value.dump_path)
    assert dump.step == 0 and dump.trigger.kind == "nonfinite_param"
    assert not torch.isfinite(model.transformer.wpe.weight).all()  # the update did happen ...
    state = dump.model_state()
    for name, tensor in loop.logs[0].model_state.items():  # ... the dump holds the weights from before it
        assert helpers.bitwise_equal(state[name], tensor), name
    assert dump.optimizer_state()["param_groups"][0]["eps"] == 0.0
    assert [m["loss"] for m in dump.micro_batches_meta] == [loss.item() for loss in loop.logs[0].losses]


def test_recheck_recomputes_the_failing_micro_batch_and_leaves_the_job_untouched(helpers, gpt2, tmp_path):
    runs = {}
    for recheck in (True, False):
        model, optimizer, scheduler, guard, steps = _setup(
            helpers, gpt2, tmp_path / str(recheck), "skip", recheck=recheck
        )
        loop = helpers.TrainLoop(model, optimizer, guard, scheduler, snapshot=False, draw=True)
        loop.run(steps)
        guard.close()
        runs[recheck] = (model, loop, guard)
    model, loop, guard = runs[True]
    [path] = guard.dumps
    recheck = open_dump(path).manifest["recheck"]
    assert recheck["performed"] is True and recheck["micro_batch"] == BAD_MB
    assert recheck["reproduced"] is True and math.isnan(recheck["recomputed"])
    assert open_dump(runs[False][2].dumps[0]).manifest["recheck"] == {"performed": False}
    # the re-check consumed none of the job's RNG and changed none of its state
    other_model, other_loop, _ = runs[False]
    for mine, theirs in zip(loop.logs, other_loop.logs):
        assert all(torch.equal(a, b) for a, b in zip(mine.draws, theirs.draws))
    for (name, p), (_, q) in zip(model.named_parameters(), other_model.named_parameters()):
        assert helpers.bitwise_equal(p, q), name
