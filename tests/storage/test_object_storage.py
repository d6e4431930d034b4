"""Dumps written straight to object storage and read from there, against a real S3 protocol server (conftest.py).

What a user on a cluster without a shared file system relies on: a job whose `dump_dir` is `s3://...` writes each
rank's dump there and nothing on its pods' disks; `forensics list / inspect / verify / replay / pack` take the URL;
a rank killed mid-write leaves a dump every reader calls incomplete; a bucket that refuses writes costs the job one
logged line; credentials never reach a dump, a log line or an error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from forensics.cli import main
from forensics.core.errors import CaptureError, NotADumpError
from forensics.format import open_dump, spec, verify_dump, write_dump
from forensics.format.location import RemotePath, as_location

REPO = Path(__file__).resolve().parents[2]


def _harness():
    from forensics_test_helpers import load_test_module  # set by tests/conftest.py

    return load_test_module("forensics_integration_harness", REPO / "tests" / "integrations" / "harness.py")


def _embeds_steps(n_steps: int, batch: int = 4, seq: int = 8, micro: int = 2) -> list:
    """Steps of micro-batches for tests/helpers.py's tiny GPT-2; the last step's sample 's<last>-m1-2' holds a 1e38
    entry, which LayerNorm's variance squares to inf."""
    g = torch.Generator().manual_seed(3)
    steps = [
        [
            {
                "inputs_embeds": torch.randn(batch, seq, 32, generator=g),
                "labels": torch.randint(0, 64, (batch, seq), generator=g),
                "sample_ids": [f"s{s}-m{m}-{i}" for i in range(batch)],
            }
            for m in range(micro)
        ]
        for s in range(n_steps)
    ]
    steps[-1][1]["inputs_embeds"][2, 0, 0] = 1e38
    return steps


