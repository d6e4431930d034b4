"""Steps that raise instead of going NaN (issue: "crashes that are not NaN"): the Guard dumps the step that
raised, and `forensics replay` reproduces the exception, bisects the samples to the ones that make it
raise, and names the module, the op and the offending values."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from forensics_test_helpers import fork_server

from forensics.capture import DumpConfig, Guard, GuardConfig, RecordConfig
from forensics.cli import main
from forensics.format import open_dump, verify_dump

REPO = Path(__file__).resolve().parents[2]


def tiny_gpt2(vocab: int = 64):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=vocab,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def replay(dump, *args):
    result = CliRunner().invoke(main, ["replay", str(dump), "--device", "cpu", "--no-rng-check", *map(str, args)])
    return result


@pytest.mark.parametrize("bad_mb", [1, 0], ids=["second-micro-batch", "first-micro-batch"])
def test_out_of_range_token_ids_dumped_and_replayed_to_the_sample_and_the_value(tmp_path, bad_mb):
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="ids"))
    data = torch.Generator().manual_seed(0)
    with pytest.raises(IndexError, match="index out of range"):  # the job still fails as it would have
        for step in range(6):
            with guard.capture_errors():
                for mb in range(2):
                    ids = torch.randint(0, 64, (4, 8), generator=data)
                    if step == 4 and mb == bad_mb:
                        ids[2, 6] = 300
                    guard.record_batch(
                        {"input_ids": ids, "labels": ids, "sample_ids": [f"doc-{step}-{mb}-{i}" for i in range(4)]}
                    )
                    loss = model(input_ids=ids, labels=ids).loss
                    guard.record_loss(loss)
                    (loss / 2).backward()
                if guard.check():
                    optimizer.step()
                optimizer.zero_grad()
    assert len(guard.dumps) == 1
    dump = open_dump(guard.dumps[0])
    assert verify_dump(dump.path).ok and dump.step == 4 and dump.trigger.kind == "exception"
    assert dump.manifest["exception"]["type"] == "IndexError" and dump.manifest["exception"]["during"] == "forward"
    bad = f"doc-4-{bad_mb}-2"
    assert dump.num_micro_batches == bad_mb + 1 and dump.sample_ids(bad_mb)[2] == bad  # the micro-batch in flight
    assert dump.manifest["grad_accum"] == 2  # the step's count, not where it stopped (issue 31)
    out = tmp_path / "report"
    result = replay(dump.path, "-o", out)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "exception" and report["reproduced"] is True
    assert report["dump"]["num_micro_batches"] == 2 and f"micro-batch {bad_mb + 1} of 2" in result.stdout
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [bad]
    assert report["culprit"]["module"] == "transformer.wte" and report["culprit"]["op"] == "aten::embedding"
    assert report["exception"]["bad_values"][0]["value"] == 300 and report["exception"]["bad_values"][0]["limit"] == 64
    assert "token id 300 \u2265 vocabulary size 64 at position 6" in report["verdict"]["headline"]


def test_a_sample_longer_than_the_context_is_named_though_padding_makes_every_subset_fail(tmp_path):
    """Dynamic padding: one 24-token document in a micro-batch of 8-token ones, with GPT-2's 16 positions. The
    position embedding raises for the whole padded micro-batch, so bisection alone would blame the model; the
    replay reads the position ids and the samples' attention masks and names the document by its length."""
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="long"))
    data = torch.Generator().manual_seed(0)
    with pytest.raises(IndexError):
        for step in range(4):
            with guard.capture_errors():
                lengths = [24 if (step, i) == (2, 1) else 6 + i for i in range(4)]
                width = max(lengths)
                ids = torch.zeros(4, width, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, n in enumerate(lengths):
                    ids[i, :n] = torch.randint(1, 64, (n,), generator=data)
                    mask[i, :n] = 1
                labels = ids.masked_fill(mask == 0, -100)
                guard.record_batch(
                    {
                        "input_ids": ids,
                        "attention_mask": mask,
                        "labels": labels,
                        "sample_ids": [f"doc-{step}-{i}" for i in range(4)],
                    }
                )
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                guard.record_loss(loss)
                loss.backward()
                if guard.check():
                    optimizer.step()
                optimizer.zero_grad()
    out = tmp_path / "report"
    result = replay(guard.dumps[0], "-o", out)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "exception"
    [culprit] = report["culprit"]["samples"]
    assert culprit["sample_id"] == "doc-2-1"
    assert culprit["description"] == "it is 24 tokens long, beyond the model's 16 positions"
    assert report["culprit"]["module"] == "transformer.wpe"
    assert (
        "position 16 \u2265 the model's 16 positions (its context length): the micro-batch is 24 tokens long"
        in report["verdict"]["headline"]
    )
    assert not any("vocabulary" in s for s in report["verdict"]["suggestions"])  # not a tokenizer mismatch
    assert "there is no value to compare bit for bit" in result.output


LABEL_MODEL = textwrap.dedent("""
    import torch

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))

    def xent(model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
""")

LABEL_JOB = textwrap.dedent("""
    import sys, torch
    from forensics.capture import DumpConfig, Guard, GuardConfig
    from labelmodel import build, xent

    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=sys.argv[1], run_id="labels",
                                                       dumping=DumpConfig(recipe={"factory": "labelmodel:build"})),
                  loss_fn=xent)
    data = torch.Generator().manual_seed(0)
    for step in range(5):
        x, y = torch.randn(8, 6, generator=data), torch.randint(0, 10, (8,), generator=data)
        if step == 3:
            y[5] = 12          # a mislabelled record: class 12 of a 10-class head
        guard.record_batch({"x": x, "y": y, "sample_ids": [f"row-{step * 8 + i}" for i in range(8)]})
        loss = xent(model, {"x": x, "y": y})
        guard.record_loss(loss)
        loss.backward()
        if guard.check():
            optimizer.step()
        optimizer.zero_grad()
""")


def test_an_uncaught_exception_is_dumped_by_the_excepthook_and_replays_to_the_label(tmp_path):
    (tmp_path / "labeljob.py").write_text(LABEL_JOB)
    (tmp_path / "labelmodel.py").write_text(LABEL_MODEL)
    env = {"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    # `python labeljob.py`: a process of its own (forked from the session's server), its uncaught exception reaching
    # sys.excepthook as the interpreter's top level hands it over
    done = (
        fork_server()
        .shared(REPO)
        .run(
            tmp_path / "labeljob.py",
            [tmp_path / "dumps"],
            cwd=str(tmp_path),
            env=env,
            out_dir=tmp_path / "output",
            timeout=120,
        )
    )
    assert done.returncode == 1 and "IndexError" in done.stderr and "Target 12 is out of bounds" in done.stderr
    step = tmp_path / "dumps" / "labels" / "step-000000003"
    assert step.is_dir(), done.stderr[-3000:]
    out = tmp_path / "report"
    result = replay(step, "--trust", "--path", tmp_path, "-o", out)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["row-29"]
    assert "label 12 \u2265 number of classes 10" in report["verdict"]["headline"]


def test_a_malformed_record_shape_error_names_the_module_whatever_the_samples(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="shape",
            dumping=DumpConfig(recipe={"factory": "torch.nn:Identity"}),
        ),
    )
    with pytest.raises(RuntimeError):
        for step in range(3):
            with guard.capture_errors():
                x = torch.randn(4, 6 if step < 2 else 7)  # a record from a newer schema: one more feature
                guard.record_batch({"x": x, "sample_ids": [f"r{step}-{i}" for i in range(4)]})
                loss = model(x).pow(2).mean()
                guard.record_loss(loss)
                loss.backward()
                if guard.check():
                    optimizer.step()
                optimizer.zero_grad()
    dump = open_dump(guard.dumps[0])
    assert dump.manifest["exception"]["type"] == "RuntimeError" and dump.step == 2


def test_an_exception_on_one_rank_of_two_does_not_hang_and_its_dump_replays(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "tests" / "integrations" / "raise_worker.py"),
            str(tmp_path / "dumps"),
        ],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # 420 s: slow under load, not hung
    assert done.returncode != 0
    rank1 = tmp_path / "dumps" / "raise" / "step-000000002" / "rank-00001"
    assert rank1.is_dir(), done.stdout[-2000:] + done.stderr[-4000:]
    rank0 = tmp_path / "dumps" / "raise" / "step-000000002" / "rank-00000"
    if rank0.exists():  # rank 0 saw its collective fail: it records that another rank stopped, and is not chosen
        manifest = open_dump(rank0).manifest
        assert manifest["trigger"]["local"] is False and manifest["exception"]["peer_failure"] is True
        assert open_dump(rank1.parent).rank == 1
    out = tmp_path / "report"
    result = replay(rank1.parent, "-o", out)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["r1-s2-m1-3"]
    assert report["culprit"]["op"] == "aten::embedding"


