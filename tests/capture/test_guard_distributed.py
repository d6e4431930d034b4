"""Two ranks (gloo, CPU, separate processes) under a PLAIN Guard: a fault or a finite loss spike on one rank
makes every rank dump the same step, a GradScaler's ordinary overflow skip on every rank is not a fault, and
a dump that fails on one rank still uses up that rank's cap (the ranks keep agreeing)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from forensics_test_helpers import fork_server

from forensics.format import open_dump, open_step, verify_dump

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig, SpikeConfig

    torch.set_num_threads(1)
    # a file store, not a TCP port: no port another job on the machine can take between choosing and binding it
    dist.init_process_group("gloo", init_method="file://" + os.environ["FORENSICS_TEST_STORE"],
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()


    SPIKE_STEP = 8
    REPLACE = {8: 10.0, 11: 10.0, 14: 30.0, 17: 10.0}  # "replace": rank 1's spikes (target offsets), one larger


    def run(scenario, dump_dir):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        # spike: a DDP-wrapped model (gradients agree; the Guard strips the wrapper); elsewhere each rank's own
        wrapped = DistributedDataParallel(model) if scenario in ("spike", "replace") else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30) if scenario == "overflow" else None
        if scenario == "cap" and rank == 1:  # rank 1 cannot write: its dump_dir is under a regular file
            blocker = dump_dir + "-not-a-dir"
            open(blocker, "w").close()
            dump_dir = os.path.join(blocker, "dumps")
        config = GuardConfig(dump_dir=dump_dir, run_id="ddp",
                             detection=DetectionConfig(on_nonfinite="continue" if scenario == "cap" else "skip",
                                                       loss_spike=SpikeConfig(window=8, warmup=4)),
                             dumping=DumpConfig(max_dumps=1 if scenario == "cap" else 3,
                                                max_spike_dumps=2 if scenario == "replace" else 3,
                                                min_spike_gap=0 if scenario == "replace" else 100))
        guard = Guard(wrapped, optimizer, scaler=scaler, config=config, loss_fn=None)
        decisions = []
        for step in range(SPIKE_STEP + 2 if scenario == "spike" else 19 if scenario == "replace" else 3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            if scenario in ("nan", "cap") and rank == 1 and step >= 1 and (scenario == "cap" or step == 1):
                x[0, 0] = float("nan")
            target = torch.zeros(4, 1)
            if scenario == "spike" and rank == 1 and step == SPIKE_STEP:
                target += 100.0  # a finite loss spike, on rank 1 only
            if scenario == "replace" and rank == 1:
                target += REPLACE.get(step, 0.0)
            batch = {"x": x, "sample_ids": [f"r{rank}s{step}i{i}" for i in range(4)]}
            guard.record_batch(batch)
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                loss = (wrapped(batch["x"]) - target).square().mean()
                guard.record_loss(loss)
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(optimizer)
            ok = guard.check(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            decisions.append(ok)
            if ok:
                scaler.step(optimizer) if scaler else optimizer.step()
            if scaler:
                scaler.update()
            optimizer.zero_grad()
        guard.close()
        return {"rank": rank, "decisions": decisions, "dumps": [str(p) for p in guard.dumps],
                "skipped": guard.history.to_dict()["skipped"], "dump_errors": guard.dump_errors}


    os.makedirs(sys.argv[1], exist_ok=True)
    results = {scenario: run(scenario, os.path.join(sys.argv[1], scenario))
               for scenario in ("nan", "overflow", "spike", "cap", "replace")}
    sys.stdout.write("two-ranks " + json.dumps(results) + "\\n")  # one write: print's pieces of two ranks interleave
    sys.stdout.flush()
    dist.barrier()
    os._exit(0)  # no gloo teardown: under load it can abort (SIGABRT) a rank whose peer closed first
""")


