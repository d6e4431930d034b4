"""Streamed replay (--memory-budget): a budget far below the state gives the same report as a normal replay, with no
more blocks materialised at once than the plan allows (replay/load/stream_plan.py, replay/run/streamed_runner.py)."""

import pytest
import torch

from forensics.capture import Guard, GuardConfig
from forensics.core.errors import ReplayError, TrainingFaultError
from forensics.demo.scenarios import SCENARIOS
from forensics.replay.engine import ReplayOptions, run_replay
from forensics.core.sizes import parse_bytes
from forensics.replay.run.stream_blocks import BlockStreamer

TINY = 170_000  # bytes: the tiny GPT-2 holds 0.11 MB of state; the embeddings and one block fit, two do not


def _same_report(normal: dict, streamed: dict, helpers) -> None:
    key = helpers.written
    for path in (
        ("verdict", "kind"),
        ("dump", "step"),
        ("reproduced",),
        ("culprit", "module"),
        ("culprit", "phase"),
        ("culprit", "op"),
    ):
        assert key(streamed, *path) == key(normal, *path), path
    if key(normal, "precision") is None:  # the fp32 re-run was off
        assert key(streamed, "precision") is None
    else:
        assert key(streamed, "precision", "fp32_reproduces") == key(normal, "precision", "fp32_reproduces")
    assert [s["sample_id"] for s in key(streamed, "culprit", "samples")] == [
        s["sample_id"] for s in key(normal, "culprit", "samples")
    ]
    # the search itself: a streamed bisection runs its forward passes block-major, looking ahead (replay/run/lockstep.py)
    assert key(streamed, "bisection") == key(normal, "bisection")
    assert key(streamed, "rng") == key(normal, "rng")
    # the per-layer table (read from the reproduce pass) and the per-sample rows (their passes run together, one
    # engine call for their backwards: replay/run/lockstep.py), number for number
    assert key(streamed, "per_layer") == key(normal, "per_layer")
    rows = key(streamed, "per_sample")
    ids = [r["sample_id"] for r in rows]
    normal_rows = [r for r in key(normal, "per_sample") if r["sample_id"] in ids]
    assert ids == [r["sample_id"] for r in normal_rows]
    for row, alone in zip(rows, normal_rows):  # the normal replay's rows come from vmap: equal to rounding
        assert row["finite"] == alone["finite"]
        for number in ("loss", "grad_norm"):
            assert (row[number] is None) == (alone[number] is None)
            if isinstance(alone[number], float) and row["finite"]:
                assert row[number] == pytest.approx(alone[number], rel=1e-4)
    said = [w for w in key(streamed, "environment", "warnings") if not w.startswith("streamed replay")]
    assert said == key(normal, "environment", "warnings")  # look-ahead runs it never used tell nothing


def _gpt2_dump(tmp_path, helpers, kit, layers: int = 2, micro: int = 2, width: int = 32):
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(tmp_path), run_id="stream"))
    loop = helpers.TrainLoop(model, optimizer, guard, snapshot=False)
    g = torch.Generator().manual_seed(3)
    steps = [
        [
            {
                "inputs_embeds": torch.randn(4, 8, width, generator=g),
                "labels": torch.randint(0, 64, (4, 8), generator=g),
                "sample_ids": [f"s{s}-m{m}-{i}" for i in range(4)],
            }
            for m in range(micro)
        ]
        for s in range(3)
    ]
    steps[-1][1]["inputs_embeds"][2, 0, 0] = 1e38  # LayerNorm squares it: the forward goes non-finite
    with pytest.raises(TrainingFaultError) as err:
        loop.run(steps)
    guard.close()
    return err.value.dump_path


def test_bad_sample_dump_streamed_gives_the_same_report(tmp_path, helpers, kit):
    dump = _gpt2_dump(tmp_path, helpers, kit)
    normal = run_replay(dump, ReplayOptions(device="cpu", max_per_sample=3))
    stages = []
    streamed = run_replay(
        dump, ReplayOptions(device="cpu", memory_budget=TINY, max_per_sample=3), progress=stages.append
    )
    _same_report(normal, streamed, helpers)
    assert streamed["culprit"]["module"] == "transformer.h.0.ln_1"
    assert "stream" not in normal and streamed["stream"]["blocks"] == 2
    assert streamed["stream"]["peak_blocks_materialised"] <= streamed["stream"]["blocks_resident"] == 1
    assert any(s.startswith("streamed replay:") for s in stages)  # the plan, printed before the passes
    assert any("expected about" in s for s in stages)
    rows = {r["sample_id"]: r for r in streamed["per_sample"]}
    assert rows["s2-m1-2"]["finite"] is False
    assert [r["kind"] for r in streamed["remedies"]["tested"]] == [r["kind"] for r in normal["remedies"]["tested"]]


def test_no_more_blocks_materialised_than_the_plan_allows(tmp_path, helpers, kit, monkeypatch):
    dump = _gpt2_dump(tmp_path, helpers, kit, layers=4)
    seen = []
    acquire = BlockStreamer.acquire

    def counting(self, index):
        acquire(self, index)
        live = sum(
            1
            for b in self.plan.blocks
            if all(self.params[n].stride() != self.rest[n].stride() or self.params[n].numel() <= 1 for n in b.params)
        )
        seen.append((live + (self.reader.pending is not None), self.capacity))

    monkeypatch.setattr(BlockStreamer, "acquire", counting)
    report = run_replay(
        dump, ReplayOptions(device="cpu", memory_budget=330_000, remedies=False, rng_check=False, max_per_sample=1)
    )
    assert report["verdict"]["kind"] == "bad_sample"
    assert seen and all(live <= capacity for live, capacity in seen)
    capacity = seen[0][1]
    assert 2 <= capacity < 4 and report["stream"]["read_ahead"] is True
    assert max(live for live, _ in seen) == capacity  # the read-ahead fills the last slot, never more
    assert report["stream"]["read_ahead_used"] > 0