@pytest.mark.slow  # an exception on one rank of two and sharded writes are proven each by their own launch
def test_ranks_of_an_fsdp2_job_that_raise_mid_forward_write_a_complete_sharded_dump(tmp_path):
    """FSDP2: both ranks raise in the embedding's forward (root parameters gathered at that moment); each writes
    its own shards with no collective, and the step dump replays to the bad record."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "tests" / "integrations" / "raise_worker.py"),
            str(tmp_path / "dumps"),
            "fsdp2",
        ],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # 420 s: slow under load, not hung
    assert done.returncode != 0
    step = tmp_path / "dumps" / "raise" / "step-000000002"
    assert sorted(p.name for p in step.iterdir()) == ["rank-00000", "rank-00001"], (
        done.stdout[-2000:] + done.stderr[-4000:]
    )
    dumps = verify_dump(step)
    assert dumps.ok, [str(p) for p in dumps.problems]
    assert all(d.sharded and d.manifest["exception"]["type"] == "IndexError" for d in dumps.dumps)
    weights, optimizer = dumps.dumps[0].model_state(), dumps.dumps[0].optimizer_state()
    assert sorted(optimizer["state"]) == sorted(n for n in weights if n != "lm_head.weight")  # tied to wte
    assert all(e["exp_avg"].shape == weights[n].shape for n, e in optimizer["state"].items())
    out = tmp_path / "report"
    result = replay(step, "--rank", "1", "-o", out)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["r1-s2-m1-3"]


MEMORY_CAP = 6 * 10**9  # bytes of address space for the job and the replay: a "device" of a few GB


def _capped(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python ARGS` (a script, or `--cli` and the forensics CLI's arguments) capped at MEMORY_CAP bytes of address
    space: a process of its own, forked from the test session's server (tests/replay/capped.py)."""
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}
    done = (
        fork_server()
        .shared(REPO)
        .run(
            REPO / "tests" / "replay" / "capped.py",
            [MEMORY_CAP, *args],
            cwd=str(cwd),
            env=env,
            out_dir=cwd / f"output-{Path(args[0]).stem.strip('-')}",
            timeout=120,
        )
    )
    return subprocess.CompletedProcess(args, done.returncode, done.stdout, done.stderr)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS caps the address space on Linux")
