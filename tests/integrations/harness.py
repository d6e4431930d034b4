"""Harness of the integration tests: launch an example under torchrun; a plain-torch reference of its training.

The examples (scripts/examples/) all train the same tiny GPT-2 on the same per-rank samples with the
same AdamW, warm-up and clipping; `reference` replays that training in one process with plain torch,
so a dump's weights and optimizer moments can be checked against state computed without the framework.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from forensics.format import open_dump, spec, verify_dump

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "scripts" / "examples"
WORLD, STEPS, ACCUM, MICRO = 2, 6, 2, 2
POISON, BAD_STEP, BAD_MB = 29, 3, 1  # rank 1 reads sample 29 in step 3, micro-batch 1 (DistributedSampler)
LAUNCH_TIMEOUT = 120  # seconds; a hang fails the test instead of the suite (no test waits longer: tests/README.md).
# A launch takes 15-60 s alone (DeepSpeed's import the most); the launches that need more on a busy 2-core machine
# are the slow-marked ones. A real hang (a rank waiting on a dead peer: gloo's 30-minute timeout) fails within it.


def requires(*modules: str) -> None:
    """Skips the calling test when a framework it runs is not installed (the examples import it)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")


DEEPSPEED_RANK = REPO / "tests" / "integrations" / "deepspeed_rank.py"


def _names(path: str, args: list[str], framework: str) -> bool:
    """Whether a launch runs `framework`: its script, or an example it runs, or an option of the example names it."""
    return any(framework in Path(part).name for part in [path, *args])


def _preload(path: str, args: list[str]) -> list[str]:
    """What the fork server imports once before such a job, instead of each rank (tests/fork_server.py)."""
    modules = []
    if _names(path, args, "deepspeed"):
        # deepspeed.initialize's optimizer check imports ZeRO's Muon, whose torch.compile loads inductor (4-5 s)
        modules += ["deepspeed", "deepspeed.ops:__compatible_ops__", "deepspeed.runtime.zero.muon.muon_optimizer"]
    if _names(path, args, "torchtitan"):
        modules += ["torchtitan.models.llama3.model.model", "torchtitan.models.llama3.infra.parallelize"]
        if "train" in Path(path).name:  # torchtitan's own trainer (tests/integrations/torchtitan_train.py)
            modules += ["torchtitan.train", "torchtitan.models.llama3"]
    return [m for m in modules if importlib.util.find_spec(m.partition(".")[0].partition(":")[0])]


def load_common():
    name = "forensics_examples_common"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / "_common.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass
class Launch:
    returncode: int
    output: str
    reports: dict[int, dict]  # rank -> the example's JSON report line

    def explain(self) -> str:
        return f"exit code {self.returncode}; output tail:\n{self.output[-6000:]}"


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    env.update(extra or {})
    return env


def launch(script: str, args: list[str], **kwargs) -> Launch:
    """Runs scripts/examples/<script> on WORLD ranks (or `nproc`) and collects each rank's report line."""
    return launch_script(str(EXAMPLES / script), args, **kwargs)


def _fork_server():
    from forensics_test_helpers import fork_server  # tests/helpers.py

    return fork_server()


def launch_script(
    path: str,
    args: list[str],
    *,
    nproc: int = WORLD,
    env: dict | None = None,
    timeout: int = LAUNCH_TIMEOUT,
    runner: list[str] | None = None,
    torchrun: bool = False,
) -> Launch:
    """Runs the script at `path` on `nproc` ranks: processes forked from tests/fork_server.py with torchrun's
    environment and failure handling (torch imported once per session), or under torchrun itself (`torchrun=True`:
    for what torchrun does, its SIGTERM to the surviving ranks), or under `runner` (e.g. [python]: one process).
    A DeepSpeed job runs through deepspeed_rank.py: without DeepSpeed's CPU shared-memory op, which training does not
    use and whose build would cost each fresh environment a minute and a half of CPU (that file says why)."""
    preload = _preload(path, args)
    if _names(path, args, "deepspeed"):
        path, args = str(DEEPSPEED_RANK), [path, *args]
    if runner is None and not torchrun:
        server, out_dir = _fork_server(), Path(tempfile.mkdtemp(prefix="forensics-launch-"))
        try:
            done = server.shared(REPO).run(
                path,
                args,
                cwd=str(REPO),
                env=_env(env),
                nproc=nproc,
                distributed=True,
                timeout=timeout,
                out_dir=out_dir,
                preload=preload,
            )
        except server.Timeout as hung:
            pytest.fail(f"{path} hung: no exit within {timeout} s\n{hung.stdout[-3000:]}\n{hung.stderr[-3000:]}")
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        return _collect(done)
    if runner is None:
        runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    try:
        done = subprocess.run(
            [*runner, path, *args], cwd=str(REPO), env=_env(env), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"{path} hung: no exit within {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return _collect(done)


def _collect(done) -> Launch:
    output = done.stdout + done.stderr
    reports = {}
    decoder = json.JSONDecoder()
    for chunk in done.stdout.split("forensics-example ")[1:]:  # ranks share stdout: lines may abut
        report, _ = decoder.raw_decode(chunk)
        reports[report["rank"]] = report
    return Launch(done.returncode, output, reports)


def rank_samples(rank: int, world: int = WORLD) -> list[list[int]]:
    """The micro-batches (dataset indices) a DistributedSampler(shuffle=False) gives `rank`."""
    total = world * STEPS * ACCUM * MICRO
    indices = list(range(rank, total, world))
    return [indices[i : i + MICRO] for i in range(0, len(indices), MICRO)]


def reference_state() -> dict:
    """Plain-torch weights and AdamW state (by parameter name) right before step BAD_STEP."""
    common = load_common()
    torch.manual_seed(0)
    model = common.tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=common.LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, common.warmup)
    dataset = common.EmbedsDataset(WORLD * STEPS * ACCUM * MICRO, poison=POISON)
    per_rank = [rank_samples(rank) for rank in range(WORLD)]
    for step in range(BAD_STEP):
        for rank in range(WORLD):
            for index in per_rank[rank][step * ACCUM : (step + 1) * ACCUM]:
                items = [dataset[i] for i in index]
                loss = model(
                    inputs_embeds=torch.stack([it["inputs_embeds"] for it in items]),
                    labels=torch.stack([it["labels"] for it in items]),
                ).loss
                (loss / (ACCUM * WORLD)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), common.CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": state,
        "lr": optimizer.param_groups[0]["lr"],
    }