def test_a_guarded_job_dumps_to_s3_and_the_dump_replays_and_reproduces_from_there(s3_server, bucket, tmp_path):
    """A real Guard in a real loop with dump_dir an s3:// URL (in this process: the two-rank FSDP2 job below runs
    with --runslow): nothing on the job's disk; `forensics replay s3://.../step-N` names the planted sample and the
    layer; `forensics repro` writes scripts that read the dump where it is."""
    from forensics_test_helpers import TrainLoop, make_gpt2

    from forensics.capture import Guard, GuardConfig
    from forensics.core.errors import TrainingFaultError

    root = f"s3://{bucket}/dumps"
    workdir = tmp_path / "pod"
    workdir.mkdir()
    model = make_gpt2(dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=root, run_id="tiny-s3"))
    with pytest.raises(TrainingFaultError) as raised:
        TrainLoop(model, optimizer, guard, snapshot=False).run(_embeds_steps(4))
    guard.close()
    step_url = f"{root}/tiny-s3/{spec.step_dir_name(3)}"
    assert str(raised.value.dump_path) == f"{step_url}/{spec.rank_dir_name(0)}", raised.value.dump_error
    assert not any(workdir.iterdir()) and not (REPO / "s3:").exists()  # no local copy anywhere

    runner = CliRunner()
    out = tmp_path / "report"
    replayed = runner.invoke(main, ["replay", step_url, "--device", "cpu", "-o", str(out), "--no-remedies"])
    assert replayed.exit_code == 0, (replayed.output, replayed.exception)  # a culprit named
    report = json.loads((out / "report.json").read_text())
    assert [(s["sample_id"], s["rank"]) for s in report["culprit"]["samples"]] == [("s3-m1-2", 0)]
    assert report["culprit"]["module"] == "transformer.h.0.ln_1"
    assert report["verdict"]["kind"] == "bad_sample" and report["dump"]["path"] == step_url

    repro = tmp_path / "repro"  # the scripts read the dump where it is: no copy on the machine that runs them
    written = runner.invoke(main, ["repro", step_url, "-o", str(repro), "--report", str(out)])
    assert written.exit_code == 0, (written.output, written.exception)
    assert json.loads((repro / "model.json").read_text())["dump"] == step_url
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    ran = subprocess.run(
        [sys.executable, str(repro / "model_repro.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 1 and "AssertionError" in ran.stderr, ran.stderr[-3000:]


def test_a_two_rank_sharded_dump_in_s3_is_verified_listed_and_read_whole_from_either_rank(s3_server, bucket):
    """Each of two ranks wrote its own part of the state to the bucket (the sharded layout an FSDP2 job writes):
    verify, list and inspect read the URL, and either rank's dump reads the whole state back by range reads."""
    from forensics_test_helpers import bitwise_equal, synthetic_content

    from forensics.capture.state.sharding import shard_state

    root = f"s3://{bucket}/dumps"
    for rank in (0, 1):
        content, originals = synthetic_content(step=9, rank=rank, world_size=2, run_id="sharded")
        state, table = shard_state(
            {"model": content.model, "optimizer": content.optimizer}, rank, 2, 1, lambda tensor: tensor
        )
        content.model, content.optimizer, content.layout = state["model"], state["optimizer"], table
        write_dump(content, root)
    step_url = f"{root}/sharded/{spec.step_dir_name(9)}"
    assert f"{bucket}/dumps/sharded/{spec.step_dir_name(9)}/rank-00001/{spec.MANIFEST}" in s3_server.keys(bucket)
    checked = verify_dump(step_url)
    assert checked.ok and checked.missing_ranks == [], [str(p) for p in checked.problems]
    assert sorted(d.rank for d in checked.dumps) == [0, 1] and all(d.sharded for d in checked.dumps)

    runner = CliRunner()
    listed = runner.invoke(main, ["list", root, "--json"])
    assert listed.exit_code == 0, listed.output
    [row] = json.loads(listed.output)["dumps"]
    assert row["step"] == 9 and row["ranks"] == [0, 1] and row["path"] == step_url
    inspected = runner.invoke(main, ["inspect", step_url, "--rank", "1"])
    assert inspected.exit_code == 0 and "nonfinite_loss" in inspected.output, inspected.output
    for rank in (0, 1):
        model = open_dump(step_url, rank=rank).model_state()
        for name, tensor in originals["model"].items():
            assert bitwise_equal(model[name], tensor.contiguous()), (rank, name)


@pytest.mark.slow  # 5 minutes of a 2-core machine: the tests above prove its parts in seconds
def test_a_two_rank_fsdp2_job_dumps_to_s3_and_the_dump_replays_from_there(s3_server, bucket, tmp_path):
    """The issue's acceptance run: FSDP2 on two gloo ranks, dump_dir an s3:// URL; nothing is written to the
    ranks' disks; verify, list and inspect read the URL; `forensics replay s3://.../step-N --rank 1` names the
    planted sample and the layer."""
    harness = _harness()
    harness.requires("transformers")
    root = f"s3://{bucket}/dumps"
    workdir = tmp_path / "pod"
    workdir.mkdir()
    result = harness.launch("fsdp2_example.py", ["--dump-dir", root, "--run-id", "fsdp2-s3"])
    assert sorted(result.reports) == [0, 1], result.explain()
    step_url = f"{root}/fsdp2-s3/{spec.step_dir_name(harness.BAD_STEP)}"
    for rank, report in result.reports.items():
        assert report["dump_error"] is None, report
        assert report["dump"] == f"{step_url}/{spec.rank_dir_name(rank)}", report
    assert not (REPO / "s3:").exists() and not any(workdir.iterdir())  # no local copy anywhere

    keys = s3_server.keys(f"{bucket}/dumps")
    assert f"{bucket}/dumps/fsdp2-s3/{spec.step_dir_name(harness.BAD_STEP)}/rank-00001/{spec.MANIFEST}" in keys
    checked = verify_dump(step_url)
    assert checked.ok and checked.missing_ranks == [], [str(p) for p in checked.problems]
    assert all(d.sharded for d in checked.dumps)  # each rank wrote its own part of the state

    runner = CliRunner()
    listed = runner.invoke(main, ["list", root, "--json"])
    assert listed.exit_code == 0, listed.output
    [row] = json.loads(listed.output)["dumps"]
    assert row["step"] == harness.BAD_STEP and row["ranks"] == [0, 1] and row["path"] == step_url
    inspected = runner.invoke(main, ["inspect", step_url, "--rank", "1"])
    assert inspected.exit_code == 0 and "nonfinite_loss" in inspected.output, inspected.output

    out = tmp_path / "report"
    replayed = runner.invoke(main, ["replay", step_url, "--rank", "1", "--device", "cpu", "-o", str(out)])
    assert replayed.exit_code == 0, (replayed.output, replayed.exception)  # a culprit named
    report = json.loads((out / "report.json").read_text())
    assert [(s["sample_id"], s["rank"]) for s in report["culprit"]["samples"]] == [(harness.POISON, 1)]
    assert report["culprit"]["module"] == "transformer.h.0.ln_1"
    assert report["verdict"]["kind"] == "bad_sample" and report["dump"]["path"] == step_url

    repro = tmp_path / "repro"  # the scripts read the dump where it is: no copy on the machine that runs them
    written = runner.invoke(main, ["repro", step_url, "--rank", "1", "-o", str(repro), "--report", str(out)])
    assert written.exit_code == 0, (written.output, written.exception)
    assert json.loads((repro / "model.json").read_text())["dump"] == step_url
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    ran = subprocess.run(
        [sys.executable, str(repro / "model_repro.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 1 and "AssertionError" in ran.stderr, ran.stderr[-3000:]


@pytest.mark.xdist_group("torchtitan")  # one worker imports torchtitan (tests/integrations/test_torchtitan.py)
def test_a_torchtitan_job_configured_to_dump_to_s3_replays_from_there(s3_server, bucket, tmp_path):
    """torchtitan's own trainer, the Guard and its dump_dir set by configuration alone (`--forensics.dump_dir`), two
    CPU ranks under its FSDP: the sharded dump lands in the bucket, and `forensics replay s3://... --rank 1` names
    the record whose labels are all masked."""
    harness = _harness()
    harness.requires("torchtitan")
    integrations = REPO / "tests" / "integrations"
    root = f"s3://{bucket}/titan"
    result = harness.launch_script(
        str(integrations / "torchtitan_train.py"),
        ["--job.config_file", str(integrations / "titan_job.toml"), "--job.dump_folder", str(tmp_path / "pod")]
        + ["--forensics.dump_dir", root],
    )
    assert "TrainingFaultError: step 3: loss of micro-batch 2 is nan" in result.output, result.explain()
    assert not any((tmp_path / "pod").rglob("manifest.json"))  # no dump on the pods' disks
    step_url = f"{root}/titan/step-000000003"
    checked = verify_dump(step_url)
    assert checked.ok and sorted(d.rank for d in checked.dumps) == [0, 1] and all(d.sharded for d in checked.dumps)
    out = tmp_path / "replay"
    replayed = CliRunner().invoke(
        main, ["replay", step_url, "--rank", "1", "--device", "cpu", "-o", str(out), "--no-remedies", "--no-rng-check"]
    )
    assert replayed.exit_code == 0, (replayed.output, replayed.exception)
    report = json.loads((out / "report.json").read_text())
    assert [(s["sample_id"], s["rank"]) for s in report["culprit"]["samples"]] == [("dp1:5", 1)]


def test_a_dump_round_trips_through_s3_bit_for_bit_and_packs_to_a_local_archive(s3_server, bucket, tmp_path):
    """Every loader reads from the URL (tensors by range reads) what was written; `pack` makes a local archive of
    it that verifies; the keys are the layout's, the manifest among them."""
    from forensics_test_helpers import bitwise_equal, read_everything, synthetic_content, trees_equal

    content, originals = synthetic_content(step=11)
    path = write_dump(content, f"s3://{bucket}/dumps")
    assert isinstance(path, RemotePath) and str(path) == f"s3://{bucket}/dumps/run-test/step-000000011/rank-00000"
    back = read_everything(str(path))
    assert back["verify"].ok, [str(p) for p in back["verify"].problems]
    for name, tensor in originals["model"].items():
        assert back["model"][name].dtype == tensor.dtype and back["model"][name].shape == tensor.shape, name
        assert bitwise_equal(back["model"][name], tensor.contiguous()), name
    assert trees_equal(back["batches"][:2], originals["batches"][:2])

    archive = tmp_path / "step.tar.zst"
    packed = CliRunner().invoke(main, ["pack", str(path.parent), "-o", str(archive)])
    assert packed.exit_code == 0, packed.output
    assert verify_dump(archive).ok
    assert trees_equal(read_everything(archive)["batches"][:2], originals["batches"][:2])


KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    sys.path[:0] = [sys.argv[2], os.path.join(sys.argv[2], "tests")]
    import torch
    from forensics.format import writer
    from helpers import synthetic_content

    original, calls = writer.write_safetensors, []

    def write_then_hang(out, tensors, *rest, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the model's file is in the store; the optimizer's is being written
            out.write(b"\\0" * (6 << 20))  # past one upload part: a multipart upload is under way
            print("writing", flush=True)
            time.sleep(600)
        return original(out, tensors, *rest, **kwargs)

    writer.write_safetensors = write_then_hang
    content, _ = synthetic_content(step=5, rank=1, world_size=2)
    writer.write_dump(content, sys.argv[1])
    """
)


def test_a_rank_killed_mid_write_leaves_a_dump_every_reader_calls_incomplete(s3_server, bucket, tmp_path):
    """SIGKILL while rank 1 uploads its dump: what it wrote stays in the bucket without a manifest; verify names the
    rank as missing (exit 2), list shows the step with one rank of two, and rank 0 is still read."""
    from forensics_test_helpers import synthetic_content

    root = f"s3://{bucket}/dumps"
    content, _ = synthetic_content(step=5, rank=0, world_size=2)
    write_dump(content, root)
    script = tmp_path / "killed_writer.py"
    script.write_text(KILLED_WRITER)
    writer = subprocess.Popen(
        [sys.executable, str(script), root, str(REPO)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = writer.stdout.readline()
        assert line.strip() == "writing", writer.stderr.read()[-3000:]
        time.sleep(0.5)  # the upload's first part is on its way
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(30)
    rank1 = f"{bucket}/dumps/run-test/step-000000005/rank-00001"
    left = s3_server.keys(rank1)
    assert left and f"{rank1}/{spec.MANIFEST}" not in left  # files of the killed rank, never its manifest

    step_url = f"{root}/run-test/step-000000005"
    runner = CliRunner()
    verified = runner.invoke(main, ["verify", step_url])
    assert verified.exit_code == 2, verified.output
    assert "rank-1" in verified.output or "rank-00001" in verified.output, verified.output
    assert "did not finish writing" in verified.output
    with pytest.raises(NotADumpError, match="not a complete dump"):
        open_dump(f"{step_url}/rank-00001")
    assert open_dump(step_url).rank == 0
    listed = json.loads(runner.invoke(main, ["list", root, "--json"]).output)["dumps"]
    assert [(r["step"], r["ranks"], r["world_size"]) for r in listed] == [(5, [0], 2)]


def _train_tiny(root: str, run_id: str, steps: int = 4, nan_step: int = 2):
    """A tiny MLP under a Guard whose dump_dir is `root`, a NaN planted at `nan_step` (policy skip); returns the
    Guard (closed) and the losses of every step."""
    from forensics.capture import DetectionConfig, Guard, GuardConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GuardConfig(dump_dir=root, run_id=run_id, detection=DetectionConfig(on_nonfinite="skip"))
    guard, losses = Guard(model, optimizer, config=config), []
    for step in range(steps):
        x = torch.randn(8, 4)
        if step == nan_step:
            x[0, 0] = float("nan")
        guard.record_batch({"x": x, "sample_ids": list(range(step * 8, step * 8 + 8))})
        loss = model(x).pow(2).mean()
        guard.record_loss(loss)
        loss.backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    guard.close()
    return guard, losses


def test_a_bucket_that_refuses_writes_costs_the_job_one_logged_line(s3_server, caplog):
    """dump_dir names a bucket that does not exist: the NaN step is still handled by the policy (skipped), training
    goes on, and the failed dump is one error line naming the location, with no credential in it."""
    root = "s3://forensics-no-such-bucket/dumps"
    guard, losses = _train_tiny(root, "refused")
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses[3:])))  # the job went on past the NaN
    assert guard.dumps == [] and len(guard.dump_errors) == 1
    [error] = guard.dump_errors
    assert "\n" not in error and root in error, error
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in caplog.text + error


def test_no_credential_reaches_the_dump_or_the_log(s3_server, bucket, caplog, monkeypatch):
    """The job's secret key (environment), a token on its command line and a URL password there: none is in any
    object of the dump, nor in what the job logged."""
    from forensics.capture.dumping import environment

    token, password = "hf_job_token_value_123", "url-password-456"
    monkeypatch.setattr(
        sys, "argv", ["train.py", "--hf-token", token, f"--mirror=https://me:{password}@example.com/x", "--lr", "3"]
    )
    environment._static_environment.cache_clear()
    try:
        guard, _ = _train_tiny(f"s3://{bucket}/dumps", "secrets")
    finally:
        environment._static_environment.cache_clear()
    [path] = guard.dumps
    assert open_dump(str(path)).manifest["environment"]["argv"][1:3] == ["--hf-token", "<redacted>"]
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for key in s3_server.keys(bucket):
        data = fs.cat_file(key)
        for secret in (os.environ["AWS_SECRET_ACCESS_KEY"], token, password):
            assert secret.encode() not in data, (key, secret)
    for secret in (os.environ["AWS_SECRET_ACCESS_KEY"], token, password):
        assert secret not in caplog.text


def test_a_run_with_many_steps_lists_every_step_from_the_store():
    """`forensics list URL` finds every step of a run (one recursive listing), in step order. On fsspec's in-memory
    store: the listing is the same fsspec call for every protocol, and 24 dumps written to the S3 server took minutes."""
    pytest.importorskip("fsspec")
    from forensics_test_helpers import synthetic_content

    root = f"memory://forensics-{uuid.uuid4().hex[:12]}/dumps"
    steps = list(range(3, 3 + 24 * 7, 7))
    for step in steps:
        content, _ = synthetic_content(step=step, run_id="long-run")
        write_dump(content, root)
    result = CliRunner().invoke(main, ["list", root, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["dumps"]
    assert [r["step"] for r in rows] == steps
    assert all(r["run_id"] == "long-run" and r["ranks"] == [0] and r["error"] is None for r in rows)
    text = CliRunner().invoke(main, ["list", root]).output
    assert sum(line.startswith("long-run ") for line in text.splitlines()) == len(steps)


def test_a_url_that_cannot_be_read_is_a_clear_error_exit_2(s3_server):
    runner = CliRunner()
    missing = runner.invoke(main, ["verify", "s3://forensics-no-such-bucket/run/step-000000001"])
    assert missing.exit_code == 2 and "does not exist" in missing.output, missing.output
    secret = runner.invoke(main, ["inspect", "s3://user:hunter2@bucket/run"])
    assert secret.exit_code == 2 and "password" in secret.output and "hunter2" not in secret.output


def test_the_location_of_a_url_behaves_like_a_path(tmp_path):
    """RemotePath on fsspec's in-memory filesystem (no server): the operations the reader and writer use, and a
    dump written and read there."""
    pytest.importorskip("fsspec")
    from forensics_test_helpers import read_everything, synthetic_content

    root = as_location("memory://forensics-test/dumps")
    assert isinstance(root, RemotePath) and str(root) == "memory://forensics-test/dumps"
    assert as_location("file:///tmp/x") == Path("/tmp/x") and as_location("dumps") == Path("dumps")
    assert (root / "a" / "b").parent == root / "a" and (root / "a").name == "a"
    with pytest.raises(ValueError):
        root / "../escape"
    content, _ = synthetic_content(step=2)
    path = write_dump(content, str(root))
    assert path.is_dir() and (path / spec.MANIFEST).is_file() and not path.is_symlink()
    assert sorted(p.name for p in path.parent.glob("rank-*")) == ["rank-00000"]
    assert read_everything(str(path))["verify"].ok
    with pytest.raises(CaptureError, match="already exists"):  # a second dump never overwrites the first
        write_dump(synthetic_content(step=2)[0], str(root))
    assert read_everything(str(path))["verify"].ok