def test_demo_dumps_streamed_far_below_their_state(tmp_path, helpers):
    for name in ("bad_sample", "fp16_overflow"):
        captured = SCENARIOS[name].run(tmp_path / name, torch.device("cpu"), lambda *_: None)
        options = dict(device="cpu", remedies=False, rng_check=False, max_per_sample=2)
        normal = run_replay(captured.dump_path, ReplayOptions(**options))
        state = normal_state(captured.dump_path)  # a normal replay wants ~2.7x this (weights, grads, activations)
        with pytest.raises(ReplayError) as small:  # the error names the least budget that replays it: that one
            run_replay(captured.dump_path, ReplayOptions(**options, memory_budget=state // 2))
        least = parse_bytes(small.value.args[0].split("--memory-budget ")[1].split()[0])
        assert least < 2 * state
        streamed = run_replay(captured.dump_path, ReplayOptions(**options, memory_budget=least))
        assert streamed["stream"]["blocks_resident"] < streamed["stream"]["blocks"]
        _same_report(normal, streamed, helpers)
        assert streamed["verdict"]["kind"] == captured.expected.verdict
        if name == "bad_sample":
            # a budget that holds every block but not the normal replay: each block read once for all the passes
            cached = run_replay(captured.dump_path, ReplayOptions(**options, memory_budget=2 * state))
            assert cached["stream"]["blocks_resident"] == cached["stream"]["blocks"]
            assert cached["stream"]["block_reads"] == cached["stream"]["blocks"]
            _same_report(normal, cached, helpers)


def normal_state(path) -> int:
    from forensics.format import open_dump

    return sum(t.numel() * t.element_size() for _, t in open_dump(path).iter_model_tensors("cpu"))


def test_a_budget_too_small_or_unreadable_is_a_clear_error(tmp_path, helpers, kit):
    dump = _gpt2_dump(tmp_path, helpers, kit)
    with pytest.raises(ReplayError, match="--memory-budget"):
        run_replay(dump, ReplayOptions(device="cpu", memory_budget=10_000))
    assert parse_bytes("16GiB") == 16 << 30 and parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError):
        parse_bytes("lots")
    from click.testing import CliRunner

    from forensics.cli import main

    for flag, size, said in (
        ("--memory-budget", "lots", "not a size"),
        ("--memory-budget", "10KB", "--memory-budget 1"),
        ("--gpu-memory", "10KB", "--memory-budget 1"),
    ):  # exit 2, saying what to give instead
        result = CliRunner().invoke(
            main, ["replay", str(dump), "--device", "cpu", flag, size, "-o", str(tmp_path / "report")]
        )
        assert result.exit_code == 2 and said in result.output, result.output


WHERE_SQRT = '''
import torch, torch.nn.functional as F, transformers

class WhereSqrt(torch.nn.Module):
    """gelu where x > -1e4, else sqrt(x): forward finite, but where's backward multiplies sqrt's NaN by 0."""
    def forward(self, x):
        return torch.where(x > -1e4, F.gelu(x), torch.sqrt(x))

def build():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0))
    model.transformer.h[1].mlp.act = WhereSqrt()
    return model
'''


def test_backward_localisation_streamed_names_the_op_inside_the_block(tmp_path, helpers):
    (tmp_path / "where_sqrt_model.py").write_text(WHERE_SQRT)
    import importlib.util

    spec = importlib.util.spec_from_file_location("where_sqrt_model", tmp_path / "where_sqrt_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(tmp_path / "dumps"), run_id="sqrt"))
    g = torch.Generator().manual_seed(3)
    steps = [
        [
            {"input_ids": torch.randint(0, 64, (2, 8), generator=g), "sample_ids": [f"m{m}-{i}" for i in range(2)]}
            for m in range(2)
        ]
    ]
    for batch in steps[0]:
        batch["labels"] = batch["input_ids"].clone()
    with pytest.raises(TrainingFaultError) as err:
        helpers.TrainLoop(model, optimizer, guard, snapshot=False).run(steps)
    guard.close()
    options = dict(
        device="cpu",
        factory="where_sqrt_model:build",
        sys_path=[str(tmp_path)],
        remedies=False,
        bisect=False,
        rng_check=False,
        fp32_check=False,
        max_per_sample=1,
    )
    normal = run_replay(err.value.dump_path, ReplayOptions(**options))
    streamed = run_replay(err.value.dump_path, ReplayOptions(**options, memory_budget=TINY))
    assert normal["culprit"]["phase"] == "backward" and normal["culprit"]["module"] == "transformer.h.1.mlp.act"
    _same_report(normal, streamed, helpers)
    assert streamed["culprit"]["parameter"] == normal["culprit"]["parameter"]
    assert streamed["stream"]["blocks_resident"] == 1


def test_gradients_off_the_device_round_trip_through_mapped_files(tmp_path):
    from forensics.replay.run.stream_blocks import GradStore

    store = GradStore(str(tmp_path))
    big, small = torch.randn(1 << 19), torch.randn(7)  # 2 MiB: a mapped file; 28 bytes: ordinary memory
    store.put("a", big, kept=True)
    store.put("b", small)
    assert torch.equal(store.get("a"), big) and torch.equal(store.pop("b"), small)
    assert store.kept == {"a"} and list(tmp_path.iterdir())  # the directory holds the (unlinked) mapping's home
    store.close()
    assert not list(tmp_path.iterdir())


def test_host_cache_reads_each_block_from_the_dump_once(tmp_path, helpers, kit):
    """With host memory for every block, the load's read is the replay's only read of the dump (the floor): later
    passes copy from the cache, and the report is the normal replay's; a cache of one block reads the others again."""
    dump = _gpt2_dump(tmp_path, helpers, kit, layers=4)
    options = dict(device="cpu", remedies=False, rng_check=False, max_per_sample=3)
    normal = run_replay(dump, ReplayOptions(**options))
    stages: list[str] = []
    cached = run_replay(
        dump, ReplayOptions(**options, memory_budget=TINY, host_cache_bytes=1 << 30), progress=stages.append
    )
    _same_report(normal, cached, helpers)
    stream = cached["stream"]
    assert stream["blocks_resident"] == 1 and stream["block_reads"] > 2 * stream["blocks"]  # many passes, K = 1
    assert stream["block_reads_from_storage"] == 0
    assert stream["bytes_from_storage"] == stream["bytes_floor"] == stream["host_cache_bytes"] > 0
    assert any(s.startswith("  host cache: ") for s in stages)  # the plan says it before the first pass
    assert any(s.startswith("  (that stage:") for s in stages)
    assert any(s.startswith("streamed replay, in all:") for s in stages)

    uncached = run_replay(dump, ReplayOptions(**options, memory_budget=TINY))  # the CPU's default: no cache
    _same_report(normal, uncached, helpers)
    assert uncached["stream"]["host_cache_bytes"] == 0
    assert uncached["stream"]["block_reads_from_storage"] == uncached["stream"]["block_reads"]
    assert uncached["stream"]["bytes_from_storage"] > 4 * uncached["stream"]["bytes_floor"]

    one_block = run_replay(dump, ReplayOptions(**options, memory_budget=TINY, host_cache_bytes=stream["block_bytes"]))
    _same_report(normal, one_block, helpers)
    partial = one_block["stream"]
    assert 0 < partial["host_cache_bytes"] <= partial["block_bytes"]
    assert stream["bytes_floor"] < partial["bytes_from_storage"] < uncached["stream"]["bytes_from_storage"]


def test_host_cache_holds_the_dump_values_and_hands_out_copies():
    from forensics.replay.load.host_cache import HostBlockCache, host_cache_capacity
    from forensics.replay.run.read_ahead import BlockReader

    weights = {"a": torch.randn(64), "b": torch.randn(64).to(torch.bfloat16)}
    cache = HostBlockCache(capacity=64 * 4 + 64 * 2, device=torch.device("cpu"))
    assert cache.offer("a", weights["a"]) and cache.offer("b", weights["b"])
    assert not cache.offer("c", torch.zeros(1))  # full: refused, nothing evicted
    reads = []

    def read(names=None):
        reads.append(set(names))
        yield from ((n, t) for n, t in weights.items() if n in names)

    reader = BlockReader(read, torch.device("cpu"), ahead=False, cache=cache)
    out = reader.read(0, {"a": torch.float32, "b": torch.float32})
    assert reads == [] and reader.storage_bytes == 0  # nothing read from the dump
    assert torch.equal(out["a"], weights["a"]) and torch.equal(out["b"], weights["b"].float())
    out["a"].add_(1.0)  # a pass writing its weights leaves the cache alone
    assert torch.equal(cache.get("a"), weights["a"])
    assert host_cache_capacity(torch.device("cpu"), 1000, None) == 0  # the CPU's budget is the host's memory
    assert host_cache_capacity(torch.device("cpu"), 1000, 1 << 30) == 1000  # never more than the blocks
    cache.close()
    assert len(cache) == 0 and not cache.offer("a", weights["a"])


def test_a_gpu_replays_cache_holds_the_dump_values_beside_the_blocks_only_when_asked():
    """Blocks computed in bf16 of fp32 master weights (FSDP2): by default the cache holds the bf16 copies alone (the
    dump's fp32 values page-locked beside the load slowed a 13 B replay from 1.95 x to 2.87 x); asked for, both."""
    from forensics.replay.load.host_cache import available_host_memory, host_cache_capacity

    gpu, blocks_bf16, dump_fp32 = torch.device("cuda", 0), 1000, 2000  # (sizing only: no device touched)
    if available_host_memory() >= 2 * blocks_bf16:
        assert host_cache_capacity(gpu, blocks_bf16, None, dump_fp32) == blocks_bf16
    assert host_cache_capacity(gpu, blocks_bf16, 1 << 30, dump_fp32) == blocks_bf16 + dump_fp32
    assert host_cache_capacity(gpu, blocks_bf16, 1500, dump_fp32) == 1500  # the fp32 values where room is left


def test_forward_passes_run_block_major_compute_what_each_computes_alone(tmp_path, helpers, kit):
    """run_forwards: several forward-only passes through each block while it is materialised, each pass with its
    own RNG (the GPT-2's dropout draws its masks in train mode), the same losses as each pass run alone, in fewer
    block reads."""
    import warnings

    from forensics.format import open_dump
    from forensics.replay.load.fsdp_precision import parse_units
    from forensics.replay.options import load
    from forensics.replay.run.streamed_runner import runner_for

    dump = _gpt2_dump(tmp_path, helpers, kit, layers=4)
    session = load(open_dump(dump), ReplayOptions(device="cpu", memory_budget=TINY, host_cache_bytes=1 << 30))
    runner = runner_for(session)
    try:
        assert runner.block_major and runner.plan.resident_blocks == 1
        refs = session.sample_refs
        subsets = [refs[:3], refs[3:], refs[1:6]]

        def seeded(seed: int) -> list:
            torch.manual_seed(seed)
            return runner.run(restore_rng=False, backward=False).losses

        reads = runner.streamer.reader.reads
        alone = [runner.run(s, backward=False).losses for s in subsets] + [seeded(seed) for seed in (1, 2)]
        walked_alone = runner.streamer.reader.reads - reads
        reads = runner.streamer.reader.reads
        together = runner.run_forwards(
            [lambda s=s: runner.run(s, backward=False).losses for s in subsets]
            + [lambda seed=seed: seeded(seed) for seed in (1, 2)]
        )
        walked_together = runner.streamer.reader.reads - reads
        filters = warnings.filters[:]
        # FSDP2 bf16 compute: set up by the first pass to start, torn down by the last to end (each pass's own
        # enter and exit would leave the later passes computing in fp32)
        session.fsdp_units = parse_units(
            [{"module": "", "param_dtype": "bfloat16", "reduce_dtype": "float32", "cast_forward_inputs": True}]
        )
        bf16_alone = [runner.run(s, backward=False).losses for s in subsets]
        bf16_together = runner.run_forwards([lambda s=s: runner.run(s, backward=False).losses for s in subsets])
    finally:
        runner.close()
    assert repr(together) == repr(alone)  # bitwise, nan included
    assert alone[3] != alone[4]  # the seeds drew other dropout masks: the RNG was each pass's own
    assert runner.lockstep_waits > 0 and 3 * walked_together <= walked_alone
    assert warnings.filters == filters  # the passes' catch_warnings, entered and left interleaved, put back
    assert repr(bf16_together) == repr(bf16_alone) and bf16_alone[0] != alone[0]


def _stage_traffic(stages: list[str]) -> dict[str, tuple[int, int, int]]:
    """{stage: (passes, walks over the blocks, block reads)} from a streamed replay's stage log, each stage's line
    "  (that stage: ...)" coming before the next stage's."""
    import re

    out: dict[str, tuple[int, int, int]] = {}
    current = None
    for line in stages:
        if line.startswith("  (that stage:"):
            said = re.search(r"(\d+) pass(?:es)?, (\d+) walks? over the blocks, (\d+) block reads", line)
            assert said is not None, line
            assert current is not None
            out[current] = tuple(int(v) for v in said.groups())  # type: ignore[assignment]
        elif not line.startswith(("  ", "streamed replay")):
            current = line.split(" (")[0]
    return out


def test_stages_walk_the_blocks_once_per_pass_set(tmp_path, helpers, kit):
    """The stage log says each stage's passes, walks and block reads: the per-layer table takes no walk (read from
    the reproduce pass), the per-sample rows' passes share one forward and one backward walk (their backwards in one
    engine call: replay/run/lockstep.py), and the report is the one of the passes run alone, to the bit."""
    dump = _gpt2_dump(tmp_path, helpers, kit, layers=4)
    options = dict(device="cpu", remedies=False, rng_check=False, max_per_sample=3)
    stages: list[str] = []
    report = run_replay(
        dump, ReplayOptions(**options, memory_budget=TINY, host_cache_bytes=1 << 30), progress=stages.append
    )
    walked = _stage_traffic(stages)
    blocks = report["stream"]["blocks"]
    assert walked["reproducing the step"][:2] == (1, 2)  # two micro-batches together: one forward, one backward walk
    assert walked["per-layer gradient norms and output abs-max"] == (0, 0, 0)
    passes, walks, reads = walked["per-sample loss and gradient norm"]
    # in groups whose kept activations fit (said in the log), one forward and one backward walk a group
    said = report["stream"]["joint_groups"]
    assert said[0] == "2 micro-batches of 2 (nothing measured yet: all of them)"  # the reproduce pass's
    groups = [g for g in said if "micro-batches" not in g]
    # TINY's room for activations holds two of these passes; the reproduce pass kept more at once and ran: all three
    assert [g.split(" ")[0] for g in groups] == ["3"] and "kept at once by a pass that ran" in groups[0]
    assert sum(1 for s in stages if s.startswith("  (passes run together: a group of ")) == len(said)
    assert passes == 3 and walks == 2 and reads <= 2 * blocks  # was 3 x 2 walks, one pass after another
    assert report["stream"]["joint_backwards"] == 2 and report["stream"]["walks"] == sum(
        w for _, w, _ in walked.values()
    )

    stages.clear()
    alone = run_replay(
        dump,
        ReplayOptions(**options, memory_budget=TINY, host_cache_bytes=1 << 30, block_major=False),
        progress=stages.append,
    )
    assert _stage_traffic(stages)["per-sample loss and gradient norm"][:2] == (3, 6)  # one pass after another
    for section in ("timings", "stream", "created_at"):
        report.pop(section), alone.pop(section)
    assert report == alone


def test_passes_with_a_backward_run_together_compute_what_each_computes_alone(tmp_path, helpers, kit):
    """run_with_backwards: the passes' forwards block-major, their backwards in one engine call, each pass's gradients
    its own (the blocks' taken off as each block's backward ends; the embeddings, final norm and head on leaves of
    their own): losses, gradient norms and non-finite parameters as each pass alone gives them, to the bit, in fewer
    block reads; a pass the schedule cannot run (two micro-batches, gradients held between them) runs alone."""
    from forensics.format import open_dump
    from forensics.replay.load.fsdp_precision import parse_units
    from forensics.replay.options import load
    from forensics.replay.run.streamed_runner import runner_for

    dump = _gpt2_dump(tmp_path, helpers, kit, layers=4)
    session = load(open_dump(dump), ReplayOptions(device="cpu", memory_budget=TINY, host_cache_bytes=1 << 30))
    runner = runner_for(session)

    def seen(result) -> tuple:
        return repr(result.losses), repr(result.grad_norm), result.nonfinite_grad_params, result.loss_finite

    try:
        refs = session.sample_refs
        one_each = [[refs[0]], [refs[1]], [refs[6]], [refs[3]]]  # the last micro-batch's 3rd sample holds 1e38
        reads = runner.streamer.reader.reads
        alone = [seen(runner.run(s)) for s in one_each]
        walked_alone = runner.streamer.reader.reads - reads
        reads = runner.streamer.reader.reads
        measure, measured = runner._measure_resident, []

        def measuring(number: int, name: str, leaf: torch.Tensor) -> None:
            measured.append((number, name))
            measure(number, name, leaf)

        runner._measure_resident = measuring
        together = runner.run_with_backwards([lambda s=s: seen(runner.run(s)) for s in one_each])
        del runner._measure_resident
        walked_together = runner.streamer.reader.reads - reads
        # each pass's gradients outside the blocks measured (and freed) as its backward made them, once each
        assert runner.last_joint_error is None
        outside = [n for n, _ in runner.model.named_parameters() if n not in runner._streamed]
        assert sorted(measured) == sorted((number, name) for number in range(4) for name in outside)
        resident = [p for n, p in runner.model.named_parameters() if n not in runner._streamed]
        two_micro_batches = runner.run_with_backwards([lambda: runner.run(refs[3:5]), lambda: runner.run(refs[:1])])
        assert runner.run_with_backwards([lambda: runner.run(refs[:1])]) is None  # one pass: nothing to share
        # FSDP2 bf16 compute, fp32 reduce: set up once for all; each pass's gradients outside the blocks cast as its
        # own context's end would (the blocks' as each block's backward ends)
        session.fsdp_units = parse_units(
            [{"module": "", "param_dtype": "bfloat16", "reduce_dtype": "float32", "cast_forward_inputs": True}]
        )
        bf16_alone = [seen(runner.run(s)) for s in one_each]
        bf16_together = runner.run_with_backwards([lambda s=s: seen(runner.run(s)) for s in one_each])
    finally:
        runner.close()
    assert together == alone and len({a[1] for a in alone}) == len(alone)  # each sample's own gradient norm
    assert bf16_together == bf16_alone and bf16_alone[0] != alone[0]
    assert runner.joint_backwards >= 1 and 2 * walked_together < walked_alone
    assert all(p.grad is None for p in resident)  # the passes' leaves went with them
    assert two_micro_batches is None
    # why that one fell back is kept for the report's `stream` block (a GPU run's log says why)
    assert len(runner.joint_backward_errors) == 1 and runner.joint_backward_errors[0].split(":")[0].endswith("Error")


def _as_fsdp2_bf16(dump, helpers) -> None:
    """The dump as an FSDP2 job with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) writes it: fp32
    master weights, every unit computing in bf16 (the manifest's precision.fsdp, which no checksum covers)."""
    unit = {"module": "", "param_dtype": "bfloat16", "reduce_dtype": "float32", "cast_forward_inputs": True}
    helpers.edit_manifest(dump, lambda m: m["precision"].__setitem__("fsdp", [unit]))


def test_host_cache_holds_the_blocks_as_fsdp2_computes_them_and_the_fp32_rerun_its_own(tmp_path, helpers, kit):
    """FSDP2 mixed precision: the cache holds each block in bf16 (half the bytes to fill and to move per walk), cast
    where the load read it; with room to spare also the fp32 master weights, which the fp32 re-run copies; without, the
    fp32 re-run reads the dump. Every report is the unconstrained replay's, number for number."""
    from pathlib import Path

    dump = Path(_gpt2_dump(tmp_path, helpers, kit, layers=4))
    _as_fsdp2_bf16(dump, helpers)
    options = dict(device="cpu", remedies=False, rng_check=False, max_per_sample=3)
    normal = run_replay(dump, ReplayOptions(**options))
    assert normal["precision"]["fsdp_param_dtype"] == "bfloat16" and normal["precision"]["fp32_reproduces"] is not None
    stages: list[str] = []
    both = run_replay(
        dump, ReplayOptions(**options, memory_budget=TINY, host_cache_bytes=1 << 30), progress=stages.append
    )
    _same_report(normal, both, helpers)
    assert both["precision"] == normal["precision"]
    stream = both["stream"]
    floor = stream["bytes_floor"]
    assert stream["host_cache_bytes"] * 2 == floor * 3  # every block in bf16 and in fp32
    assert stream["bytes_from_storage"] == floor  # the load's read only: the fp32 re-run copied the fp32 values
    said = [s for s in stages if s.startswith("  host cache: ")]
    assert said and "bfloat16 (as the passes compute)" in said[0] and "float32 (as the dump holds it)" in said[0]

    stages.clear()
    bf16 = run_replay(
        dump, ReplayOptions(**options, memory_budget=TINY, host_cache_bytes=floor // 2), progress=stages.append
    )
    _same_report(normal, bf16, helpers)
    assert bf16["precision"] == normal["precision"]
    assert bf16["stream"]["host_cache_bytes"] * 2 == floor  # room for the bf16 copies only: they come first
    said = [s for s in stages if s.startswith("  host cache: ")]
    assert said and "bfloat16" in said[0] and "float32" not in said[0]
    # the bf16 passes copy from the cache; the fp32 re-run (its forward and backward) reads every block's fp32 values
    assert floor < bf16["stream"]["bytes_from_storage"] <= 3 * floor

    alone = run_replay(dump, ReplayOptions(**options, memory_budget=TINY))  # no cache: every walk reads the dump
    for report in (both, bf16):
        assert alone["per_sample"] == report["per_sample"] and alone["per_layer"] == report["per_layer"]
        assert alone["precision"] == report["precision"] and alone["bisection"] == report["bisection"]


def test_host_cache_in_the_compute_dtype_serves_that_dtype_and_the_dump_values_the_others():
    """A block held in bf16 (cast from the dump's fp32) is handed out to a bf16 pass only, bitwise the streamer's own
    cast of the dump's value; an fp32 pass gets the fp32 copy where the cache had room for it beyond the bf16 copies,
    else reads the dump. A tensor held as the dump holds it serves any dtype."""
    from forensics.replay.load.host_cache import HostBlockCache
    from forensics.replay.run.read_ahead import BlockReader

    weights = {"w": torch.randn(64) * 3, "n": torch.randn(8)}
    bf16_bytes = 64 * 2 + 8 * 4
    for capacity, fp32_kept in ((bf16_bytes, False), (bf16_bytes + 64 * 4, True)):
        cache = HostBlockCache(capacity, torch.device("cpu"), keep={"w": torch.bfloat16}, reserve=bf16_bytes)
        assert cache.offer("w", weights["w"]) and cache.offer("n", weights["n"])
        assert cache.dtypes() == {torch.bfloat16: 128, torch.float32: 32 + 256 * fp32_kept}
        assert (cache.get("w", torch.float32) is not None) == fp32_kept and cache.get("n", torch.bfloat16) is not None
        reads = []

        def read(names=None, reads=reads):
            reads.append(set(names))
            yield from ((n, t) for n, t in weights.items() if n in names)

        reader = BlockReader(read, torch.device("cpu"), ahead=False, cache=cache)
        bf16 = reader.read(0, {"w": torch.bfloat16, "n": torch.bfloat16})
        assert reads == [] and reader.storage_bytes == 0
        assert helpers_bitwise(bf16["w"], weights["w"].to(torch.bfloat16))
        assert helpers_bitwise(bf16["n"], weights["n"].to(torch.bfloat16))
        fp32 = reader.read(0, {"w": torch.float32, "n": torch.float32})
        assert reads == ([] if fp32_kept else [{"w"}])  # the master weights: copied, or from the dump, never the bf16
        assert helpers_bitwise(fp32["w"], weights["w"]) and helpers_bitwise(fp32["n"], weights["n"])
        assert cache.get("w", torch.bfloat16).dtype == torch.bfloat16  # first come, first kept
        cache.close()


def helpers_bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_an_fsdp2_bf16_dump_streamed_with_its_blocks_cached_in_bf16_gives_the_same_report(tmp_path):
    """A real FSDP2 job (two gloo ranks, MixedPrecisionPolicy(param_dtype=bfloat16) over fp32 shards, each layer its
    own unit): rank 1's dump streamed with the blocks cached as the units compute them (bf16), with and without room
    for the fp32 shards' values beside them, gives the unconstrained replay's report; the fp32 re-run agrees."""
    from pathlib import Path

    from forensics_test_helpers import load_test_module  # set by tests/conftest.py

    harness = load_test_module(
        "forensics_integration_harness", Path(__file__).parents[1] / "integrations" / "harness.py"
    )
    harness.requires("transformers")
    step_dir, _ = harness.run_example(tmp_path, "fsdp2_example.py", "bf16", "--bf16")
    options = dict(device="cpu", rank=1, rng_check=False, remedies=False)
    normal = run_replay(str(step_dir), ReplayOptions(**options))
    assert normal["precision"]["fsdp_param_dtype"] == "bfloat16" and normal["precision"]["fp32_reproduces"] is True
    both = run_replay(str(step_dir), ReplayOptions(**options, memory_budget=170_000, host_cache_bytes=1 << 30))
    floor = both["stream"]["bytes_floor"]
    bf16 = run_replay(str(step_dir), ReplayOptions(**options, memory_budget=170_000, host_cache_bytes=floor // 2))
    for streamed in (both, bf16):
        assert streamed["stream"]["blocks_resident_fp32"] < streamed["stream"]["blocks"] == 2  # the fp32 re-run walks
        assert streamed["reproduced"] is True and streamed["fidelity"] == normal["fidelity"]
        assert streamed["precision"] == normal["precision"]
        assert streamed["culprit"]["samples"] == normal["culprit"]["samples"]
        assert streamed["verdict"]["kind"] == normal["verdict"]["kind"]
    assert both["stream"]["host_cache_bytes"] * 2 == floor * 3 and both["stream"]["bytes_from_storage"] == floor
    assert bf16["stream"]["host_cache_bytes"] * 2 == floor < bf16["stream"]["bytes_from_storage"]
    assert bf16["per_sample"] == both["per_sample"] and bf16["per_layer"] == both["per_layer"]


def test_a_load_that_fails_after_the_cache_began_filling_frees_the_cache(tmp_path, helpers, kit, monkeypatch):
    """A dump refused mid-load (a resident weight re-typed, checksums re-signed) after the cache began to fill: the
    cache is closed then (on a GPU its fill threads stop and its page-locked memory is freed), not left to the
    process's end; the error is the one without a cache."""
    from pathlib import Path

    from forensics.core.errors import RecipeError
    from forensics.format import open_dump
    from forensics.replay.load.host_cache import HostBlockCache
    from forensics.replay.options import load

    dump = Path(_gpt2_dump(tmp_path, helpers, kit))
    blob = (dump / "model.safetensors").read_bytes()
    helpers.resign(dump, "model.safetensors", helpers.retype_tensor(blob, "transformer.ln_f.weight", torch.int32))
    closed = []
    close = HostBlockCache.close
    monkeypatch.setattr(HostBlockCache, "close", lambda self: (closed.append(len(self)), close(self)))
    with pytest.raises(RecipeError, match="transformer.ln_f.weight"):
        load(open_dump(str(dump)), ReplayOptions(device="cpu", memory_budget=TINY, host_cache_bytes=1 << 30))
    assert closed and closed[0] > 0  # it held blocks when the load failed, and was closed


def test_a_nonfinite_weight_in_a_streamed_block_is_named_as_without_streaming(tmp_path, helpers, kit):
    """A block's weight holding NaN in the dump (re-signed): the load notes it while the block streams past (its
    finiteness read once the load is through), and the report names it as the unconstrained replay does."""
    from pathlib import Path

    from safetensors.torch import load as load_blob
    from safetensors.torch import save

    dump = Path(_gpt2_dump(tmp_path, helpers, kit, layers=4))
    tensors = load_blob((dump / "model.safetensors").read_bytes())
    key = "transformer.h.2.mlp.c_fc.weight"
    tensors[key][3, 5] = float("nan")
    helpers.resign(dump, "model.safetensors", save(tensors))
    options = dict(device="cpu", remedies=False, rng_check=False, max_per_sample=2)
    normal = run_replay(dump, ReplayOptions(**options))
    assert normal["culprit"]["parameter"] == key
    for cache in (1 << 30, 0):
        streamed = run_replay(dump, ReplayOptions(**options, memory_budget=TINY, host_cache_bytes=cache))
        assert streamed["culprit"]["parameter"] == key and streamed["verdict"]["kind"] == normal["verdict"]["kind"]


HELD_GRAPHS = '''
import gc, weakref, torch, transformers

HELD = weakref.WeakSet()
LIMIT = 2

class _Token:
    """Stands for one graph (compared by identity: a tensor's == is elementwise)."""

class _Held(torch.autograd.Function):
    """The identity; its backward allocates more than any host has while more than LIMIT of its graphs are held
    (a device that holds the activations of LIMIT passes, not more). A graph is held from its forward until its
    backward ran or it is gone: one that only a reference cycle keeps (a pass over, a group that ran out of memory)
    is collected before the count, so the count never depends on when the garbage collector last ran."""

    @staticmethod
    def forward(ctx, x):
        ctx.token = _Token()
        HELD.add(ctx.token)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if len(HELD) > LIMIT:
            gc.collect()
        if len(HELD) > LIMIT:
            torch.empty(1 << 62, dtype=torch.uint8)
        HELD.discard(ctx.token)
        return grad

class HeldNorm(torch.nn.LayerNorm):
    def forward(self, x):
        return super().forward(_Held.apply(x))

WIDTH = 32

def build():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=WIDTH, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0))
    model.transformer.ln_f = HeldNorm(WIDTH, eps=model.config.layer_norm_epsilon)
    return model
'''


def _factory_runner(tmp_path, helpers, kit, module: str, source: str, micro=2, width=128, budget=4_000_000):
    """(session, streamed CPU runner) of a GPT-2 dump (4 layers, every block in the host cache) replayed with the
    factory `module:build`, written from `source`."""
    from forensics.format import open_dump
    from forensics.replay.options import load
    from forensics.replay.run.streamed_runner import runner_for

    (tmp_path / f"{module}.py").write_text(source)
    dump = _gpt2_dump(tmp_path, helpers, kit, layers=4, micro=micro, width=width)
    options = ReplayOptions(
        device="cpu",
        memory_budget=budget,
        host_cache_bytes=1 << 30,
        factory=f"{module}:build",
        sys_path=[str(tmp_path)],
    )
    session = load(open_dump(dump), options)
    return session, runner_for(session)


def test_passes_run_together_in_groups_the_room_holds_split_when_out_of_memory(tmp_path, helpers, kit):
    """The per-sample rows' passes run together in groups sized by the plan's room for activations (a smaller budget,
    smaller groups); a group that runs out of memory (here a real allocation that fails while more than two passes'
    graphs are held) runs again as two halves, not every pass alone, and the groups after it are no larger; each
    row is the one of its pass run alone, to the bit."""
    session, runner = _factory_runner(
        tmp_path, helpers, kit, "held_graphs_model", HELD_GRAPHS, width=32, budget=500_000
    )
    try:
        refs = session.sample_refs[:5]
        room, whence = runner.activation_room()  # nothing ran yet: half the plan's share for activations
        budget = runner.plan.budget
        runner.plan.budget = budget // 2
        assert runner.activation_room()[0] < room and "room for activations" in whence  # less budget, less room
        runner.plan.budget = budget
        runner.run()  # the reproduce pass: its forwards measure what a sample keeps, and it ran keeping more
        per = runner.sample_activation_bytes
        room, whence = runner.activation_room()
        assert 0 < per and "kept at once by a pass that ran" in whence
        size, why = runner.joint_group_size(len(refs))
        assert size == min(5, room // per) == 5 and whence in why

        runner.block_major = False
        alone = runner.per_sample_rows(refs)
        runner.block_major = True
        joint_before = runner.joint_backwards
        together = runner.per_sample_rows(refs)
    finally:
        runner.close()
    assert repr(together) == repr(alone) and len({r["grad_norm"] for r in alone}) == len(alone)
    # 5 together ran out of memory: again as 3 + 2; the 3 ran out of memory too: 2 + 1; nothing ran all alone
    groups = [g for g in runner.joint_groups if "micro-batches" not in g]  # the passes' groups, not the reproduce's
    assert [g.split(" ")[0] for g in groups] == ["5", "3", "2", "1", "2"], groups
    assert "ran out of memory" in groups[0] and "again as 3 + 2" in groups[0]
    assert runner.joint_backwards - joint_before == 4  # 2 that raised, 2 that ran
    assert any("can't allocate memory" in e for e in runner.joint_backward_errors)


def test_a_pass_alone_after_a_group_that_ran_out_of_memory_runs_once(tmp_path, helpers, kit):
    """Every group of two runs out of memory (a device that holds one pass's activations): each is split into passes
    alone, and each pass alone runs once (the group's error is not read again for it: that split a pass of one into
    one and none, for good — the GPU hang of the 1b FSDP2 bf16 row); each row is the pass's alone, to the bit."""
    one = HELD_GRAPHS.replace("LIMIT = 2", "LIMIT = 1")
    session, runner = _factory_runner(tmp_path, helpers, kit, "held_one_model", one, width=32, budget=500_000)
    try:
        refs = session.sample_refs[:3]
        runner.run()
        runner.block_major = False
        alone = runner.per_sample_rows(refs)
        runner.block_major = True
        together = runner.per_sample_rows(refs)
    finally:
        runner.close()
    assert repr(together) == repr(alone)
    sizes = [g.split(" ")[0] for g in runner.joint_groups if "micro-batches" not in g]
    assert sizes == ["3", "2", "1", "1", "1"], runner.joint_groups


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().flatten().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("micro", [2, 3])
def test_micro_batches_of_a_pass_run_block_major_give_the_sequential_numbers(tmp_path, helpers, kit, micro):
    """A pass of several micro-batches with a backward runs them together: their forwards block by block, their
    backwards in one engine call, each block's gradients summed on the device in the micro-batch order (3: the
    order of the sums matters) and taken off once: two walks over the blocks instead of two a micro-batch, and the
    losses, gradient norm, non-finite parameters, per-parameter norms and kept gradients of the micro-batches run
    one after another, to the bit: the whole step (non-finite), a subset of samples in every micro-batch (a
    bisection candidate), its fp32 re-run, and FSDP2 bf16 compute with fp32 reduction."""
    from forensics.format import open_dump
    from forensics.replay.load.fsdp_precision import parse_units
    from forensics.replay.options import load
    from forensics.replay.run.streamed_runner import runner_for

    dump = _gpt2_dump(tmp_path, helpers, kit, layers=4, micro=micro, width=128)
    session = load(open_dump(dump), ReplayOptions(device="cpu", memory_budget=4_000_000, host_cache_bytes=1 << 30))
    runner = runner_for(session)
    refs = session.sample_refs
    healthy = [r for r in refs if r.index != 2]  # the last micro-batch's 3rd sample holds 1e38

    def seen(samples, fp32: bool = False) -> tuple:
        walks = runner.streamer.walks
        with runner.keeping_gradients():
            result = runner.run(samples, fp32=fp32, keep_grads=True)
            walked = runner.streamer.walks - walks
            grads = {n: _bits(p.grad) for n, p in runner.gradients()}
        norms = {n: _bits(norm) for n, (_, norm) in runner.streamer.norms.items()}
        runner.reset()
        return (repr(result.losses), repr(result.grad_norm), result.nonfinite_grad_params, norms, grads), walked

    def both(samples, fp32: bool = False) -> tuple:
        runner.block_major = False
        one_after_another, walked_alone = seen(samples, fp32)
        runner.block_major = True
        together, walked = seen(samples, fp32)
        assert together == one_after_another
        return walked, walked_alone

    try:
        assert runner.plan.resident_blocks < len(runner.plan.blocks)  # streamed, not every block held
        assert both(None) == (2, 2 * micro)  # the reproduce pass: non-finite, every block's gradients kept
        assert both(healthy) == (2, 2 * micro)
        assert both(healthy, fp32=True) == (2, 2 * micro)
        session.fsdp_units = parse_units(
            [{"module": "", "param_dtype": "bfloat16", "reduce_dtype": "float32", "cast_forward_inputs": True}]
        )
        assert both(healthy) == (2, 2 * micro)
    finally:
        runner.close()
    assert all("micro-batches" in g and "out of memory" not in g for g in runner.joint_groups)


def test_micro_batches_run_together_in_halves_after_running_out_of_memory(tmp_path, helpers, kit):
    """A pass's micro-batches run together run out of memory (a real allocation that fails while more than two of
    their graphs are held): the pass runs again from the start with half of them together, and later passes keep to
    that; the numbers are those of the micro-batches one after another, to the bit."""
    wide = HELD_GRAPHS.replace("WIDTH = 32", "WIDTH = 128")
    session, runner = _factory_runner(tmp_path, helpers, kit, "held_graphs_wide", wide, micro=4)
    healthy = [r for r in session.sample_refs if r.index != 2]

    def seen(samples) -> tuple:
        result = runner.run(samples, keep_grads=True)
        norms = {n: _bits(norm) for n, (_, norm) in runner.streamer.norms.items()}
        return repr(result.losses), repr(result.grad_norm), result.nonfinite_grad_params, norms

    try:
        runner.block_major = False
        alone = [seen(None), seen(healthy)]
        runner.block_major = True
        passes = runner.passes
        together = [seen(None), seen(healthy)]
    finally:
        runner.close()
    assert together == alone
    assert runner.passes - passes == 3  # the first pass ran again; the second kept to the halves at once
    said = runner.joint_groups
    assert said[0].startswith("4 micro-batches of 4 (room for activations")  # the passes alone measured them
    assert said[1].startswith("4 micro-batches: ran out of memory")
    assert said[2].startswith("2 micro-batches of 4 (") and "at most 2 since a group ran out of memory" in said[2]
    assert said[3].startswith("2 micro-batches of 4 (") and len(said) == 4


AUTOCAST_IN_BLOCK = '''
import torch, transformers

class AutocastAct(torch.nn.Module):
    """The block's activation under the model's own bf16 autocast (the fp32 re-run holds it disabled)."""
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.gelu(x @ torch.eye(x.shape[-1], dtype=x.dtype))

def build():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0))
    for block in model.transformer.h:
        block.mlp.act = AutocastAct()
    return model
'''


def test_fp32_micro_batches_entering_an_autocast_run_one_after_another(tmp_path, helpers, kit):
    """The fp32 re-run holds every autocast the code enters disabled in its forward; one micro-batch alone recomputes
    its blocks outside that hold, micro-batches run together inside it: where the code enters one, the pass runs its
    micro-batches one after another again, and the numbers are theirs (here the recomputation alone runs in bf16 and
    its backward raises: the pass stops after the first micro-batch, as it does one after another)."""
    session, runner = _factory_runner(tmp_path, helpers, kit, "autocast_in_block", AUTOCAST_IN_BLOCK)
    healthy = [r for r in session.sample_refs if r.index != 2]
    told = "held an autocast the code entered: one after another"
    try:
        runner.block_major = False
        alone = runner.run(healthy, fp32=True)
        runner.block_major = True
        together = runner.run(healthy, fp32=True)
        passes = runner.passes
        again = runner.run(healthy, fp32=True)  # a lasting reason: not tried together again (the code run twice)
        assert runner.passes - passes == 1 and sum(told in g for g in runner.joint_groups) == 1
    finally:
        runner.close()
    assert (repr(together.losses), repr(together.grad_norm)) == (repr(alone.losses), repr(alone.grad_norm))
    assert (repr(again.losses), repr(again.grad_norm)) == (repr(alone.losses), repr(alone.grad_norm))
    assert alone.losses[1] is None and alone.raised is not None
    assert together.fp32 and runner.fp32_count.held_autocasts > 0
    assert any(told in g for g in runner.joint_groups)


BLOCK_TWICE = '''
import torch, transformers

class TwiceList(torch.nn.ModuleList):
    """Inside the model's forward, its second block runs twice (a block reused in one forward)."""
    twice = False
    def __iter__(self):
        blocks = list(super().__iter__())
        return iter(blocks[:2] + blocks[1:] if self.twice else blocks)

def build():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0))
    blocks = model.transformer.h = TwiceList(model.transformer.h)
    own = model.transformer.forward
    def forward(*args, **kwargs):
        blocks.twice = True
        try:
            return own(*args, **kwargs)
        finally:
            blocks.twice = False
    model.transformer.forward = forward
    return model
'''


def test_a_block_run_twice_in_a_forward_makes_every_later_pass_run_its_micro_batches_one_after_another(
    tmp_path, helpers, kit
):
    """A block that runs twice in one micro-batch's forward leaves its gradients' sum unsure when micro-batches run
    together: the pass runs again one after another, and so does every later pass at once (the model's structure does
    not change: trying again would run the user's code twice in each), with the numbers of the micro-batches one after
    another."""
    session, runner = _factory_runner(tmp_path, helpers, kit, "block_twice", BLOCK_TWICE)
    healthy = [r for r in session.sample_refs if r.index != 2]
    told = "a block ran twice in one micro-batch's forward"
    try:
        runner.block_major = False
        alone = [runner.run(healthy), runner.run(healthy, fp32=True)]
        runner.block_major = True
        first = runner.run(healthy)
        passes = runner.passes
        later = runner.run(healthy, fp32=True)
        assert runner.passes - passes == 1  # not tried together again
    finally:
        runner.close()
    for result, expected in zip([first, later], alone):
        assert (repr(result.losses), repr(result.grad_norm)) == (repr(expected.losses), repr(expected.grad_norm))
    assert sum(told in g for g in runner.joint_groups) == 1


def test_the_plans_expected_reads_follow_the_schedule_and_a_full_host_cache_is_no_dump_read(tmp_path, helpers, kit):
    """The plan's line of expected block reads counts two walks a pass when a pass's micro-batches run together (not
    two a micro-batch: it overstated 13 B's reads 4.6 x), and with every block in the host cache it says the reads
    are copies from host memory, not seconds of reads from the dump (at 13 B it promised 'up to 389 s of reads')."""
    import re

    from forensics.format import open_dump
    from forensics.replay.options import load

    dump = _gpt2_dump(tmp_path, helpers, kit, layers=4)
    session = load(open_dump(dump), ReplayOptions(device="cpu", memory_budget=TINY, host_cache_bytes=1 << 30))
    plan = session.stream
    assert plan is not None and plan.resident_blocks < len(plan.blocks)

    def reads(line_set: list[str]) -> int:
        line = next(s for s in line_set if "expected about" in s)
        return int(re.search(r"up to about (\d+) block reads", line).group(1))

    together, apart = plan.describe(18, 2, together=True), plan.describe(18, 2)
    assert reads(together) < reads(apart)
    assert reads(together) == plan.expected_reads(18, 1)
    cached = next(s for s in together if "expected about" in s)
    assert "copied from the host cache" in cached and " s of reads" not in cached
    plan.cache = None  # no cache: the dump is read again, and the line says how long that took at load
    assert " s of reads" in next(s for s in plan.describe(18, 2, together=True) if "expected about" in s)
