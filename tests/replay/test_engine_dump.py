"""End to end: a real Guard in a real training loop writes a dump; run_replay reads it from disk and
names the culprit sample, module and op, bitwise on the same CPU; consent is enforced for dumps too."""

import json

import pytest
import torch

from forensics.capture import DumpConfig, Guard, GuardConfig
from forensics.core.errors import DumpError, RecipeError, TrainingFaultError
from forensics.report.model import validate_report
from forensics.replay.engine import ReplayOptions, run_replay

POISONED = (1, 2)  # micro-batch, index


def embeds_steps(n_steps: int, poison_last: bool, batch: int = 4, seq: int = 8, micro: int = 2):
    """Steps of micro-batches {"inputs_embeds", "labels", "sample_ids"}; the last step's sample
    POISONED gets a 1e38 entry: finite in the batch, but LayerNorm's variance squares it to inf."""
    g = torch.Generator().manual_seed(3)
    steps = []
    for s in range(n_steps):
        mbs = []
        for m in range(micro):
            mbs.append(
                {
                    "inputs_embeds": torch.randn(batch, seq, 32, generator=g),
                    "labels": torch.randint(0, 64, (batch, seq), generator=g),
                    "sample_ids": [f"s{s}-m{m}-{i}" for i in range(batch)],
                }
            )
        steps.append(mbs)
    if poison_last:
        m, i = POISONED
        steps[-1][m]["inputs_embeds"][i, 0, 0] = 1e38
    return steps


def crash_and_dump(tmp_path, helpers, kit, config_extra=None, autocast_dtype=None):
    model = kit.build_gpt2(dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(tmp_path), run_id="e2e", **(config_extra or {})))
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False, autocast_dtype=autocast_dtype)
    with pytest.raises(TrainingFaultError) as err:
        loop.run(embeds_steps(4, poison_last=True))
    guard.close()
    assert err.value.dump_path is not None, err.value.dump_error
    return err.value.dump_path


def test_guard_dump_replays_to_the_poisoned_sample(tmp_path, helpers, kit):
    dump_path = crash_and_dump(tmp_path, helpers, kit)
    stages = []

    report = run_replay(dump_path.parent, ReplayOptions(device="cpu"), progress=stages.append)  # the step dir

    validate_report(report)
    json.dumps(report, allow_nan=False)
    assert report["dump"]["step"] == 3 and report["dump"]["rank"] == 0 and report["dump"]["missing_ranks"] == []
    assert report["trigger"]["kind"] == "nonfinite_loss" and report["trigger"]["micro_batch"] == 1
    assert report["reproduced"] is True
    fidelity = report["fidelity"]
    assert fidelity["mode"] == "bitwise" and fidelity["bitwise_equal"] is True  # dropout RNG restored
    assert fidelity["replayed_losses"][0] == fidelity["recorded_losses"][0]
    assert report["verdict"]["kind"] == "bad_sample"
    assert report["culprit"]["samples"] == [
        {
            "sample_id": "s3-m1-2",
            "micro_batch": 1,
            "index": 2,
            "rank": 0,
            "description": "its inputs_embeds reaches 1e+38, 3.12e+37x the other samples' largest (3.2)",
        }
    ]
    assert report["culprit"]["phase"] == "forward"
    assert report["culprit"]["module"] == "transformer.h.0.ln_1"
    assert report["culprit"]["op"] == "aten::native_layer_norm"
    assert report["bisection"]["runs"] <= report["bisection"]["budget"]
    assert report["history"]["step"][-1] == 3 and len(report["history"]["loss"]) == 4
    assert report["environment"]["warnings"] == []
    assert any("bisecting" in s for s in stages)


def test_dump_naming_foreign_code_needs_consent(tmp_path, helpers, kit):
    dump_path = crash_and_dump(
        tmp_path,
        helpers,
        kit,
        {"dumping": DumpConfig(recipe={"factory": "not_ours.models:build", "factory_kwargs": {}})},
    )
    with pytest.raises(RecipeError) as err:
        run_replay(dump_path, ReplayOptions(device="cpu"))
    assert "not_ours.models:build" in str(err.value) and "--trust" in str(err.value)
    with pytest.raises(DumpError, match="rank 3"):  # a rank the step does not hold
        run_replay(dump_path.parent, ReplayOptions(device="cpu", rank=3))


def test_bf16_autocast_dump_replays_bitwise_and_fp32_still_fails(tmp_path, helpers, kit):
    dump_path = crash_and_dump(tmp_path, helpers, kit, autocast_dtype=torch.bfloat16)

    report = run_replay(dump_path, ReplayOptions(device="cpu"))

    assert report["fidelity"]["bitwise_equal"] is True  # autocast replayed as recorded
    assert report["precision"]["autocast_dtype"] == "bfloat16"
    assert report["precision"]["fp32_reproduces"] is True  # 1e38 squared overflows fp32 too: data, not bf16
    assert report["verdict"]["kind"] == "bad_sample"
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["s3-m1-2"]


