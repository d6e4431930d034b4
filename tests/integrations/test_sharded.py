"""Multi-process gloo runs that write the sharded layout: FSDP2 (1-D and HSDP 2-D meshes), DDP with the ranks
splitting the writing, two simulated nodes with node-local dump directories, and a rank killed mid-write.

Each checks what a user relies on: the dump holds one copy of the state across the ranks (no rank wrote the
full model), the state a reader assembles equals plain-torch training's, and a one-process replay names
the corrupt sample.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from forensics.cli import main
from forensics.format import open_dump, verify_dump


COMPLETE = "; the state is complete without it (other ranks also wrote its part): replay another rank"


def test_fsdp2_ranks_write_their_shards_once_and_replay_names_the_sample(harness, tmp_path, reference):
    harness.requires("transformers")
    step_dir, result = harness.run_example(tmp_path, "fsdp2_example.py", "fsdp2")
    harness.check_step_dump(step_dir, reference)  # the assembled state equals plain-torch training's
    written, one_copy, per_rank = harness.state_bytes(step_dir)
    assert written <= 1.05 * one_copy, (written, one_copy)
    assert max(per_rank) < 0.75 * one_copy, per_rank  # no rank wrote (or gathered) the whole state
    for report in result.reports.values():
        manifest = json.loads((harness.REPO / report["dump"] / "manifest.json").read_text())
        assert manifest["distributed"]["dtensor"] is True and manifest["distributed"]["state"].startswith("sharded")
        assert manifest["recipe"]["factory_kwargs"]["architecture"] == "GPT2LMHeadModel"  # not FSDPGPT2LMHeadModel
    harness.replay_names_sample_and_layer(step_dir)


def test_fsdp2_with_a_fused_optimizer_checks_without_a_sync_and_dumps_the_same_pre_step_state(
    harness, tmp_path, reference
):
    """AdamW(fused=True) under FSDP2, default GuardConfig: the ranks agree on each step with an all-reduce no rank
    waits for, the fused step skips the NaN step on the device on every rank (a DTensor optimizer given GradScaler's
    found_inf), and at the next check every rank dumps its shards of the same exact pre-step state."""
    harness.requires("transformers")
    step_dir, _ = harness.run_example(tmp_path, "fsdp2_example.py", "fused", "--fused")
    dumps = harness.check_step_dump(step_dir, reference)  # the assembled state equals plain-torch training's
    assert all("one step late" in d.trigger.detail for d in dumps.values())
    assert "another rank saw" in dumps[0].trigger.detail
    harness.replay_names_sample_and_layer(step_dir)


def test_an_fsdp2_bf16_job_is_replayed_in_its_own_precision_bit_for_bit(harness, tmp_path):
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16): not autocast, so the Guard records each unit's policy
    and the one-process replay computes in bf16 as the units did — the recorded losses come back bit for bit
    (in fp32 they differ by ~3e-5), and the fp32 re-run says whether precision is to blame."""
    harness.requires("transformers")
    step_dir, _ = harness.run_example(tmp_path, "fsdp2_example.py", "bf16", "--bf16")
    manifest = json.loads((step_dir / "rank-00001" / "manifest.json").read_text())
    units = manifest["precision"]["fsdp"]
    assert [u["module"] for u in units] == ["", "transformer.h.0", "transformer.h.1"]
    assert {(u["param_dtype"], u["reduce_dtype"]) for u in units} == {("bfloat16", "float32")}
    from forensics.replay import engine

    report = engine.run_replay(
        str(step_dir), engine.ReplayOptions(device="cpu", rank=1, rng_check=False, remedies=False)
    )
    assert report["reproduced"] is True and report["fidelity"]["bitwise_equal"] is True, report["fidelity"]
    assert report["precision"]["fsdp_param_dtype"] == "bfloat16" and report["precision"]["fp32_reproduces"] is True
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [harness.POISON]

    # the per-sample rows too run each sample in the units' bf16 (not in the fp32 weights'), and the weights come back
    from forensics.format import open_dump
    from forensics.replay import stages
    from forensics.replay.load.session import load_session
    from forensics.replay.run.execute import StepRunner

    session = load_session(open_dump(str(step_dir), rank=1), device="cpu")
    runner, seen = StepRunner(session), []
    attention = session.model.transformer.h[0].attn.c_attn
    handle = attention.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    rows = stages.per_sample_rows(runner, session.sample_refs, [], 64)
    handle.remove()
    assert len(rows) == len(session.sample_refs) and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in session.model.parameters()} == {torch.float32}


