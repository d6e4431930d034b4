"""Window replay (`forensics replay DUMP --from CHECKPOINT`) on real training runs: the flight recorder, the data
recipe and an earlier checkpoint find the step whose update broke the weights, steps before the crash."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader

from forensics.capture import DumpConfig, Guard, GuardConfig, RecordConfig
from forensics.cli import main, replay_exit_code
from forensics.core.errors import TrainingFaultError
from forensics.format import open_dump, spec
from forensics.replay.engine import ReplayOptions, run_replay

HERE = Path(__file__).resolve().parent
POISON = 21  # batch size 2, 2 micro-batches: step 5, micro-batch 0, row 1


@pytest.fixture
def job():
    sys.path.insert(0, str(HERE))
    import window_job

    yield window_job
    sys.path.remove(str(HERE))


def train(
    job,
    tmp_path,
    optimizer_factory,
    *,
    checkpoint_step: int,
    poison: int | None = POISON,
    prepare=None,
    window_steps: int = 32,
    snapshot_every: int = 0,
):
    """Trains with the Guard (four calls) until it raises; saves a torch.save checkpoint before `checkpoint_step`.
    Returns (dump path, checkpoint path)."""
    model = job.make_model()
    if prepare is not None:
        prepare(model)
    optimizer = optimizer_factory(model)
    guard = Guard(
        model,
        optimizer,
        loss_fn=job.mse_loss,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="win",
            recording=RecordConfig(window_steps=window_steps, snapshot_every=snapshot_every),
            dumping=DumpConfig(
                recipe={"factory": "window_job:make_model"},
                data_recipe={"dataset": "window_job:make_dataset", "dataset_kwargs": {"n": 200, "poison": poison}},
            ),
        ),
    )
    batches = iter(DataLoader(job.make_dataset(200, poison), batch_size=2))
    checkpoint = tmp_path / "step.pt"
    with pytest.raises(TrainingFaultError) as fault:
        for step in range(30):
            if step == checkpoint_step:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, checkpoint)
            for _ in range(2):
                batch = next(batches)
                guard.record_batch(batch)
                loss = job.mse_loss(model, batch)
                guard.record_loss(loss)
                (loss / 2).backward()
            if guard.check():
                optimizer.step()
            optimizer.zero_grad()
    guard.close()
    return fault.value.dump_path, checkpoint


def options(checkpoint, **kwargs) -> ReplayOptions:
    return ReplayOptions(
        device="cpu", trust=True, sys_path=[str(HERE)], from_checkpoint=str(checkpoint), rng_check=False, **kwargs
    )


def test_window_replay_finds_the_update_that_wrecked_the_weights_steps_before_the_crash(job, tmp_path):
    dump_path, checkpoint = train(job, tmp_path, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), checkpoint_step=2)
    dump = open_dump(dump_path)
    assert dump.step == 7 and dump.trigger.kind == "nonfinite_grad"  # the gradients overflow two steps later
    assert [row["step"] for row in dump.window()] == list(range(7))
    assert dump.window()[5]["sample_ids"][0] == [20, POISON]

    report = run_replay(str(dump_path), options(checkpoint))

    window = report["window"]
    assert (window["from_step"], window["broke_at"], window["steps_before_crash"]) == (2, 5, 2)
    steps = window["steps"]
    assert [s["step"] for s in steps] == [2, 3, 4, 5]
    for row in steps[:3]:  # the healthy steps replay exactly as the job ran them (same CPU, same RNG)
        assert row["replayed_loss"] == row["recorded_loss"] and row["broke"] is None
    assert steps[3]["relative_change"] > 100 and "moved the weights" in steps[3]["broke"]
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [POISON]
    assert report["dump"]["step"] == 5
    assert report["verdict"]["headline"].startswith("The weights broke at step 5 (2 steps before the crash at step 7)")
    tested = {row["kind"]: row for row in report["remedies"]["tested"]}
    assert tested["drop_samples"]["healthy"] is True


def test_adam_eps_zero_from_a_checkpoint_is_blamed_on_the_first_update(job, tmp_path):
    def dead_unit(model):  # a unit relu never opens: its weights get exactly-zero gradients
        with torch.no_grad():
            model.up.weight[0] = 0.0
            model.up.bias[0] = -1.0

    dump_path, checkpoint = train(
        job,
        tmp_path,
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, eps=0.0),
        checkpoint_step=0,
        poison=None,
        prepare=dead_unit,
    )
    assert open_dump(dump_path).step == 1  # the first update made up.weight NaN; step 1's loss is NaN

    report = run_replay(str(dump_path), options(checkpoint))

    assert report["window"]["broke_at"] == 0 and "non-finite" in report["window"]["why"]
    assert report["verdict"]["kind"] == "optimizer_update"
    assert (
        report["culprit"]["parameter"] in ("up.weight", "up.bias")
        and "eps is 0" in report["culprit"]["optimizer_state"]
    )
    tested = {row["kind"]: row for row in report["remedies"]["tested"]}
    assert tested["adam_eps"]["healthy"] is True


def test_window_replay_needs_consent_a_recorded_window_and_says_so(job, tmp_path):
    dump_path, checkpoint = train(
        job, tmp_path, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), checkpoint_step=2, window_steps=3
    )
    no_trust = CliRunner().invoke(
        main,
        [
            "replay",
            str(dump_path),
            "--device",
            "cpu",
            "--from",
            str(checkpoint),
            "--path",
            str(HERE),
            "--factory",
            "window_job:make_model",
            "--loss",
            "window_job:mse_loss",
        ],
    )
    assert no_trust.exit_code == 2 and "data recipe" in no_trust.output and "--trust" in no_trust.output
    short = CliRunner().invoke(
        main, ["replay", str(dump_path), "--device", "cpu", "--from", str(checkpoint), "--trust", "--path", str(HERE)]
    )
    assert short.exit_code == 2, short.output
    assert "flight recorder holds steps 4..6" in short.output and "GuardConfig.recording.window_steps" in short.output
    pickled = tmp_path / "code.pt"
    torch.save({"model": {"up.weight": torch.zeros(1)}, "hook": math.floor}, pickled)  # a function: not weights-only
    refused = CliRunner().invoke(
        main,
        [
            "replay",
            str(dump_path),
            "--device",
            "cpu",
            "--from",
            str(pickled),
            "--from-step",
            "5",
            "--trust",
            "--path",
            str(HERE),
        ],
    )
    assert refused.exit_code == 2 and "weights-only" in refused.output, refused.output


@pytest.mark.parametrize("form", ["safetensors", "hf_directory"])
def test_a_safetensors_file_or_a_trainer_checkpoint_directory_serves_as_the_checkpoint(job, tmp_path, form):
    """The same break found from the other checkpoint forms: weights in safetensors (+ --from-step), and a Hugging
    Face Trainer-style directory (model.safetensors, optimizer.pt, trainer_state.json's global_step)."""
    import json

    from safetensors.torch import save_file

    dump_path, checkpoint = train(job, tmp_path, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), checkpoint_step=2)
    saved = torch.load(checkpoint, weights_only=True)
    extra = []
    if form == "safetensors":
        target = tmp_path / "model.safetensors"
        save_file(saved["model"], str(target))
        extra = ["--from-step", "2"]
    else:
        target = tmp_path / "checkpoint-2"
        target.mkdir()
        save_file(saved["model"], str(target / "model.safetensors"))
        torch.save(saved["optimizer"], target / "optimizer.pt")
        (target / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main,
        [
            "replay",
            str(dump_path),
            "--device",
            "cpu",
            "--from",
            str(target),
            *extra,
            "--trust",
            "--path",
            str(HERE),
            "-o",
            str(out),
            "--no-rng-check",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["window"]["broke_at"] == 5 and report["window"]["from_step"] == 2
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [POISON]


def test_the_guards_own_host_snapshot_replaces_the_checkpoint(job, tmp_path):
    """RecordConfig(snapshot_every=2): snapshots at steps 0, 2, 4, 6 (two kept); the crash at step 7 carries the
    oldest, step 4 — bitwise the job's state then — and a plain `forensics replay DUMP --trust` re-executes
    steps 4-6 from it and names step 5 and its sample, with no checkpoint of the user's."""
    import json

    dump_path, checkpoint = train(
        job,
        tmp_path,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5),
        checkpoint_step=4,
        window_steps=8,
        snapshot_every=2,
    )
    dump = open_dump(dump_path)
    assert dump.step == 7 and dump.snapshot_step == 4
    saved = torch.load(checkpoint, weights_only=True)
    snapshot_model = dump.model_state(spec.SNAPSHOT_STATE)
    assert snapshot_model.keys() == saved["model"].keys()
    assert all(torch.equal(snapshot_model[k], v) for k, v in saved["model"].items())
    momentum = dump.optimizer_state(spec.SNAPSHOT_STATE)["state"]["up.weight"]["momentum_buffer"]
    assert torch.equal(momentum, saved["optimizer"]["state"][0]["momentum_buffer"])  # up.weight is parameter 0

    shown = CliRunner().invoke(main, ["inspect", str(dump_path)])
    assert "host snapshot: the state before step 4" in shown.output
    assert CliRunner().invoke(main, ["verify", str(dump_path)]).exit_code == 0
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main,
        ["replay", str(dump_path), "--device", "cpu", "--trust", "--path", str(HERE), "-o", str(out), "--no-rng-check"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    window = report["window"]
    assert (window["from_step"], window["broke_at"], window["steps_before_crash"]) == (4, 5, 2)
    assert "host snapshot of step 4" in window["checkpoint"]
    assert window["steps"][0]["replayed_loss"] == window["steps"][0]["recorded_loss"]  # bit for bit from the snapshot
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [POISON]

    plain = CliRunner().invoke(
        main,
        [
            "replay",
            str(dump_path),
            "--device",
            "cpu",
            "--trust",
            "--path",
            str(HERE),
            "-o",
            str(tmp_path / "plain"),
            "--no-rng-check",
            "--no-window",
        ],
    )
    single = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert "window" not in single and plain.exit_code == replay_exit_code(single)  # the verdict's code, no error
    untrusted = run_replay(
        str(dump_path),
        ReplayOptions(
            device="cpu",
            factory="window_job:make_model",
            loss="window_job:mse_loss",
            sys_path=[str(HERE)],
            rng_check=False,
            remedies=False,
        ),
    )
    assert "window" not in untrusted
    assert untrusted["verdict"]["suggestions"][0].startswith(
        "Re-run with --trust: the dump holds the Guard's host snapshot of step 4"
    )


def test_no_snapshot_unless_asked_and_a_config_that_cannot_cover_it_is_refused(job, tmp_path):
    dump_path, _ = train(job, tmp_path, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), checkpoint_step=2)
    dump = open_dump(dump_path)
    assert dump.snapshot_step is None and not dump.has_file(spec.SNAPSHOT_STATE.model)
    with pytest.raises(ValueError, match="window_steps"):
        GuardConfig(recording=RecordConfig(snapshot_every=16, snapshot_count=3, window_steps=32))


def test_a_fix_carried_over_the_following_steps_shows_when_it_only_postpones_the_failure(job, tmp_path):
    """Two bad records, sample 21 at step 5 and sample 25 at step 6. Dropping sample 21 heals step 5, but kept
    for the recorded steps after it, step 6 breaks again; clipping holds over steps 6 and 7 and ranks first."""
    dump_path, checkpoint = train(
        job, tmp_path, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), checkpoint_step=2, poison=[POISON, 25]
    )

    report = run_replay(str(dump_path), options(checkpoint))

    assert report["window"]["broke_at"] == 5
    rows = {row["kind"]: row for row in report["remedies"]["tested"]}
    drop, clip = rows["drop_samples"], rows["clip_grad"]
    assert drop["healthy"] is True and drop["setting"] == {"drop": [POISON]}
    assert drop["following"]["healthy"] is False and drop["following"]["first_unhealthy"] == 6
    assert clip["healthy"] is True and clip["following"] == {
        "tested": True,
        "healthy": True,
        "steps": [6, 7],
        "first_unhealthy": None,
        "why": None,
    }
    kinds = [row["kind"] for row in report["remedies"]["tested"]]
    assert kinds.index("clip_grad") < kinds.index("drop_samples")  # a fix that holds ranks before one that does not
    assert "recorded steps after it (6, 7)" in report["remedies"]["following_steps"]
    suggestions = report["verdict"]["suggestions"]
    assert (
        suggestions[0].startswith("Tested fix (clip the gradient") and "next 2 recorded steps (6, 7)" in suggestions[0]
    )
    assert any("only postpones the failure: step 6 breaks again" in s for s in suggestions)