def test_a_large_model_is_reset_from_the_dump_with_the_same_result(tmp_path, helpers, kit, monkeypatch):
    """Above RELOAD_MIN_BYTES the StepRunner keeps no copy of the weights: each reset re-reads them from the
    dump. Lowered to 0 here, the replay must give the same numbers and the same culprit, bit for bit."""
    from forensics.replay.run import execute

    dump_path = crash_and_dump(tmp_path, helpers, kit)
    copied = run_replay(dump_path, ReplayOptions(device="cpu"))
    monkeypatch.setattr(execute, "RELOAD_MIN_BYTES", 0)
    reloaded = run_replay(dump_path, ReplayOptions(device="cpu"))
    assert reloaded["fidelity"] == copied["fidelity"]
    assert reloaded["culprit"] == copied["culprit"] and reloaded["verdict"] == copied["verdict"]
    assert reloaded["per_sample"] == copied["per_sample"]


def test_a_version_1_dump_of_the_old_writer_replays_to_the_same_verdict(tmp_path, helpers, kit):
    """Dumps written before format version 3 (each file's sha256 of its bytes, 64 MiB chunks; the chunked read
    of such a dump: tests/forensics/test_format_digest.py) keep replaying: same culprit, same verdict."""
    dump_path = crash_and_dump(tmp_path, helpers, kit)
    current = run_replay(dump_path, ReplayOptions(device="cpu"))
    helpers.as_version_1_dump(dump_path)
    manifest = json.loads((dump_path / "manifest.json").read_bytes())
    assert manifest["format_version"] == 1
    old = run_replay(dump_path, ReplayOptions(device="cpu"))
    assert old["verdict"] == current["verdict"] and old["culprit"] == current["culprit"]
    assert old["fidelity"] == current["fidelity"]


def test_a_reset_from_the_dump_rereads_only_what_a_pass_may_have_changed(tmp_path, helpers, kit, monkeypatch):
    """A large model is reset from the dump before every pass (a 7B model's weights are 27 GB to re-read): only a
    weight changed since the load is read at the first reset. Passes,
    their kept gradients, an fp32 pass of an fp32 model and the optimizer check (it steps copies) leave the weights
    alone: no weight is read again, and the weights are the pre-step ones, bit for bit. An in-place update is
    seen by the version counters; a write through `.data` (no version bump) by code that says so
    (weights_changed): every weight is read again."""
    from forensics.format import open_dump
    from forensics.replay.load.session import load_session
    from forensics.replay.localize.update import step_each_parameter
    from forensics.replay.run import execute

    monkeypatch.setattr(execute, "RELOAD_MIN_BYTES", 0)
    session = load_session(open_dump(crash_and_dump(tmp_path, helpers, kit)), device="cpu")
    pre_step = {k: v.clone() for k, v in session.model.state_dict().items()}
    reads, reload = [], session.pre_step_weights

    def counted(names=None):
        for name, tensor in reload(names=names):
            reads.append(name)
            yield name, tensor

    def same_as_pre_step() -> bool:
        return all(torch.equal(pre_step[k], v) for k, v in session.model.state_dict().items())

    session.pre_step_weights = counted
    params = {n for n, _ in session.model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        session.model.get_parameter(sorted(params)[0]).mul_(2.0)  # changed after the load, before the runner
    runner = execute.StepRunner(session)
    first = runner.run()
    assert set(reads) & params == {sorted(params)[0]} and same_as_pre_step()  # the load's own weights: not re-read
    reads.clear()
    second = runner.run()
    runner.run(keep_grads=True)
    steps = list(step_each_parameter(session.model, session.optimizer))
    assert steps and any(not torch.equal(s.param, session.model.get_parameter(s.name)) for s in steps)  # copies moved
    runner.run(fp32=True)
    runner.reset()
    assert not params & set(reads)  # buffers only (this model has none)
    assert str(first.losses) == str(second.losses) and str(first.grad_norm) == str(second.grad_norm)  # NaN too
    assert same_as_pre_step()

    with torch.no_grad():
        for p in session.model.parameters():
            p.add_(1.0)  # an in-place update
    runner.reset()
    assert params <= set(reads) and same_as_pre_step()

    reads.clear()
    for p in session.model.parameters():
        p.data.add_(1.0)  # an optimizer of the dump's class writing through .data: no version counter moves
    runner.weights_changed()
    runner.reset()
    assert params <= set(reads) and same_as_pre_step()