def test_ddp_ranks_split_the_writing_of_replicated_state(harness, tmp_path, reference):
    harness.requires("transformers")
    step_dir, _ = harness.run_example(tmp_path, "ddp_example.py", "ddpsharded", "--layout", "sharded")
    harness.check_step_dump(step_dir, reference)
    written, one_copy, per_rank = harness.state_bytes(step_dir)
    assert written == one_copy
    assert max(per_rank) <= 0.6 * one_copy, per_rank  # both ranks wrote about half
    harness.replay_names_sample_and_layer(step_dir)


@pytest.mark.slow  # four ranks; the 2-D mesh (FSDP over tensor parallel) test proves mesh-aware sharded writes
def test_hsdp_on_four_ranks_writes_one_replica_group(harness, tmp_path):
    """A 2 x 2 mesh (replicate x shard): the replicas do not both write; rank 1 (step 1 with four ranks) replays."""
    harness.requires("transformers")
    dump_dir = tmp_path / "dumps"
    result = harness.launch(
        "fsdp2_example.py", ["--dump-dir", str(dump_dir), "--run-id", "hsdp", "--mesh", "hsdp"], nproc=4
    )
    assert sorted(result.reports) == [0, 1, 2, 3], result.explain()
    step_dir = dump_dir / "hsdp" / "step-000000001"  # DistributedSampler: sample 29 -> rank 1, step 1, mb 1
    assert verify_dump(step_dir).ok
    written, one_copy, per_rank = harness.state_bytes(step_dir)
    assert written <= 1.05 * one_copy, (written, one_copy)
    assert max(per_rank) < 0.6 * one_copy, per_rank
    from forensics.replay import engine

    report = engine.run_replay(str(step_dir), engine.ReplayOptions(device="cpu", rank=1))
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [harness.POISON]


def _two_nodes(harness, tmp_path, per_node: int, *extra: str) -> list[str]:
    """`torchrun --nnodes=2` launched twice on one host (c10d rendezvous), `per_node` processes each, every node
    with its own dump_dir (tmp_path/node0, node1); returns the two launches' output."""
    for _ in range(3):  # the port is free when chosen; another job may bind it before node 0 does
        from forensics_test_helpers import free_port  # tests/helpers.py

        outputs = _launch_two_nodes(harness, tmp_path, per_node, free_port(), extra)
        if not any("EADDRINUSE" in out or "address already in use" in out.lower() for out in outputs):
            return outputs
    return outputs


