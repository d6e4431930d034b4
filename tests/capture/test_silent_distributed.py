"""Silent corruption on two ranks (gloo, CPU, separate processes, a DDP model): a fault injected on rank 1 that makes
no NaN and no spike — a transient bit flip in a module's output, a stuck fault that repeats on rank 1, a bit flipped
in rank 1's copy of a weight — is caught at the step it happens, every rank dumps that step, and the replay names
the class, the module (or parameter) and rank 1; a run with no fault, in bf16 autocast and checked at every step,
raises nothing."""

from __future__ import annotations

import json
import math
import os
import shutil
import textwrap
from pathlib import Path

import pytest
from forensics_test_helpers import fork_server

from forensics.replay.engine import ReplayOptions, run_replay
from forensics.format import open_dump, open_step

MODELS = textwrap.dedent("""
    import torch

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def loss(model, batch):
        return (model(batch["x"]).float() - batch["y"]).square().mean()
""")

WORKER = textwrap.dedent("""
    import json, math, os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig
    from forensics.capture.config import SilentConfig
    from forensics.capture.silent.inject import FaultSpec
    import sdc_models

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.environ["FORENSICS_TEST_STORE"],
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    FAULT_STEP = 10
    SCENARIOS = {
        # (steps, SilentConfig)
        "transient": (13, SilentConfig(recompute_every=5, replica_every=0, on_mismatch="skip",
                                       inject=FaultSpec("output:0", rank=1, step=FAULT_STEP, bit=2))),
        "stuck": (16, SilentConfig(recompute_every=5, replica_every=0, on_mismatch="skip",
                                   inject=FaultSpec("output:0", rank=1, step=FAULT_STEP, bit=2, stuck=True))),
        "drift": (11, SilentConfig(recompute_every=0, replica_every=5, on_mismatch="skip",
                                   inject=FaultSpec("weight:2.weight", rank=1, step=FAULT_STEP, bit=3))),
        "healthy": (int(os.environ.get("SDC_HEALTHY_STEPS", "40")),
                    SilentConfig(recompute_every=1, replica_every=1)),
        # FSDP2 (bf16 parameters, its all-gathers and reduce-scatters): the forward is recomputed, by every rank
        "fsdp_flip": (13, SilentConfig(recompute_every=5, on_mismatch="skip",
                                       inject=FaultSpec("output:0", rank=1, step=FAULT_STEP, bit=2))),
        "fsdp_healthy": (int(os.environ.get("SDC_HEALTHY_STEPS", "40")), SilentConfig(recompute_every=1)),
    }


    def sharded(model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model[0], mesh=mesh, mp_policy=policy)  # the last layer's parameters are the root's (as a
        return fully_shard(model, mesh=mesh, mp_policy=policy)  # GPT's embeddings): FSDP2 keeps them after a forward


    def run(scenario, dump_dir):
        steps, silent = SCENARIOS[scenario]
        model = sdc_models.build()
        fsdp = scenario.startswith("fsdp")
        wrapped = model = sharded(model) if fsdp else DistributedDataParallel(model)
        model = model if fsdp else wrapped.module
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        config = GuardConfig(dump_dir=dump_dir, run_id="sdc", detection=DetectionConfig(silent=silent),
                             dumping=DumpConfig(recipe={"factory": "sdc_models:build", "loss": "sdc_models:loss"}))
        guard = Guard(wrapped, optimizer, config=config, loss_fn=sdc_models.loss)
        losses, decisions = [], []
        for step in range(steps):
            step_loss = 0.0
            for micro in range(2):
                g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
                batch = {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 1, generator=g),
                         "sample_ids": [f"r{rank}s{step}m{micro}i{i}" for i in range(4)]}
                guard.record_batch(batch)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scenario == "healthy"):
                    loss = (wrapped(batch["x"]).float() - batch["y"]).square().mean()
                guard.record_loss(loss)
                (loss / 2).backward()
                step_loss += float(loss) / 2
            losses.append(step_loss)
            ok = guard.check(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0))
            decisions.append(ok)
            if ok:
                optimizer.step()
            optimizer.zero_grad()
        guard.close()
        injected = guard.silent.injector.injected if guard.silent.injector is not None else []
        return {"rank": rank, "losses": losses, "decisions": decisions, "dumps": [str(p) for p in guard.dumps],
                "injected": injected, "dump_errors": guard.dump_errors}


    only = os.environ.get("SDC_SCENARIOS", ",".join(SCENARIOS)).split(",")
    results = {name: run(name, os.path.join(sys.argv[1], name)) for name in only}
    sys.stdout.write("two-ranks " + json.dumps(results) + "\\n")  # one write: print's pieces of two ranks interleave
    sys.stdout.flush()
    dist.barrier()
    os._exit(0)
""")

LAUNCH_TIMEOUT = 120  # no test waits on a wall clock over 120 s (tests/README.md)
FAULT_STEP = 10