def test_out_of_memory_from_one_long_sample_names_it_by_its_size(tmp_path):
    """One 100,000-token sample in a dynamically padded micro-batch: the step runs out of memory (the CPU
    allocator, capped like a small device). Every sample of that micro-batch fails with it, so bisection cannot
    tell them apart; replay names the long sample by its size, with the exception and the place."""
    job = _capped([str(REPO / "tests" / "replay" / "oom_job.py"), str(tmp_path / "dumps")], tmp_path)
    assert job.returncode != 0 and "can't allocate memory" in job.stderr, job.stderr[-2000:]
    dump = open_dump(tmp_path / "dumps" / "oom" / "step-000000002")
    recorded = dump.manifest["exception"]
    assert recorded["during"] == "forward" and "memory" in recorded  # the memory picture, taken before freeing
    assert recorded["memory"]["micro_batches"][1]["shapes"]["input_ids"] == [4, 100_000]
    assert recorded["memory"]["host"]["rss"] > 0

    out = tmp_path / "report"
    replayed = _capped(
        ["--cli", "replay", str(dump.path), "--device", "cpu", "--no-rng-check", "--trust", "-o", str(out)], tmp_path
    )
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["kind"] == "exception" and report["reproduced"] is True
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == ["doc-2-1-1"]
    sizes = report["exception"]["sizes"]
    assert sizes["measure"] == "attention_mask" and sizes["outliers"][0]["tokens"] == 100_000
    assert report["verdict"]["headline"].startswith("Sample 'doc-2-1-1' (100,000 tokens,")
    assert "run out of memory in the forward pass" in report["verdict"]["headline"]
    assert (out / "blocklist.jsonl").read_text().split() == ['"doc-2-1-1"']