# -- checks shared by the multi-rank tests ------------------------------------------------------------
def close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float) -> None:
    assert actual.shape == expected.shape, what
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= atol, f"{what}: max |diff| {diff:.3g} > {atol}"


def check_step_dump(step_dir, reference, *, atol: float = 1e-5, weight_dtype=torch.float32) -> dict:
    """The common acceptance checks; returns {rank: Dump}."""
    result = verify_dump(step_dir)
    assert result.ok, [str(p) for p in result.problems]
    assert result.missing_ranks == []
    dumps = {d.rank: d for d in result.dumps}
    assert sorted(dumps) == [0, 1]
    for rank, dump in dumps.items():
        assert dump.step == BAD_STEP and dump.world_size == 2
        expected_ids = rank_samples(rank)[BAD_STEP * ACCUM : (BAD_STEP + 1) * ACCUM]
        assert [dump.sample_ids(i) for i in range(dump.num_micro_batches)] == expected_ids
    assert dumps[1].trigger.kind == "nonfinite_loss" and dumps[1].trigger.micro_batch == BAD_MB
    assert dumps[1].trigger.local is True and dumps[0].trigger.local is False
    assert POISON in dumps[1].sample_ids(BAD_MB)
    poisoned = dumps[1].micro_batch(BAD_MB)
    row = dumps[1].sample_ids(BAD_MB).index(POISON)
    assert poisoned["inputs_embeds"][row].float().abs().max().item() >= 1e37
    assert open_dump(step_dir).rank == 1  # the default is the rank that saw the fault first-hand

    for rank, dump in dumps.items():
        weights = dump.model_state()
        assert sorted(weights) == sorted(reference["model"]), rank
        for name, expected in reference["model"].items():
            assert weights[name].dtype == (weight_dtype if expected.is_floating_point() else expected.dtype), name
            close(weights[name], expected, f"rank {rank} weight {name}", atol)
        optimizer = dump.optimizer_state()
        assert optimizer["class"] == "torch.optim.adamw.AdamW"
        [group] = optimizer["param_groups"]
        assert math.isclose(group["lr"], reference["lr"], rel_tol=1e-6)
        assert sorted(optimizer["state"]) == sorted(reference["optimizer"])
        for name, entries in reference["optimizer"].items():
            assert float(optimizer["state"][name]["step"]) == float(entries["step"]) == BAD_STEP
            for key in ("exp_avg", "exp_avg_sq"):
                close(optimizer["state"][name][key], entries[key], f"rank {rank} {key} {name}", atol)
    return dumps


def run_example(tmp_path, script: str, run_id: str, *extra):
    """Runs an example on WORLD ranks with the corrupt sample; returns (its step directory, the Launch)."""
    dump_dir = tmp_path / "dumps"
    result = launch(script, ["--dump-dir", str(dump_dir), "--run-id", run_id, *extra])
    # Every rank finished its work and reported (the exit code would also count gloo teardown races).
    assert sorted(result.reports) == [0, 1], result.explain()
    for report in result.reports.values():
        assert report["dump"] and report["dump_error"] is None, report
    return dump_dir / run_id / f"step-{BAD_STEP:09d}", result


def replay_names_sample_and_layer(step_dir) -> None:
    """A one-process replay of rank 1's dump names the corrupt sample and the layer where NaN appears."""
    from forensics.replay import engine  # a broken import fails the test; it is never a skip

    report = engine.run_replay(str(step_dir), engine.ReplayOptions(device="cpu", rank=1))
    culprit = report["culprit"]
    assert [(s["sample_id"], s["rank"]) for s in culprit["samples"]] == [(POISON, 1)]
    assert culprit["module"] == "transformer.h.0.ln_1" and culprit["phase"] == "forward"


def state_bytes(step_dir) -> tuple[int, int, list[int]]:
    """(state bytes the ranks wrote (their own shards and the copies of other ranks'), bytes of one copy of the
    state, state bytes per rank)."""
    per_rank, one_copy = [], None
    for path in sorted(step_dir.glob("rank-*")):
        manifest = json.loads((path / "manifest.json").read_text())
        layout = manifest["layout"]
        assert manifest["format_version"] in (spec.SHARDED_VERSION, spec.CHUNK_DIGEST_VERSION)  # 3: large files
        rows = layout["tensors"]
        copy = sum(math.prod(r["shape"]) * spec.ITEM_SIZE[r["dtype"]] for f in rows.values() for r in f.values())
        assert one_copy in (None, copy)
        one_copy = copy
        tables = [*layout["shards"].items(), *((c["of"], c["shards"]) for c in layout.get("copies", {}).values())]
        per_rank.append(
            sum(
                math.prod(s["shape"]) * spec.ITEM_SIZE[rows[f][n]["dtype"]]
                for f, shards in tables
                for n, s in shards.items()
            )
        )
    return sum(per_rank), one_copy, per_rank