def _launch_two_nodes(harness, tmp_path, per_node: int, port: int, extra: tuple[str, ...]) -> list[str]:
    procs = []
    for node in (0, 1):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node_rank={node}",
            f"--nproc_per_node={per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=forensics-two-nodes",
            str(harness.EXAMPLES / "fsdp2_example.py"),
            "--dump-dir",
            str(tmp_path / f"node{node}"),
            "--run-id",
            "nodes",
            *extra,
        ]
        procs.append(
            subprocess.Popen(
                command,
                cwd=str(harness.REPO),
                env=harness._env(None),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=harness.LAUNCH_TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("the two-node launch hung")
    return outputs


def test_two_nodes_write_node_local_dumps_that_replay_together(harness, tmp_path):
    """One process per node, each node with its own dump_dir; `forensics replay` of node 0's step with `--shards`
    pointing at node 1's directory."""
    harness.requires("transformers")
    outputs = _two_nodes(harness, tmp_path, 1)
    step = f"step-{harness.BAD_STEP:09d}"
    node0, node1 = tmp_path / "node0" / "nodes" / step, tmp_path / "node1" / "nodes" / step
    assert [p.name for p in node0.iterdir()] == ["rank-00000"], outputs[0][-3000:]
    assert [p.name for p in node1.iterdir()] == ["rank-00001"], outputs[1][-3000:]

    alone = CliRunner().invoke(main, ["replay", str(node0), "--device", "cpu", "--rank", "0"])
    assert alone.exit_code == 2 and "--shards" in alone.output, alone.output
    assert not verify_dump(node0).ok
    assert verify_dump(node0, shard_dirs=[tmp_path / "node1"]).ok
    out = CliRunner().invoke(
        main,
        [
            "replay",
            str(node0),
            "--device",
            "cpu",
            "--rank",
            "1",
            "--shards",
            str(tmp_path / "node1"),
            "--json",
            "-o",
            str(tmp_path / "report"),
        ],
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.output[out.output.index("{") :])
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [harness.POISON]


@pytest.mark.slow  # buddy copies across nodes: the two-node launch and the FSDP2 buddy tests prove its parts
def test_with_two_replicas_one_node_replays_alone_when_the_other_node_is_lost(harness, tmp_path):
    """Two nodes x 2 ranks, DumpConfig(shard_replicas=2): each rank's buddy is the same local rank on the other
    node, so node 0's disk alone holds the whole state (its ranks' shards and copies of node 1's); node 1's disk
    is lost, and rank 1 (sample 29 lands there with four ranks: step 1) replays from node 0 alone."""
    harness.requires("transformers")
    outputs = _two_nodes(harness, tmp_path, 2, "--replicas", "2")
    node0 = tmp_path / "node0" / "nodes" / "step-000000001"
    assert sorted(p.name for p in node0.iterdir()) == ["rank-00000", "rank-00001"], outputs[0][-3000:]
    for rank in (0, 1):
        copies = json.loads((node0 / f"rank-{rank:05d}" / "manifest.json").read_text())["layout"]["copies"]
        assert {c["rank"] for c in copies.values()} == {rank + 2}  # from the other node, not the neighbour
    shutil.rmtree(tmp_path / "node1")
    check = verify_dump(node0)
    assert check.missing_ranks == [2, 3]
    assert [str(p) for p in check.problems] == [
        f"rank-{r:05d}: rank dump is missing (that rank did not finish writing)" + COMPLETE for r in (2, 3)
    ]
    out = CliRunner().invoke(
        main, ["replay", str(node0), "--device", "cpu", "--rank", "1", "--json", "-o", str(tmp_path / "report")]
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.output[out.output.index("{") :])
    assert [s["sample_id"] for s in report["culprit"]["samples"]] == [harness.POISON]


def test_a_rank_killed_mid_write_leaves_a_dump_that_names_its_missing_shards(harness, tmp_path):
    harness.requires("transformers")
    dump_dir = tmp_path / "dumps"
    worker = str(harness.REPO / "tests" / "integrations" / "die_in_write.py")
    result = harness.launch_script(
        worker,
        [str(harness.EXAMPLES / "fsdp2_example.py"), "--dump-dir", str(dump_dir), "--run-id", "killed"],
        env={"FORENSICS_TEST_DIE_RANK": "1"},
    )
    assert result.returncode != 0, result.explain()
    step_dir = dump_dir / "killed" / f"step-{harness.BAD_STEP:09d}"
    check = verify_dump(step_dir)
    assert check.missing_ranks == [1]
    messages = [str(p) for p in check.problems]
    assert any("'transformer.h.0.attn.c_attn.weight'" in m for m in messages), messages
    out = CliRunner().invoke(main, ["replay", str(step_dir), "--device", "cpu"])
    assert out.exit_code == 2, out.output
    assert "sharded dump is incomplete" in out.output and "missing: [1]" in out.output
    assert open_dump(step_dir).rank == 0  # the survivor's own files (micro-batches, IDs) still read


def test_fsdp_over_tensor_parallel_2d_mesh_dumps_exactly_the_gathered_state(harness, tmp_path):
    """dp x tp = 2 x 2: column shards (strided under FSDP: gathered before writing), Shard(0) x Shard(1) boxes,
    a bias replicated over the tensor-parallel ranks. The assembled state equals `full_tensor()` bit for bit."""
    from safetensors.torch import load_file

    from forensics_test_helpers import bitwise_equal  # tests/helpers.py

    result = harness.launch_script(
        str(harness.REPO / "tests" / "integrations" / "tp_worker.py"), [str(tmp_path)], nproc=4
    )
    assert sorted(result.reports) == [0, 1, 2, 3], result.explain()
    step_dir = tmp_path / "tp" / "step-000000001"
    check = verify_dump(step_dir)
    assert check.ok, [str(p) for p in check.problems]
    reference = load_file(str(tmp_path / "reference.safetensors"))
    dump = open_dump(step_dir)
    assert dump.rank in (2, 3) and dump.trigger.local  # the ranks that read the inf
    weights, optimizer = dump.model_state(), dump.optimizer_state()["state"]
    for key, expected in reference.items():
        actual = optimizer[key.split("/")[1]][key.split("/")[2]] if key.startswith("state/") else weights[key]
        assert bitwise_equal(actual, expected), key
    written, one_copy, _ = harness.state_bytes(step_dir)
    # only the strided `up` tensors (gathered, then written once each) and the tiny replicated `step`s move
    assert written <= 1.05 * one_copy, (written, one_copy)


def test_with_two_replicas_the_ranks_survive_the_loss_of_one_dump(harness, tmp_path):
    """DumpConfig(shard_replicas=2) under DDP: every replicated tensor written by both ranks, so rank 1's dump
    replays after rank 0's is lost."""
    harness.requires("transformers")
    step_dir, _ = harness.run_example(tmp_path, "ddp_example.py", "ddp2", "--layout", "sharded", "--replicas", "2")
    written, one_copy, _ = harness.state_bytes(step_dir)
    assert written == 2 * one_copy
    shutil.rmtree(step_dir / "rank-00000")
    check = verify_dump(step_dir)
    assert [str(p) for p in check.problems] == [
        "rank-00000: rank dump is missing (that rank did not finish writing)" + COMPLETE
    ]
    harness.replay_names_sample_and_layer(step_dir)


def test_with_two_replicas_fsdp2_shards_survive_a_rank_that_dies_mid_write(harness, tmp_path, reference):
    """DumpConfig(shard_replicas=2) under FSDP2: a plain FSDP shard exists on one rank only, so each rank sends its
    shards to its buddy before anyone writes. Rank 0 dies halfway through writing; rank 1's dump alone holds the
    whole state (its own shards and its copy of rank 0's), equal to plain-torch training's, and replays."""
    harness.requires("transformers")
    dump_dir = tmp_path / "dumps"
    worker = str(harness.REPO / "tests" / "integrations" / "die_in_write.py")
    result = harness.launch_script(
        worker,
        [
            str(harness.EXAMPLES / "fsdp2_example.py"),
            "--dump-dir",
            str(dump_dir),
            "--run-id",
            "buddy",
            "--replicas",
            "2",
        ],
        env={"FORENSICS_TEST_DIE_RANK": "0"},
    )
    assert result.returncode != 0, result.explain()
    step_dir = dump_dir / "buddy" / f"step-{harness.BAD_STEP:09d}"
    assert [p.name for p in step_dir.iterdir() if p.name.startswith(".tmp-rank-00000")], "rank 0 died mid-write"
    check = verify_dump(step_dir)
    assert check.missing_ranks == [0]
    assert [str(p) for p in check.problems] == [
        "rank-00000: rank dump is missing (that rank did not finish writing)" + COMPLETE
    ]
    survivor = open_dump(step_dir)
    copies = survivor.manifest["layout"]["copies"]
    assert {name: (c["of"], c["rank"]) for name, c in copies.items()} == {
        "copy-00000-model.safetensors": ("model.safetensors", 0),
        "copy-00000-optimizer.safetensors": ("optimizer.safetensors", 0),
    }
    weights, optimizer = survivor.model_state(), survivor.optimizer_state()["state"]
    assert sorted(weights) == sorted(reference["model"])
    for name, expected in reference["model"].items():
        harness.close(weights[name], expected, f"weight {name}", 1e-5)
    for name, entries in reference["optimizer"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            harness.close(optimizer[name][key], entries[key], f"{key} of {name}", 1e-5)
    harness.replay_names_sample_and_layer(step_dir)


@pytest.mark.slow  # the buddy copies are proven under FSDP2 (a rank dies mid-write); ZeRO-2's layout by zero2 above
def test_with_two_replicas_zero2_partitions_survive_the_loss_of_a_rank_dump(harness, tmp_path, reference):
    """ZeRO-2 with DumpConfig(shard_replicas=2): the flat optimizer partitions are copied to the buddy rank (the
    replicated weights are written by both ranks); with rank 0's dump gone, rank 1's holds the whole state."""
    harness.requires("transformers", "deepspeed")
    step_dir, _ = harness.run_example(
        tmp_path, "deepspeed_example.py", "z2buddy", "--zero-stage", "2", "--replicas", "2"
    )
    written, one_copy, _ = harness.state_bytes(step_dir)
    assert written == 2 * one_copy, (written, one_copy)  # every byte of the state on exactly two ranks
    shutil.rmtree(step_dir / "rank-00000")
    survivor = open_dump(step_dir)
    assert survivor.rank == 1 and "copy-00000-optimizer.safetensors" in survivor.manifest["layout"]["copies"]
    optimizer = survivor.optimizer_state()["state"]
    for name, entries in reference["optimizer"].items():
        harness.close(optimizer[name]["exp_avg"], entries["exp_avg"], f"exp_avg of {name}", 1e-5)
    harness.replay_names_sample_and_layer(step_dir)


@pytest.mark.xdist_group("torchtitan")  # one worker imports torchtitan (12 s of CPU) for both torchtitan tests
def test_a_torchtitan_job_guarded_with_one_line_names_the_corrupt_record(harness, tmp_path):
    """The showcase: torchtitan's Llama 3 Transformer sharded by torchtitan's own `apply_fsdp` (FSDP2), trained
    with a per-token loss weight; rank 1 reads a record whose weights are NaN in step 3. Both ranks write their
    shards (one copy of the state, no gather); a one-process replay of rank 1 names the record and the field."""
    harness.requires("torchtitan")
    step_dir, _ = harness.run_example(tmp_path, "torchtitan_example.py", "titan")
    result = verify_dump(step_dir)
    assert result.ok and result.missing_ranks == [], [str(p) for p in result.problems]
    assert all(d.sharded for d in result.dumps)
    written, one_copy, per_rank = harness.state_bytes(step_dir)
    assert written <= 1.05 * one_copy and max(per_rank) < 0.75 * one_copy, (written, one_copy, per_rank)

    from forensics.replay import engine

    report = engine.run_replay(
        str(step_dir),
        engine.ReplayOptions(device="cpu", rank=1, trust=True, rng_check=False, sys_path=[str(harness.EXAMPLES)]),
    )
    assert report["verdict"]["kind"] == "bad_sample"
    assert [(s["sample_id"], s["rank"]) for s in report["culprit"]["samples"]] == [(harness.POISON, 1)]
    assert report["culprit"]["module"] == "<input>.weights"
    assert report["precision"]["fsdp_param_dtype"] == "bfloat16"  # torchtitan's default mixed precision, replayed
    assert report["fidelity"]["bitwise_equal"] is True, report["fidelity"]
    assert report["culprit"]["parameter"] is None  # a batch field, not a parameter of the model


@pytest.mark.slow  # the agreed precursor dump under FSDP2 runs the same monitor
def test_the_precursor_monitor_measures_the_local_shards_under_fsdp2(harness):
    """FSDP2 parameters are DTensors: the monitor measures each rank's local shards (no collective added) instead of
    turning itself off at the first sampled step; each block's gradient-norm column equals the norm of its local
    gradient shards, and the update ratios are measured."""
    harness.requires("transformers")
    result = harness.launch_script(
        str(harness.REPO / "tests" / "integrations" / "precursor_fsdp_worker.py"), ["measure"]
    )
    assert sorted(result.reports) == [0, 1], result.explain()
    for report in result.reports.values():
        assert report["sampling"] and report["rows"] == [0, 1], report
        assert sorted(report["grad_norm"]) == sorted(report["direct"]) == ["transformer.h.0", "transformer.h.1"]
        for layer, value in report["direct"].items():
            assert report["grad_norm"][layer] == pytest.approx(value, rel=1e-5), (report["rank"], layer)
        assert len(report["update_ratios"]) == 2 and all(0 < r < 1 for r in report["update_ratios"]), report
    assert result.reports[0]["direct"] != result.reports[1]["direct"]  # each rank's own shards


def _every_rank_dumped_step_11(harness, tmp_path, mode: str):
    """Runs precursor_fsdp_worker.py in `mode` on 2 ranks; each rank must have dumped step 11 (and nothing else)
    into a step directory that verifies. Returns (the launch, the step directory)."""
    harness.requires("transformers")
    result = harness.launch_script(
        str(harness.REPO / "tests" / "integrations" / "precursor_fsdp_worker.py"), [mode, str(tmp_path)]
    )
    assert sorted(result.reports) == [0, 1], result.explain()
    step_dir = tmp_path / "grow" / "step-000000011"
    for rank in (0, 1):
        assert result.reports[rank]["dumps"] == [str(step_dir / f"rank-{rank:05d}")], result.reports[rank]
    check = verify_dump(step_dir)
    assert check.ok, [str(p) for p in check.problems]
    return result, step_dir


def test_a_precursor_on_one_rank_of_a_sharded_state_is_dumped_by_every_rank(harness, tmp_path):
    """FSDP2, sharded layout: one rank's dump alone would hold half the state. Rank 1's view of the blocks grows (its
    embeddings scaled up from step 8), its precursor fires when it reads step 9's row at step 10, and the next
    step's all-reduce makes every rank dump step 11 together: a complete, verifiable dump whose replay reports the
    instability and names the block; rank 0's trigger says another rank's fired, and so does its replay."""
    result, step_dir = _every_rank_dumped_step_11(harness, tmp_path, "grow")
    assert result.reports[1]["fired"] and not result.reports[0]["fired"]
    dump = open_dump(step_dir)  # the rank that saw it first-hand
    assert dump.rank == 1 and dump.trigger.kind == "precursor" and dump.trigger.local
    assert "transformer.h." in dump.trigger.detail
    other = open_dump(step_dir, rank=0).trigger
    assert other.kind == "precursor" and not other.local
    runner = CliRunner()
    replayed = runner.invoke(main, ["replay", str(step_dir), "-o", str(tmp_path / "report")])
    assert replayed.exit_code == 0, replayed.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["verdict"]["kind"] == "instability_ahead"
    assert "transformer.h." in report["verdict"]["headline"]
    replayed = runner.invoke(main, ["replay", str(step_dir), "--rank", "0", "-o", str(tmp_path / "report-0")])
    assert replayed.exit_code == 0, replayed.output
    report = json.loads((tmp_path / "report-0" / "report.json").read_text())
    assert report["verdict"]["kind"] == "instability_ahead" and "another rank" in report["verdict"]["headline"]


@pytest.mark.slow  # an edge of the agreed precursor dump, which test_a_precursor_on_one_rank... proves
def test_a_rank_without_a_precursor_monitor_joins_the_dump_another_rank_asks_for(harness, tmp_path):
    """Rank 0 has no precursor monitor (as when setting it up failed there): when rank 1's fires, rank 0 still dumps
    the step with it — its part of the state is needed, and a collective write would wait for it forever."""
    _, step_dir = _every_rank_dumped_step_11(harness, tmp_path, "grow-without-rank-0")
    assert not open_dump(step_dir, rank=0).trigger.local and open_dump(step_dir).rank == 1