def test_a_cuda_error_leaves_what_the_host_holds_and_replays_from_the_host_snapshot(tmp_path):
    """After a device-side assert the CUDA context is unusable: the Guard writes what the host still holds (sample
    IDs, RNG, history, the flight recorder, the optimizer's hyper-parameters and its last host snapshot) and says
    the pre-step state is missing. Replay re-executes the recorded steps from the snapshot through the dumped step,
    rebuilding its micro-batches from their IDs, and names the sample and the bad token id.

    No GPU here: the loop turns the CPU's IndexError into the RuntimeError a GPU raises for the same step ("CUDA
    error: device-side assert triggered"), which is what makes the Guard treat the device as unusable."""
    sys.path.insert(0, str(REPO / "tests" / "replay"))
    try:
        import token_job
    finally:
        sys.path.pop(0)
    bad = (5 * 2 + 1) * 4 + 2  # step 5, micro-batch 1, row 2
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(
            dump_dir=str(tmp_path / "dumps"),
            run_id="cuda",
            recording=RecordConfig(snapshot_every=2, window_steps=8),
            dumping=DumpConfig(
                data_recipe={"dataset": "token_job:make_dataset", "dataset_kwargs": {"n": 96, "bad": bad}}
            ),
        ),
    )
    loader = iter(torch.utils.data.DataLoader(token_job.make_dataset(96, bad), batch_size=4))
    with pytest.raises(RuntimeError, match="device-side assert"):
        for _step in range(8):
            with guard.capture_errors():
                for _ in range(2):
                    batch = next(loader)
                    guard.record_batch(batch)
                    try:
                        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                    except IndexError as exc:  # what the same forward raises on a GPU
                        raise RuntimeError(
                            "CUDA error: device-side assert triggered\nCUDA kernel errors might be "
                            "asynchronously reported at some other API call"
                        ) from exc
                    guard.record_loss(loss)
                    (loss / 2).backward()
                if guard.check():
                    optimizer.step()
                optimizer.zero_grad()
    guard.close()
    dump = open_dump(guard.dumps[0])
    assert dump.step == 5 and "CUDA context is unusable" in dump.state_missing
    assert dump.model_state() == {} and dump.snapshot_step == 2 and verify_dump(dump.path).ok
    assert dump.sample_ids(1) == [bad - 2, bad - 1, bad, bad + 1]  # the step's samples, whatever else is lost
    assert dump.manifest["exception"]["cuda_error"] is True

    refused = replay(dump.path, "--path", REPO / "tests" / "replay")
    assert refused.exit_code == 2 and "no pre-step state" in refused.output and "--trust" in refused.output
    out = tmp_path / "report"
    result = replay(dump.path, "--trust", "--path", REPO / "tests" / "replay", "-o", out)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert report["window"]["from_step"] == 2 and [s["step"] for s in report["window"]["steps"]] == [2, 3, 4, 5]
    assert report["verdict"]["kind"] == "exception" and report["reproduced"] is True
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [bad]
    assert report["exception"]["bad_values"][0]["value"] == 300


def test_a_cuda_error_reported_later_than_its_op_is_the_same_failure_replayed_earlier():
    """Without CUDA_LAUNCH_BLOCKING a forward's bad index surfaces at a later call (seen on an H100: the embedding's
    assert was reported in the backward). Replayed on the CPU it raises in the forward: the same failure. One raised
    after the recorded phase is not."""
    from forensics.replay.run.execute import same_exception

    recorded = {"type": "AcceleratorError", "cuda_error": True, "during": "backward", "frames": []}
    assert same_exception({"type": "IndexError", "phase": "forward"}, recorded)
    assert same_exception({"type": "IndexError", "phase": "backward"}, recorded)
    assert not same_exception({"type": "IndexError", "phase": "optimizer"}, recorded)
    assert not same_exception({"type": "IndexError", "phase": "backward"}, {**recorded, "during": "forward"})
