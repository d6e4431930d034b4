"""Two-process gloo runs of the DDP, Accelerate and DeepSpeed (ZeRO-2, ZeRO-3) examples with a corrupt sample on rank 1.

Both ranks must dump the same step; each dump holds the full pre-step weights and optimizer state
(checked against a plain-torch reference of the same training) and that rank's own micro-batches and
sample IDs; rank 1's names the corrupt sample.
"""

from __future__ import annotations

import time

import pytest
import torch

from forensics.format import open_dump, verify_dump

SYNC_FREE_MULTI_RANK_OPS = 39  # measured on torch 2.13 CPU; the check of 5502fa6: 57


@pytest.mark.slow  # Accelerate (DDP underneath) and DDP fp16 prove both ranks dumping
def test_ddp_both_ranks_dump_the_same_step_with_full_state(harness, tmp_path, reference):
    harness.requires("transformers")
    step_dir, _ = harness.run_example(tmp_path, "ddp_example.py", "ddp")
    harness.check_step_dump(step_dir, reference)
    harness.replay_names_sample_and_layer(step_dir)


def test_ddp_fp16_scaler_skips_are_history_until_the_loss_scale_collapses(harness, tmp_path):
    """GradScaler overflow-and-skip steps trigger nothing (on any rank); a NaN loss does, and so does an
    overflow once the scale is down to min_loss_scale. The 'continue' policy keeps training between."""
    harness.requires("transformers")
    dump_dir, min_scale = tmp_path / "dumps", 2.0**33
    result = harness.launch(
        "ddp_example.py",
        [
            "--dump-dir",
            str(dump_dir),
            "--run-id",
            "fp16",
            "--fp16",
            "--initial-scale-power",
            "40",
            "--min-loss-scale",
            str(min_scale),
            "--policy",
            "continue",
            "--steps",
            "8",
        ],
    )
    assert sorted(result.reports) == [0, 1] and all(r["fault"] is None for r in result.reports.values()), (
        result.explain()
    )
    run = dump_dir / "fp16"
    assert sorted(p.name for p in run.iterdir()) == ["step-000000003", "step-000000007"]
    nan_step = {d.rank: d for d in verify_dump(run / "step-000000003").dumps}
    assert nan_step[1].trigger.kind == "nonfinite_loss" and nan_step[0].trigger.local is False
    collapsed = verify_dump(run / "step-000000007")
    assert collapsed.ok and sorted(d.rank for d in collapsed.dumps) == [0, 1]
    for dump in collapsed.dumps:
        assert dump.trigger.kind == "nonfinite_grad" and dump.trigger.local is True
        assert dump.trigger.threshold == min_scale
        assert dump.precision["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "float16"}
        history = dump.history()
        assert history["loss_scale"] == [2.0 ** (40 - step) for step in range(8)]
        assert all(history["skipped"])  # every step overflowed; the scaler skipped each one


def test_accelerate_both_ranks_dump_the_same_step_with_full_state(harness, tmp_path, reference):
    harness.requires("transformers", "accelerate")
    step_dir, _ = harness.run_example(tmp_path, "accelerate_example.py", "acc")
    dumps = harness.check_step_dump(step_dir, reference)
    assert dumps[1].manifest["distributed"]["framework"] == "accelerate"
    assert dumps[1].manifest["loss"]["divisor"] == harness.ACCUM


@pytest.mark.xdist_group("deepspeed")  # one worker's fork server imports DeepSpeed once for both ZeRO jobs
def test_deepspeed_zero2_ranks_write_their_partitions_once(harness, tmp_path, reference):
    harness.requires("transformers", "deepspeed")
    step_dir, result = harness.run_example(tmp_path, "deepspeed_example.py", "z2", "--zero-stage", "2")
    dumps = harness.check_step_dump(step_dir, reference)  # assembled from both ranks' partitions
    written, one_copy, per_rank = harness.state_bytes(step_dir)
    assert written <= 1.05 * one_copy and max(per_rank) < 0.75 * one_copy, (written, one_copy, per_rank)
    assert dumps[0].manifest["distributed"]["zero_stage"] == 2
    # the history holds the healthy steps' global grad norms, assembled from the two ranks' shards
    history = dumps[0].history()
    assert history["step"] == [0, 1, 2, 3] and all(0.0 < g < 10.0 for g in history["grad_norm"][:3])
    assert history["grad_norm"][:3] == dumps[1].history()["grad_norm"][:3]


@pytest.mark.xdist_group("deepspeed")  # one worker's fork server imports DeepSpeed once for both ZeRO jobs
def test_deepspeed_zero3_bf16_writes_partitioned_weights_and_fp32_masters_once(harness, tmp_path, reference):
    harness.requires("transformers", "deepspeed")
    step_dir, result = harness.run_example(
        tmp_path, "deepspeed_example.py", "z3", "--zero-stage", "3", "--precision", "bf16"
    )
    dumps = harness.check_step_dump(step_dir, reference, atol=2e-2, weight_dtype=torch.bfloat16)
    for rank, dump in dumps.items():
        assert dump.manifest["distributed"]["zero_stage"] == 3
        assert dump.recipe["factory_kwargs"]["dtype"] == "bfloat16"  # replay builds the model in bf16
        weights, state = dump.model_state(), dump.optimizer_state()["state"]
        for name, entries in state.items():
            master = entries["fp32_master"]
            assert master.dtype == torch.float32 and master.shape == weights[name].shape
            # DeepSpeed's bf16 weights are its fp32 masters rounded: the dump caught both at the same moment
            assert torch.equal(master.to(torch.bfloat16), weights[name]), (rank, name)
            harness.close(master, reference["model"][name], f"rank {rank} fp32 master {name}", 2e-2)
    harness.replay_names_sample_and_layer(step_dir)


def test_a_rank_killed_while_writing_its_dump_does_not_hang_or_spoil_the_others(harness, tmp_path):
    """With the full layout (every rank gathers and writes the whole state) the survivors replay alone."""
    harness.requires("transformers", "deepspeed")
    dump_dir = tmp_path / "dumps"
    example = str(harness.EXAMPLES / "deepspeed_example.py")
    worker = str(harness.REPO / "tests" / "integrations" / "die_in_write.py")
    started = time.monotonic()
    result = harness.launch_script(
        worker,
        [example, "--zero-stage", "2", "--dump-dir", str(dump_dir), "--run-id", "killed", "--layout", "full"],
        env={"FORENSICS_TEST_DIE_RANK": "1", "FORENSICS_TEST_SLOW_RANK": "0"},
        torchrun=True,
    )  # torchrun's own SIGTERM to the survivor, as users run it
    elapsed = time.monotonic() - started
    assert result.returncode != 0, result.explain()  # torchrun reports the dead rank
    # rank 0 was sent SIGTERM while it wrote (slowly): it finished its dump first
    assert "SIGTERM received while writing the dump" in result.output, result.explain()
    # Waiting on the dead rank would last gloo's timeout (30 min); a loaded 2-core machine needs up to ~90 s here
    # (two DeepSpeed imports), so the bound sits just under the launch timeout.
    assert elapsed < harness.LAUNCH_TIMEOUT - 10, f"the surviving rank took {elapsed:.0f} s: it waited on the dead one"
    step_dir = dump_dir / "killed" / f"step-{harness.BAD_STEP:09d}"
    leftovers = [p.name for p in step_dir.iterdir() if p.name.startswith(".tmp-rank-00001")]
    assert leftovers, "rank 1 should have died halfway through its write"

    check = verify_dump(step_dir)
    assert check.missing_ranks == [1]
    assert [str(p) for p in check.problems] == ["rank-00001: rank dump is missing (that rank did not finish writing)"]
    survivor = open_dump(step_dir, rank=0)
    assert open_dump(step_dir).rank == 0
    assert survivor.step == harness.BAD_STEP and survivor.world_size == 2
    assert len(survivor.model_state()) > 0 and survivor.optimizer_state()["state"]


@pytest.mark.slow  # Accelerate's DeepSpeed plugin over the DeepSpeed adapter that ZeRO-3 proves
def test_accelerate_deepspeed_plugin_checks_inside_engine_step(harness, tmp_path, reference):
    """Under Accelerate's DeepSpeed plugin `accelerator.backward` runs `engine.step()` itself: the guard
    checks from inside that call, before the step, and the loop's own check() calls do nothing."""
    harness.requires("transformers", "accelerate", "deepspeed")
    step_dir, _ = harness.run_example(
        tmp_path, "accelerate_example.py", "accds", "--deepspeed-stage", "3", "--layout", "full"
    )
    dumps = harness.check_step_dump(step_dir, reference)
    for dump in dumps.values():
        # the full layout: ZeRO-3 partitions gathered, each rank dump whole (format version 1, replayable alone)
        assert dump.manifest["format_version"] != 2 and not dump.sharded  # 3 once a file has chunk digests
        assert dump.manifest["distributed"]["state"] == "full on every rank (replayable alone)"
        assert dump.manifest["distributed"]["framework"] == "deepspeed"
        assert dump.manifest["distributed"]["zero_stage"] == 3
        assert dump.history()["step"] == [0, 1, 2, 3]  # one check per optimizer step, none doubled


@pytest.mark.parametrize("kind", [pytest.param("distributed", marks=pytest.mark.slow), "plain", "fused"])
def test_a_loss_spike_on_one_rank_is_dumped_by_every_rank(harness, tmp_path, kind):
    """Spike detectors run on the step loss agreed across ranks, so every rank dumps the spike step
    (a ZeRO gather entered by one rank alone would hang), under DistributedGuard and plain Guard alike. With a fused
    optimizer (the sync-free check across ranks) every rank holds the spike's update back on the device, from the
    agreed numbers, and dumps it one step late."""
    worker = str(harness.REPO / "tests" / "integrations" / "spike_worker.py")
    result = harness.launch_script(worker, [str(tmp_path / "dumps"), kind])
    assert result.returncode == 0 and sorted(result.reports) == [0, 1], result.explain()
    dumped = {rank: [p.split("/")[-2] for p in report["dumps"]] for rank, report in result.reports.items()}
    assert dumped == {0: ["step-000000008"], 1: ["step-000000008"]}
    dumps = {d.rank: d for d in verify_dump(tmp_path / "dumps" / kind / "step-000000008").dumps}
    for rank, dump in dumps.items():
        assert dump.trigger.kind == "loss_spike"
        assert dump.sample_ids(0)[0] == f"r{rank}s8i0"  # each rank's own batch
    assert dumps[1].trigger.local is True and dumps[0].trigger.local is False  # rank 1's loss spiked
    assert {rank: report["held"] for rank, report in result.reports.items()} == {0: kind == "fused", 1: kind == "fused"}
    assert all(("one step late" in d.trigger.detail) == (kind == "fused") for d in dumps.values())
    if kind == "fused":  # the sync-free check on several ranks, counted (capture/detection/agreement.py launch()): on a
        # GPU most operators are a kernel launch, tens of microseconds of host time each on a host-bound step
        ops = {rank: report["check_ops"] for rank, report in result.reports.items()}
        assert max(ops.values()) <= SYNC_FREE_MULTI_RANK_OPS, (
            f"the sync-free check dispatches {ops} operators per healthy step on each rank, budget "
            f"{SYNC_FREE_MULTI_RANK_OPS} (its grad norm computed by the Guard, 2 ranks, gloo)"
        )