def launch(tmp_path: Path, scenarios: str, healthy_steps: int = 40) -> tuple[Path, dict]:
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "sdc_models.py").write_text(MODELS)
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "FORENSICS_TEST_STORE": str(tmp_path / "store"),
        "OMP_NUM_THREADS": "1",
        "SDC_SCENARIOS": scenarios,
        "SDC_HEALTHY_STEPS": str(healthy_steps),
        "PYTHONPATH": os.pathsep.join([str(root), str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    server = fork_server()
    try:
        done = server.shared(root).run(
            tmp_path / "worker.py",
            [tmp_path / "dumps"],
            cwd=str(tmp_path),
            env=env,
            nproc=2,
            distributed=True,
            out_dir=tmp_path / "output",
            timeout=LAUNCH_TIMEOUT,
        )
    except server.Timeout as hung:
        pytest.fail(f"the two-rank run did not finish in {LAUNCH_TIMEOUT} s\n{hung.stderr[-3000:]}")
    outputs, decoder = [], json.JSONDecoder()
    for chunk in done.stdout.split("two-ranks ")[1:]:
        outputs.append(decoder.raw_decode(chunk.lstrip())[0])
    assert len(outputs) == 2, f"exit code {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    by_scenario = {name: sorted((o[name] for o in outputs), key=lambda r: r["rank"]) for name in outputs[0]}
    return tmp_path / "dumps", by_scenario


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict, Path]:
    tmp_path = tmp_path_factory.mktemp("sdc")
    root, results = launch(tmp_path, "transient,stuck,drift,healthy,fsdp_flip,fsdp_healthy")
    return root, results, tmp_path


def replay(step_dir: Path, models_dir: Path, rank: int | None = None) -> dict:
    return run_replay(step_dir, ReplayOptions(device="cpu", trust=True, sys_path=[str(models_dir)], rank=rank))


def steps_dumped(result: dict) -> list[int]:
    return sorted(open_dump(p).step for p in result["dumps"])


def no_nan_no_spike(losses: list[float]) -> None:
    assert all(math.isfinite(v) for v in losses)
    before = losses[FAULT_STEP - 4 : FAULT_STEP]
    assert losses[FAULT_STEP] < 1.5 * max(before), (losses[FAULT_STEP], before)  # no spike: the guard sees nothing


def test_a_transient_bit_flip_on_rank_1_is_caught_at_its_step_and_replayed_as_transient(two_ranks):
    root, results, models = two_ranks
    rank0, rank1 = results["transient"]
    assert rank1["injected"] == [FAULT_STEP] and rank0["injected"] == []
    no_nan_no_spike(rank1["losses"])
    for result in (rank0, rank1):  # every rank dumps the step, and the step is skipped (policy 'skip') on both
        assert steps_dumped(result) == [FAULT_STEP], result
        assert result["decisions"][FAULT_STEP] is False and all(result["decisions"][:FAULT_STEP])
    step_dir = root / "transient" / "sdc" / f"step-{FAULT_STEP:09d}"
    dumps = {d.rank: d for d in open_step(step_dir)[0]}
    assert dumps[1].trigger.kind == "silent_corruption" and dumps[1].trigger.local is True
    assert dumps[0].trigger.local is False
    evidence = dumps[1].silent()
    assert evidence["check"] == "recompute" and evidence["policy"] == "skip"
    assert evidence["first_difference"]["name"] == "0" and evidence["first_difference"]["where"] == "forward"
    assert evidence["device"]["type"] == "cpu" and evidence["device"]["host"]
    report = replay(step_dir, models)  # the reader opens the rank whose check fired
    assert report["dump"]["rank"] == 1
    assert report["verdict"]["kind"] == "silent_corruption" and report["schema"] == "forensics-report/5"
    silent = report["silent"]
    assert silent["class"] == "transient" and silent["wrong"] == "job", report["verdict"]
    assert silent["module"] == "0" and report["culprit"]["module"] == "0"
    assert silent["drain_rank"] == 1 and "rank 1" in report["verdict"]["headline"]
    assert silent["evidence"] == "replay" and silent["job_deterministic"] is True  # a CPU job: deterministic kernels
    table = silent["comparison"]  # module by module, job / recompute / replay, where the replay parts from the job
    assert table["columns"] == ["call", "module", "job", "recompute", "replay"] and table["rows"]
    assert any(row[1] == "0" and row[2] != row[3] and row[3] == row[4] for row in table["rows"])


def test_a_stuck_fault_on_rank_1_is_caught_by_the_cross_rank_check_and_replayed_as_persistent(two_ranks):
    """A fault that gives the same wrong answer at every call: rank 1's recompute agrees with its run, but its run of
    rank 0's micro-batch does not agree with rank 0's; it repeats at the next sampled step; the replay on another
    process (no fault) differs from rank 1's two agreeing runs: persistent, drain rank 1."""
    root, results, models = two_ranks
    rank0, rank1 = results["stuck"]
    no_nan_no_spike(rank1["losses"])
    for result in (rank0, rank1):
        assert steps_dumped(result) == [FAULT_STEP, FAULT_STEP + 5], result
    step_dir = root / "stuck" / "sdc" / f"step-{FAULT_STEP:09d}"
    dumps = {d.rank: d for d in open_step(step_dir)[0]}
    evidence = dumps[1].silent()
    assert evidence["check"] == "cross_rank" and evidence["first_difference"] is None  # its own two runs agree
    assert dumps[1].trigger.local is True and dumps[0].trigger.local is False
    report = replay(step_dir, models)
    assert report["dump"]["rank"] == 1
    silent = report["silent"]
    assert silent["class"] == "persistent" and silent["drain_rank"] == 1, report["verdict"]
    assert silent["module"] == "0"
    # the replay is evidence because it reproduces rank 0's healthy run of rank 0's micro-batch (from rank 0's dump)
    assert silent["reference_replayed"] is True and silent["replay_vs_reference"] is None
    assert silent["evidence"] == "replay" and report["timings"]["passes"] == 3
    assert "drain" in report["verdict"]["headline"].lower()
    alone = root.parent / "alone" / "sdc" / step_dir.name  # rank 1's dump without rank 0's: no healthy reference
    shutil.copytree(step_dir / "rank-00001", alone / "rank-00001")
    undecided = replay(alone, models)
    assert undecided["silent"]["class"] == "undecided" and undecided["silent"]["reference_replayed"] is False
    assert undecided["silent"]["drain_rank"] == 1 and undecided["silent"]["evidence"] == "job"
    assert "persistent fault of rank 1's device is likely" in undecided["verdict"]["headline"]
    healthy_side = replay(step_dir, models, rank=0)["silent"]
    assert healthy_side["class"] in ("not_hardware", "undecided") and healthy_side["drain_rank"] is None


def test_a_replica_whose_weight_drifts_is_named_with_the_parameter(two_ranks):
    root, results, models = two_ranks
    rank0, rank1 = results["drift"]
    assert rank1["injected"] == [FAULT_STEP]
    for result in (rank0, rank1):
        assert steps_dumped(result) == [FAULT_STEP], result
    step_dir = root / "drift" / "sdc" / f"step-{FAULT_STEP:09d}"
    dumps = {d.rank: d for d in open_step(step_dir)[0]}
    assert dumps[1].silent()["replicas"]["drifted"] is True and dumps[0].silent()["replicas"]["drifted"] is False
    for rank in (0, 1):  # either rank's dump names rank 1, from the evidence beside it and the dumped states
        report = replay(step_dir, models, rank=rank)
        silent = report["silent"]
        assert silent["class"] == "replica_drift" and silent["drain_rank"] == 1, report["verdict"]
        assert silent["replicas"]["params"] == ["2.weight"] and silent["replicas"]["confirmed"] is True


def test_a_healthy_bf16_run_checked_at_every_step_raises_nothing(two_ranks):
    root, results, _ = two_ranks
    for result in results["healthy"]:
        assert result["dumps"] == [] and all(result["decisions"]) and result["dump_errors"] == []
    assert not (root / "healthy").exists()


def test_under_fsdp2_a_flip_in_rank_1s_forward_is_caught_and_a_healthy_run_is_silent(two_ranks):
    """FSDP2 with bf16 parameters: each rank's recompute of its forward (through FSDP2's all-gathers, every rank
    together) agrees with its run at every step — and leaves no root parameter unsharded, which the job's next
    forward would use stale — and rank 1's flipped output is caught at its step, on rank 1."""
    root, results, models = two_ranks
    for result in results["fsdp_healthy"]:
        assert result["dumps"] == [] and all(result["decisions"]) and result["dump_errors"] == []
    rank0, rank1 = results["fsdp_flip"]
    no_nan_no_spike(rank1["losses"])
    for result in (rank0, rank1):
        assert steps_dumped(result) == [FAULT_STEP], result
    dumps = {d.rank: d for d in open_step(root / "fsdp_flip" / "sdc" / f"step-{FAULT_STEP:09d}")[0]}
    assert dumps[1].trigger.local is True and dumps[0].trigger.local is False
    evidence = dumps[1].silent()
    assert evidence["first_difference"]["name"] == "0" and evidence["job"].grads == [[]] * 2  # forward only
    report = replay(root / "fsdp_flip" / "sdc" / f"step-{FAULT_STEP:09d}", models)  # in FSDP2's bf16, unsharded
    silent = report["silent"]
    assert silent["class"] == "transient" and silent["wrong"] == "job" and silent["module"] == "0", report["verdict"]
    assert silent["drain_rank"] == 1


@pytest.mark.slow
def test_a_healthy_bf16_run_stays_silent_for_2000_steps(tmp_path):
    for name in ("healthy", "fsdp_healthy"):  # one launch each: each stays within the launch limit
        (tmp_path / name).mkdir()
        root, results = launch(tmp_path / name, name, healthy_steps=2000)
        for result in results[name]:
            assert len(result["decisions"]) == 2000 and all(result["decisions"]) and result["dumps"] == []
        assert not (root / name).exists()