LAUNCH_TIMEOUT = 120  # seconds: about 25 s alone; no test waits longer (tests/README.md)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """Runs WORKER as ranks 0 and 1 once (two processes forked from tests/fork_server.py, with torchrun's
    environment); returns the dump root and each scenario's per-rank results."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = Path(__file__).resolve().parents[2]
    server = fork_server()
    env = {
        **os.environ,
        "FORENSICS_TEST_STORE": str(tmp_path / "store"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = server.shared(root).run(
            script,
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
    # judged by each rank's report (printed after all its work), not by the exit code of gloo's teardown
    outputs, decoder = [], json.JSONDecoder()
    for chunk in done.stdout.split("two-ranks ")[1:]:  # the ranks share stdout: their lines may abut
        outputs.append(decoder.raw_decode(chunk.lstrip())[0])
    assert len(outputs) == 2, f"exit code {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    by_scenario = {name: sorted((o[name] for o in outputs), key=lambda r: r["rank"]) for name in outputs[0]}
    return tmp_path / "dumps", by_scenario


def test_a_fault_on_one_rank_makes_every_rank_dump_that_step(two_ranks):
    root, results = two_ranks
    for result in results["nan"]:
        assert result["decisions"] == [True, False, True], result
        assert [Path(p).parent.name for p in result["dumps"]] == ["step-000000001"]
    step_dir = root / "nan" / "ddp" / "step-000000001"
    dumps, missing = open_step(step_dir)
    assert [d.rank for d in dumps] == [0, 1] and missing == []
    assert verify_dump(step_dir).ok
    by_rank = {d.rank: d for d in dumps}
    assert by_rank[1].trigger.kind == "nonfinite_loss" and by_rank[1].trigger.local is True
    assert by_rank[0].trigger.local is False and by_rank[0].world_size == 2
    assert by_rank[1].sample_ids(0) == ["r1s1i0", "r1s1i1", "r1s1i2", "r1s1i3"]
    assert open_dump(step_dir).rank == 1  # by default the reader opens the rank that saw the fault


def test_grad_scaler_overflow_on_every_rank_is_not_a_fault(two_ranks):
    root, results = two_ranks
    for result in results["overflow"]:
        assert result["dumps"] == [] and result["decisions"] == [True, True, True], result
        assert result["skipped"] == [True, True, True]  # fp16 at scale 2**30..2**28 overflows: the scaler skips
    assert not (root / "overflow").exists()


def test_a_loss_spike_on_one_rank_is_dumped_by_every_rank_under_a_plain_guard(two_ranks):
    """The spike detectors see the step loss agreed across ranks, so rank 0 dumps rank 1's spike step too;
    the trigger is local only on the rank whose own loss spiked, which the reader opens by default."""
    root, results = two_ranks
    for result in results["spike"]:
        assert result["decisions"] == [True] * 10, result
        assert [Path(p).parent.name for p in result["dumps"]] == ["step-000000008"], result
    step_dir = root / "spike" / "ddp" / "step-000000008"
    assert verify_dump(step_dir).ok
    dumps = {d.rank: d for d in open_step(step_dir)[0]}
    assert sorted(dumps) == [0, 1]
    for rank, dump in dumps.items():
        assert dump.trigger.kind == "loss_spike" and dump.world_size == 2
        assert dump.sample_ids(0) == [f"r{rank}s8i{i}" for i in range(4)]  # each rank's own batch
        assert sorted(dump.model_state()) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # DDP wrapper stripped
    assert dumps[1].trigger.local is True and dumps[0].trigger.local is False
    assert dumps[0].trigger.value == dumps[1].trigger.value  # the agreed (mean) step loss
    assert open_dump(step_dir).rank == 1


def test_a_dump_that_fails_on_one_rank_still_counts_against_its_cap(two_ranks):
    """max_dumps=1, rank 1 cannot write, rank 1's loss is NaN from step 1 on: both ranks attempt step 1 and
    then stop, so a later (collective) state gather could never be entered by one rank alone."""
    root, results = two_ranks
    rank0, rank1 = results["cap"]
    assert [Path(p).parent.name for p in rank0["dumps"]] == ["step-000000001"] and rank0["dump_errors"] == []
    assert rank1["dumps"] == [] and len(rank1["dump_errors"]) == 1, rank1
    assert "Not a directory" in rank1["dump_errors"][0]


def test_spike_dumps_are_kept_and_replaced_alike_on_every_rank(two_ranks):
    """max_spike_dumps=2, rank 1's spikes at steps 8, 11, 14 (the largest) and 17: both ranks keep steps 8 and 14 (the
    first and the largest), both delete step 11 (no step directory left), neither writes step 17 — the same decisions
    on every rank, from the agreed values."""
    root, results = two_ranks
    for result in results["replace"]:
        assert sorted(open_dump(p).step for p in result["dumps"]) == [8, 14], result
    run_dir = root / "replace" / "ddp"
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-000000008", "step-000000014"]
    for step_dir in run_dir.iterdir():
        assert sorted(p.name for p in step_dir.iterdir()) == ["rank-00000", "rank-00001"]
