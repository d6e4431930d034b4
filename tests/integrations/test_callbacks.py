"""One-process Hugging Face Trainer and Lightning runs with a corrupt sample: the one-line callback dumps that step.

The dump must hold the micro-batch with the sample and its ID, the weights and optimizer state the
step started from (bitwise: the step never ran), and per-micro-batch losses a replay recomputes exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from forensics.capture import GuardConfig, IndexedDataset
from forensics.core.errors import TrainingFaultError
from forensics.format import open_dump, verify_dump
from forensics.recipes import default_loss

STEPS, ACCUM, MICRO = 6, 2, 2
POISON = 13  # read in order: step 3, micro-batch 0 (samples 12 and 13)
BAD_STEP, BAD_MB = POISON // (ACCUM * MICRO), (POISON // MICRO) % ACCUM


def _assert_pre_step_state(dump, model, optimizer):
    weights = dump.model_state()
    live = model.state_dict()
    assert sorted(weights) == sorted(live)
    for name, tensor in live.items():
        assert torch.equal(weights[name], tensor), name
    names = {id(p): n for n, p in model.named_parameters()}
    dumped = dump.optimizer_state()["state"]
    assert sorted(dumped) == sorted(names[id(p)] for p, s in optimizer.state.items() if s)
    for param, entries in optimizer.state.items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(dumped[names[id(param)]][key]), value.cpu()), (names[id(param)], key)


def _assert_names_the_sample(dump):
    assert verify_dump(dump.path).ok
    assert dump.step == BAD_STEP and dump.trigger.kind == "nonfinite_loss"
    assert dump.trigger.micro_batch == BAD_MB
    assert [dump.sample_ids(i) for i in range(dump.num_micro_batches)] == [[12, 13], [14, 15]]
    batch = dump.micro_batch(BAD_MB)
    assert batch["inputs_embeds"][1].abs().max().item() >= 1e37  # sample 13 is row 1


def test_hf_trainer_that_drops_the_sample_ids_says_so_loudly(harness, tmp_path, caplog):
    harness.requires("transformers", "accelerate")
    import logging

    from transformers import Trainer, TrainingArguments

    from forensics.capture.integrations import ForensicsTrainerCallback

    caplog.set_level(logging.WARNING)
    common = harness.load_common()
    dataset = IndexedDataset(common.EmbedsDataset(STEPS * ACCUM * MICRO, poison=POISON))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        learning_rate=common.LR,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        use_cpu=True,
        seed=0,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
    )  # remove_unused_columns=True
    callback = ForensicsTrainerCallback(GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="hfdrop"))
    trainer = Trainer(model=common.tiny_gpt2(), args=args, train_dataset=dataset, callbacks=[callback])
    with pytest.raises(TrainingFaultError) as fault:
        trainer.train()
    callback.close()
    warnings = [r.message for r in caplog.records if "carry no 'sample_ids'" in r.message]
    assert len(warnings) == 1 and "remove_unused_columns=False" in warnings[0]
    dump = open_dump(fault.value.dump_path)
    assert dump.sample_ids(0)[0].startswith(f"step{BAD_STEP}/rank0/mb1/")
    assert dump.micro_batches_meta[0]["ids_are_positional"] is True


def test_hf_trainer_callback_dumps_the_step_with_the_corrupt_sample(harness, tmp_path):
    harness.requires("transformers", "accelerate")
    from transformers import Trainer, TrainingArguments

    from forensics.capture.integrations import ForensicsTrainerCallback

    common = harness.load_common()
    dataset = IndexedDataset(common.EmbedsDataset(STEPS * ACCUM * MICRO, poison=POISON))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        learning_rate=common.LR,
        max_grad_norm=common.CLIP,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
    )
    callback = ForensicsTrainerCallback(GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="hf"))
    trainer = Trainer(model=common.tiny_gpt2(), args=args, train_dataset=dataset, callbacks=[callback])
    with pytest.raises(TrainingFaultError) as fault:
        trainer.train()
    callback.close()
    dump = open_dump(fault.value.dump_path)
    _assert_names_the_sample(dump)
    _assert_pre_step_state(dump, trainer.model, trainer.optimizer.optimizer)
    assert dump.manifest["distributed"]["framework"] == "transformers.Trainer"
    # The Trainer normalises each micro-batch loss over the whole step (num_items_in_batch): the batch
    # keeps that count, so the recorded losses add up to the step loss and recompute bitwise.
    assert dump.manifest["loss"]["divisor"] == 1.0
    healthy = 1 - BAD_MB
    batch = dump.micro_batch(healthy)
    assert "num_items_in_batch" in batch and "sample_ids" not in batch
    trainer.model.train()
    with torch.no_grad():
        recomputed = default_loss(trainer.model, batch, ["sample_ids"])
    assert recomputed.item() == dump.micro_batches_meta[healthy]["loss"]
    assert dump.history()["step"] == list(range(BAD_STEP + 1))


@pytest.mark.parametrize("fused", [False, True])
def test_lightning_callback_dumps_the_step_with_the_corrupt_sample(harness, tmp_path, fused):
    """Lightning steps the optimizer with a closure; with a fused AdamW the default GuardConfig checks without a sync,
    skips the failing update on the device and raises one step late: the dump is the same pre-step state."""
    harness.requires("transformers")
    try:
        import pytorch_lightning as pl
    except ImportError:
        pl = pytest.importorskip("lightning.pytorch")
    from forensics.capture.integrations import ForensicsLightningCallback
    from forensics.capture.integrations.lightning import training_step_loss

    common = harness.load_common()
    loader = DataLoader(
        IndexedDataset(common.EmbedsDataset(STEPS * ACCUM * MICRO, poison=POISON)), batch_size=MICRO, shuffle=False
    )
    callback = ForensicsLightningCallback(GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="lit"))
    trainer = pl.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=common.CLIP,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    )
    module = common.lit_gpt2(fused=fused)
    with pytest.raises(TrainingFaultError) as fault:
        trainer.fit(module, loader)
    assert ("one step late" in fault.value.fired.detail) is fused
    dump = open_dump(fault.value.dump_path)
    _assert_names_the_sample(dump)
    _assert_pre_step_state(dump, module, trainer.optimizers[0])
    assert "training_step" not in vars(module)  # the callback's wrapper is gone after the fit
    assert dump.manifest["loss"]["divisor"] == ACCUM
    assert dump.recipe["loss"] == "forensics.capture.integrations.lightning:training_step_loss"
    healthy = 1 - BAD_MB
    with torch.no_grad():  # the loss as training_step returned it, before Lightning divided it
        recomputed = training_step_loss(module, dump.micro_batch(healthy))
    assert recomputed.item() == dump.micro_batches_meta[healthy]["loss"]
    assert dump.scheduler_state()["state"]["last_epoch"] == BAD_STEP


@pytest.mark.slow  # the Trainer callback and the DeepSpeed adapter are proven each
def test_hf_trainer_deepspeed_dump_matches_the_plain_trainer_dump(harness, tmp_path):
    """The Trainer's DeepSpeed mode (ZeRO-2; the Trainer's two parameter groups, with and without weight
    decay) dumps the same step with the same state as the plain Trainer, gathered from the ZeRO shards."""
    harness.requires("transformers", "accelerate", "deepspeed")
    runs = {}
    for name, extra, runner in (("plain", [], [harness.sys.executable]), ("zero2", ["--deepspeed-stage", "2"], None)):
        result = harness.launch(
            "hf_trainer_example.py",
            ["--dump-dir", str(tmp_path / name), "--run-id", name, "--sequential", *extra],
            nproc=1,
            runner=runner,
        )
        assert 0 in result.reports and result.reports[0]["dump"], result.explain()
        runs[name] = open_dump(result.reports[0]["dump"])
    plain, zero2 = runs["plain"], runs["zero2"]
    _assert_names_the_sample(zero2)
    assert zero2.manifest["distributed"]["framework"] == "transformers.Trainer+deepspeed"
    assert [d.sample_ids(i) for d in (plain, zero2) for i in range(2)] == [[12, 13], [14, 15]] * 2
    expected, actual = plain.model_state(), zero2.model_state()
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert torch.allclose(actual[name], expected[name], atol=1e-5), name
    expected, actual = plain.optimizer_state(), zero2.optimizer_state()
    assert [g["params"] for g in actual["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert len(actual["param_groups"]) == 2
    for name, entries in expected["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(actual["state"][name][key], entries[key], atol=1e-6), (name, key)
        assert float(actual["state"][name]["step"]) == float(entries["step"])


def test_lightning_fused_adamw_under_mixed_precision_clips_and_dumps(harness, tmp_path):
    """Issue 42 item 9: Lightning refuses gradient_clip_val for a fused optimizer under mixed precision; the examples'
    module clips itself (configure_gradient_clipping), so the fused bf16-mixed fit runs, is checked without a sync and
    dumps the corrupt sample's step (the GPU acceptance step integ_lightning_fused runs the same on a GPU)."""
    harness.requires("transformers")
    try:
        import pytorch_lightning as pl
    except ImportError:
        pl = pytest.importorskip("lightning.pytorch")
    from forensics.capture.integrations import ForensicsLightningCallback

    common = harness.load_common()
    loader = DataLoader(
        IndexedDataset(common.EmbedsDataset(STEPS * ACCUM * MICRO, poison=POISON)), batch_size=MICRO, shuffle=False
    )
    callback = ForensicsLightningCallback(GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="litf"))
    trainer = pl.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=common.CLIP,
        precision="bf16-mixed",
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(TrainingFaultError) as fault:
        trainer.fit(common.lit_gpt2(fused=True), loader)
    assert "one step late" in fault.value.fired.detail
    dump = open_dump(fault.value.dump_path)
    _assert_names_the_sample(dump)
    assert dump.manifest["loss"]["divisor"] == ACCUM
    steps = dump.history()["step"]
    assert steps == list(range(BAD_STEP + 1)) and not any(dump.history()["skipped"][:BAD_STEP])
