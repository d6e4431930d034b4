"""torchtitan's own trainer, guarded by its configuration alone (capture/integrations/torchtitan.py).

The job (tests/integrations/titan_job.toml) is torchtitan's Llama 3 debug model on two CPU ranks under its default
FSDP, reading a local synthetic token stream (titan_job.py, named by the config's custom_import); record 5 of rank
1's stream has every label masked. Its config says `[forensics] enable = true` and nothing else of forensics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from forensics.format import open_dump, verify_dump

HERE = Path(__file__).resolve().parent
TRAIN, JOB = HERE / "torchtitan_train.py", HERE / "titan_job.toml"
BAD_STEP, BAD_MB = 3, 1  # torchtitan counts steps from 1: rank 1 reads its records 4 and 5 in step 3


@pytest.mark.xdist_group("torchtitan")  # one worker imports torchtitan (12 s of CPU) for every torchtitan test
def test_torchtitans_trainer_guarded_by_its_config_dumps_and_replay_names_the_record(harness, tmp_path):
    harness.requires("torchtitan")
    result = harness.launch_script(str(TRAIN), ["--job.config_file", str(JOB), "--job.dump_folder", str(tmp_path)])
    assert result.returncode != 0, result.explain()  # on_nonfinite = "raise": the job fails once the dump is written
    assert "TrainingFaultError: step 3: loss of micro-batch 2 is nan" in result.output, result.explain()

    step_dir = tmp_path / "forensics" / "titan" / f"step-{BAD_STEP:09d}"  # dump_dir defaults next to checkpoints
    checked = verify_dump(step_dir)
    assert checked.ok and checked.missing_ranks == [], [str(p) for p in checked.problems]
    dumps = {d.rank: d for d in checked.dumps}
    assert sorted(dumps) == [0, 1] and all(d.sharded for d in dumps.values())  # FSDP: each rank its shards
    for rank, dump in dumps.items():  # the position of each record in its rank's stream
        assert [dump.sample_ids(i) for i in range(dump.num_micro_batches)] == [[f"dp{rank}:4"], [f"dp{rank}:5"]]
    bad = dumps[1]
    assert bad.trigger.kind == "nonfinite_loss" and bad.trigger.micro_batch == BAD_MB and bad.trigger.local
    batch = bad.micro_batch(BAD_MB)
    assert sorted(batch) == ["input", "labels"] and (batch["labels"] == -100).all()
    assert tuple(batch["input"].shape) == (1, 32)
    manifest = json.loads((step_dir / "rank-00001" / "manifest.json").read_text())
    assert manifest["recipe"]["factory"] == "forensics.recipes:torchtitan_model"
    assert manifest["recipe"]["factory_kwargs"]["model"] == "llama3"
    assert manifest["recipe"]["factory_kwargs"]["model_args"]["max_seq_len"] == 32  # as the job ran it
    assert open_dump(step_dir).rank == 1

    from forensics.cli import main  # `forensics replay DUMP --rank 1`, in-process; no --trust: built-in recipes

    out = tmp_path / "replay"
    replayed = CliRunner().invoke(
        main,
        ["replay", str(step_dir), "--rank", "1", "--device", "cpu", "-o", str(out), "--no-remedies", "--no-rng-check"],
    )  # what names the sample, no more
    assert replayed.exit_code == 0, (replayed.output, replayed.exception)
    assert "Sample 'dp1:5'" in replayed.output, replayed.output
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "bad_sample"
    assert [(s["sample_id"], s["rank"]) for s in report["culprit"]["samples"]] == [("dp1:5", 1)]
    assert report["fidelity"]["bitwise_equal"] is True, report["fidelity"]
    assert report["precision"]["fsdp_param_dtype"] == "bfloat16"  # torchtitan's default mixed precision, replayed


@pytest.mark.slow  # the same capture; what differs is torchtitan's one-rank path
@pytest.mark.xdist_group("torchtitan")
def test_one_rank_torchtitan_amp_and_fused_adamw_dumps_one_step_late_and_names_the_record(harness, tmp_path):
    """One rank: no FSDP, so torchtitan runs forward and loss under its own bf16 autocast; its default fused AdamW
    gives the sync-free check (the step skipped on the device, judged at the next check). What the GPU acceptance
    run does on one GPU (scripts/gpu_acceptance.sh, integ_torchtitan)."""
    harness.requires("torchtitan")
    result = harness.launch_script(
        str(TRAIN),
        [
            "--job.config_file",
            str(JOB),
            "--job.dump_folder",
            str(tmp_path),
            "--training.global_batch_size",
            "2",
            "--optimizer.implementation",
            "fused",
        ],
        nproc=1,
        env={"TITAN_POISON_RANK": "0"},
    )
    assert "step 3: loss of micro-batch 2 is nan (sync-free check: judged one step late" in result.output, (
        result.explain()
    )
    step_dir = tmp_path / "forensics" / "titan" / f"step-{BAD_STEP:09d}"
    from forensics.replay import engine

    report = engine.run_replay(str(step_dir), engine.ReplayOptions(device="cpu", remedies=False, rng_check=False))
    assert [(s["sample_id"], s["rank"]) for s in report["culprit"]["samples"]] == [("dp0:5", 0)]
    assert report["precision"]["autocast_dtype"] == "bfloat16", report["precision"]  # torchtitan's AMP, replayed


@pytest.mark.xdist_group("torchtitan")
def test_the_forensics_section_of_torchtitans_config_sets_the_guard(capsys):
    """`[forensics]` parses as torchtitan parses every section (TOML, then `--forensics.<field>` overrides); a policy
    that is not one exits 2 with a one-line reason; the clipping norm and the dump directory follow the job."""
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    from forensics.capture.integrations.torchtitan import guard_config
    from forensics.core.kinds import Policy

    config = ConfigManager().parse_args(
        [
            "--job.config_file",
            str(JOB),
            "--job.dump_folder",
            "/job/out",
            "--forensics.on_nonfinite",
            "skip",
            "--training.max_norm",
            "0.5",
        ]
    )
    assert config.forensics.enable is True and config.forensics.run_id == "titan"
    guard = guard_config(config, None)
    assert guard.detection.on_nonfinite is Policy.SKIP and guard.detection.max_grad_norm == 0.5
    assert guard.dump_dir == "/job/out/forensics" and guard.run_id == "titan"
    with pytest.raises(SystemExit) as exited:
        ConfigManager().parse_args(["--job.config_file", str(JOB), "--forensics.on_nonfinite", "ignore"])
    assert exited.value.code == 2 and "forensics.on_nonfinite must be one of" in capsys.readouterr().err


@pytest.mark.slow  # the policy itself is the Guard's (tests/capture); this is torchtitan's step taking it
@pytest.mark.xdist_group("torchtitan")
def test_skip_drops_the_bad_steps_gradients_and_torchtitan_trains_on(harness, tmp_path):
    """'skip': torchtitan trains on past the dumped step. The dataset names its records itself (a `sample_ids` field
    of the input dict): the dump holds those IDs, and the model never saw the field (it takes no such argument)."""
    harness.requires("torchtitan")
    result = harness.launch_script(
        str(TRAIN),
        ["--job.config_file", str(JOB), "--job.dump_folder", str(tmp_path), "--forensics.on_nonfinite", "skip"],
        env={"TITAN_SAMPLE_IDS": "1"},
    )
    assert result.returncode == 0, result.explain()
    assert "step 3 rank 1: loss of micro-batch 2 is nan (policy: skip)" in result.output
    assert result.output.count("Training completed") == 2  # both ranks ran step 4
    checked = verify_dump(tmp_path / "forensics" / "titan" / f"step-{BAD_STEP:09d}")
    assert checked.ok
    bad = {d.rank: d for d in checked.dumps}[1]
    assert [bad.sample_ids(i) for i in range(bad.num_micro_batches)] == [["rank1/rec4"], ["rank1/rec5"]]
    assert sorted(bad.micro_batch(BAD_MB)) == ["input", "labels"]
