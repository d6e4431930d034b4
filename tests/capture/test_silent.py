"""Silent corruption in one process: the recompute of a sampled step sees a flipped bit that makes no NaN and no
spike, leaves the job's gradients, RNG stream and buffers exactly as they were, stays silent under gradient
accumulation, dropout, BatchNorm, bf16 autocast and a GradScaler, and costs nothing when off (the default)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from forensics.capture import DetectionConfig, DumpConfig, Guard, GuardConfig
from forensics.capture.config import SilentConfig
from forensics.capture.silent.inject import ENV, FaultSpec, corrupt
from forensics.core.errors import TrainingFaultError
from forensics.core.kinds import Phase, Policy, SilentCheck, SilentClass
from forensics.core.silent import Difference, tensor_digest
from forensics.format import open_dump
from forensics.replay.engine import ReplayOptions, run_replay
from forensics.replay.judge.verdict_silent import SilentFacts, judge, judgement_block, silent_verdict

RECIPE = {"factory": "test_silent:build", "loss": "test_silent:loss"}


class Net(torch.nn.Module):
    """A small model with what a recompute must put back: dropout (RNG) and BatchNorm (buffers)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.norm(self.inp(x)))))


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def loss(model, batch):
    return (model(batch["x"]).float() - batch["y"]).square().mean()


def train(tmp_path, silent: SilentConfig | None, steps: int = 12, accumulation: int = 3, amp: bool = False):
    """A real loop: accumulation, optional bf16 autocast + GradScaler; returns (guard, losses, weights, rng draw)."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if amp else None
    config = GuardConfig(
        dump_dir=str(tmp_path / "dumps"),
        run_id="r",
        detection=DetectionConfig(silent=silent),
        dumping=DumpConfig(recipe=RECIPE),
    )
    guard = Guard(model, optimizer, scaler=scaler, config=config, loss_fn=loss)
    losses = []
    torch.manual_seed(1)
    try:
        for step in range(steps):
            for micro in range(accumulation):
                batch = {
                    "x": torch.randn(6, 8),
                    "y": torch.randn(6, 1),
                    "sample_ids": [f"s{step}m{micro}i{i}" for i in range(6)],
                }
                guard.record_batch(batch)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    value = loss(model, batch)
                guard.record_loss(value)
                scaled = value / accumulation
                (scaler.scale(scaled) if scaler else scaled).backward()
                losses.append(float(value.detach()))
            if scaler:
                scaler.unscale_(optimizer)
            if guard.check(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)):
                scaler.step(optimizer) if scaler else optimizer.step()
            if scaler:
                scaler.update()
            optimizer.zero_grad()
    finally:
        guard.close()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return guard, losses, weights, torch.rand(3)


def test_off_by_default_nothing_is_attached():
    model = torch.nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=GuardConfig(dump_dir="unused"))
    assert guard.config.detection.silent is None and guard.silent is None
    guard.close()


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16+scaler"])
def test_the_recompute_at_every_step_changes_nothing_the_job_computes_and_raises_nothing(tmp_path, amp):
    """Bitwise the same losses, weights, buffers and later RNG draws as a run without it: the recompute restores the
    RNG and the BatchNorm statistics and never touches .grad; and no false alarm (dropout's RNG is replayed)."""
    _, plain_losses, plain_weights, plain_draw = train(tmp_path / "plain", None, amp=amp)
    guard, losses, weights, draw = train(tmp_path / "silent", SilentConfig(recompute_every=1), amp=amp)
    assert guard.dumps == [] and guard.dump_errors == []
    assert losses == plain_losses
    assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)
    assert torch.equal(draw, plain_draw)


def test_a_flipped_gradient_bit_is_caught_at_its_step_dumped_and_replayed_as_transient(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the recipe names this module
    fault = FaultSpec("grad:out.weight", step=6, bit=1)
    guard, losses, _, _ = train(tmp_path, SilentConfig(recompute_every=3, on_mismatch="continue", inject=fault))
    assert all(math.isfinite(v) for v in losses)
    assert [open_dump(p).step for p in guard.dumps] == [6]
    dump = open_dump(guard.dumps[0])
    evidence = dump.silent()
    assert evidence["check"] == "recompute" and evidence["policy"] == "continue" and evidence["injected"] == [6]
    assert (
        evidence["first_difference"]["where"] == Phase.BACKWARD and evidence["first_difference"]["name"] == "out.weight"
    )
    report = run_replay(guard.dumps[0], ReplayOptions(device="cpu", trust=True))
    silent = report["silent"]
    assert silent["class"] == "transient" and silent["wrong"] == "job" and silent["drain_rank"] == 0
    assert silent["module"] == "gradient of out.weight"
    # 'continue' applied the wrong gradients: the advice is to go back before the step
    assert any("before step 6" in s for s in report["verdict"]["suggestions"])


def test_a_fault_at_a_step_that_is_not_sampled_is_not_seen(tmp_path):
    """The recompute samples steps (and the first): what it does not sample it cannot see — the period is the cost."""
    fault = FaultSpec("output:inp", step=4, bit=1)
    guard, _, _, _ = train(tmp_path, SilentConfig(recompute_every=3, inject=fault), steps=6)
    assert guard.dumps == [] and guard.silent.injector.injected == [4]


def test_raise_stops_the_job_after_the_dump(tmp_path):
    fault = FaultSpec("output:norm", step=0, bit=0)
    with pytest.raises(TrainingFaultError, match="recompute of step 0 disagrees.*module `norm`") as raised:
        train(tmp_path, SilentConfig(recompute_every=100, inject=fault))
    assert raised.value.dump_path is not None


def test_the_injection_is_read_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "target=output:out,step=3,bit=0")
    guard, _, _, _ = train(tmp_path, SilentConfig(recompute_every=3, on_mismatch="skip"), steps=5)
    assert [open_dump(p).step for p in guard.dumps] == [3]


@pytest.mark.parametrize(
    "text, message",
    [
        ("target=output:x,step=1,colour=red", "unknown key 'colour'"),
        ("step=1", "needs target"),
        ("target=neuron:x,step=1", "must be output"),
        ("target=output:x", "needs a step, or a rate"),
    ],
)
def test_a_bad_injection_spec_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        FaultSpec.parse(text)


def test_a_low_mantissa_flip_changes_the_digest_and_not_the_value_visibly():
    torch.manual_seed(0)
    x = torch.randn(1000)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = x.to(dtype)
        flipped = corrupt(t, FaultSpec("output:a", step=0, element=123, bit=0))
        assert torch.isfinite(flipped).all() and (flipped != t).sum() == 1
        assert (flipped.float() - t.float()).abs().max() <= 1e-2 * t.float().abs()[123] + 1e-30
        assert tensor_digest(flipped)[0] != tensor_digest(t)[0]
    assert tensor_digest(x.flip(0))[0] != tensor_digest(x)[0]  # order-sensitive
    assert tensor_digest(x)[0] == tensor_digest(x.clone())[0]


def _facts(**changes):
    base = dict(
        check=SilentCheck.RECOMPUTE,
        step=7,
        rank=1,
        device={"type": "cuda", "name": "GPU-X", "uuid": "GPU-1", "host": "n1"},
        replay_device={"type": "cuda", "name": "GPU-X", "uuid": "GPU-0", "host": "n1"},
        policy=Policy.SKIP,
    )
    return SilentFacts(**{**base, **changes})


AT = Difference(0, Phase.FORWARD, "h.3.mlp", 5)
EARLY = Difference(0, Phase.FORWARD, "h.0.attn.c_proj", 2)  # before AT: where the job's two runs still agree


@pytest.mark.parametrize(
    "facts, kind, wrong, drain",
    [
        (_facts(job_vs_recompute=AT, replay_vs_recompute=AT), SilentClass.TRANSIENT, "recompute", 1),
        (_facts(job_vs_recompute=AT, replay_vs_job=AT), SilentClass.TRANSIENT, "job", 1),
        (_facts(job_vs_recompute=AT, replay_vs_job=AT, replay_vs_recompute=AT), SilentClass.PERSISTENT, "both", 1),
        (
            _facts(job_vs_recompute=AT, replay_vs_job=AT, replay_vs_recompute=Difference(0, Phase.BACKWARD, "w", 1)),
            SilentClass.TRANSIENT,
            "job",
            1,
        ),
        (
            _facts(check=SilentCheck.CROSS_RANK, cross_rank=AT, replay_vs_job=AT, reference_replayed=True),
            SilentClass.PERSISTENT,
            "both",
            1,
        ),
        (_facts(job_vs_recompute=AT, replay_vs_job=AT, replay_vs_replay=AT), SilentClass.NOT_HARDWARE, None, None),
        (_facts(check=SilentCheck.CROSS_RANK, cross_rank=AT), SilentClass.NOT_HARDWARE, None, None),
        (_facts(cross_rank=AT, same_device=True), SilentClass.UNDECIDED, None, None),
        (_facts(job_vs_recompute=AT, comparable=False), SilentClass.UNDECIDED, None, None),
        (_facts(job_vs_recompute=AT, comparable=False, job_deterministic=True), SilentClass.TRANSIENT, None, 1),
        (_facts(replay_vs_job=EARLY), SilentClass.UNDECIDED, None, None),
    ],
    ids=[
        "recompute-hit",
        "job-hit",
        "both-differ",
        "job-hit-replay-differs-downstream",
        "stuck",
        "replay-nondeterministic",
        "agrees",
        "same-device",
        "other-kind",
        "other-kind-deterministic-job",
        "replay-differs-nothing-to-check-it",
    ],
)
def test_the_silent_verdict_table(facts, kind, wrong, drain):
    judged = judge(facts)
    assert (judged.kind, judged.wrong, judged.drain_rank) == (kind, wrong, drain)
    verdict, _ = silent_verdict(facts)
    headline = verdict.headline.lower()
    assert ("drain" in headline) == (kind is SilentClass.PERSISTENT)
    if kind is SilentClass.UNDECIDED and facts.same_device:
        assert "cannot be told from a genuine result" in verdict.headline
    if kind is SilentClass.NOT_HARDWARE and facts.replay_vs_replay is not None:
        assert "h.3.mlp" in verdict.headline and "deterministic" in verdict.headline


def test_close_removes_every_hook_even_of_a_step_left_armed(tmp_path):
    """The first step is always sampled: its hooks go on at record_batch; a job that ends before check() (an
    exception) still gets a clean model back from close()."""
    model = build()
    config = GuardConfig(dump_dir=str(tmp_path), detection=DetectionConfig(silent=SilentConfig()))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config, loss_fn=loss)
    guard.record_batch({"x": torch.randn(2, 8), "y": torch.randn(2, 1), "sample_ids": [0, 1]})
    assert guard.silent.recompute.armed and model.inp._forward_hooks
    guard.close()
    assert not any(m._forward_hooks for m in model.modules())
    assert not any(p._backward_hooks for p in model.parameters())
    assert all(p._backward_hooks is None for p in model.parameters())  # not even an empty dict, which autograd calls


def test_an_unsampled_step_calls_nothing_of_the_recompute_from_autograd(tmp_path):
    """A sampled step's gradient hooks are removed at its check(), and with them the hook dict PyTorch wires into
    autograd at the first register_hook of a parameter: left empty it is still called (a Python call per parameter
    at every backward: the recompute's +1.25 % on unsampled steps of GPT-2 small). Shown by a callable slipped into
    the dict afterwards, which an unwired dict never calls."""
    model = build()
    config = GuardConfig(dump_dir=str(tmp_path), detection=DetectionConfig(silent=SilentConfig(recompute_every=100)))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config, loss_fn=loss)
    batch = {"x": torch.randn(2, 8), "y": torch.randn(2, 1), "sample_ids": [0, 1]}
    for _ in range(2):  # the first step is sampled, the second not
        guard.record_batch(batch)
        value = loss(model, batch)
        guard.record_loss(value)
        value.backward()
        assert guard.check()
    called: list = []
    for param in model.parameters():
        if param._backward_hooks is not None:
            param._backward_hooks[12345] = lambda grad: called.append(1)
    loss(model, batch).backward()
    guard.close()
    assert called == []


def test_a_replay_that_parts_from_both_job_runs_before_they_part_is_not_evidence_the_jobs_runs_decide():
    """The GPU case of issue 51: the job's two runs on cuda:1 (deterministic algorithms) part at h.3.mlp; the replay
    on cuda:0 differs from both at h.0.attn.c_proj, where they still agree: the replay device's numerics differ, it is
    not evidence of a persistent fault. Two answers of one device to one computation: transient on the job's device,
    the verdict saying where the replay parted (the old rule called it persistent)."""
    facts = _facts(job_vs_recompute=AT, replay_vs_job=EARLY, replay_vs_recompute=EARLY, job_deterministic=True)
    judged = judge(facts)
    assert (judged.kind, judged.wrong, judged.drain_rank, judged.evidence) == (SilentClass.TRANSIENT, None, 1, "job")
    assert judged.module == "h.3.mlp" and judged.replay_parted == "h.0.attn.c_proj"
    verdict, _ = silent_verdict(facts)
    assert "transient" in verdict.headline and "drain" not in verdict.headline.lower()
    assert "could not reproduce the job bit for bit" in verdict.explanation and "h.0.attn.c_proj" in verdict.explanation
    block = judgement_block(facts, judged)
    assert block["evidence"] == "job" and block["replay_parted"] == "h.0.attn.c_proj"
    # the job without deterministic algorithms: a non-deterministic kernel explains its two runs parting
    undecided = judge(_facts(job_vs_recompute=AT, replay_vs_job=EARLY, replay_vs_recompute=EARLY))
    assert (undecided.kind, undecided.drain_rank) == (SilentClass.UNDECIDED, None)
    # the replay agreeing with both up to the parting and differing from both there: the fault repeated
    assert judge(_facts(job_vs_recompute=AT, replay_vs_job=AT, replay_vs_recompute=AT)).kind is SilentClass.PERSISTENT


@pytest.mark.parametrize(
    "reference, kind, evidence",
    [
        ({"reference_replayed": True}, SilentClass.PERSISTENT, "replay"),
        ({"reference_replayed": True, "replay_vs_reference": EARLY}, SilentClass.UNDECIDED, "job"),
        ({}, SilentClass.UNDECIDED, "job"),
    ],
    ids=["replay-reproduces-rank-0", "replay-does-not-reproduce-rank-0", "rank-0-dump-absent"],
)
def test_a_stuck_fault_is_persistent_only_where_the_replay_reproduces_a_healthy_devices_reference(
    reference, kind, evidence
):
    """Rank 1's two runs agree, its run of rank 0's micro-batch disagrees with rank 0's (the cross-rank check), the
    replay differs from rank 1's runs early (h.0.attn.c_proj, before the injected module): persistent on rank 1 only
    where the replay, run on rank 0's micro-batch, reproduces rank 0's digests; otherwise undecided, with the job's
    evidence (persistent likely on rank 1: drain it to be safe)."""
    facts = _facts(check=SilentCheck.CROSS_RANK, cross_rank=AT, replay_vs_job=EARLY, **reference)
    judged = judge(facts)
    assert (judged.kind, judged.drain_rank, judged.evidence) == (kind, 1, evidence)
    verdict, _ = silent_verdict(facts)
    if kind is SilentClass.UNDECIDED:
        assert "persistent fault of rank 1's device is likely" in verdict.headline
        assert "drain" not in verdict.headline.lower() and verdict.suggestions[0].startswith("Drain rank 1's node")
        assert "h.0.attn.c_proj" in verdict.explanation


def test_the_replica_check_installs_nothing_on_a_step_that_neither_is_checked_nor_precedes_a_check():
    """Its after-update digest (which replica's weights changed outside an update) needs the update of the step
    before a checked one only: the optimizer hook is installed at that step's check() and removes itself once it has
    run; the other steps run nothing of the check (the old hook, on every step, was a cost on every step)."""
    from forensics.capture.silent.replicas import ReplicaCheck

    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list = []
    hooks = optimizer._optimizer_step_post_hooks
    before = len(hooks)
    check = ReplicaCheck(model, optimizer, 4, kept.append, torch.device("cpu"))

    def step() -> None:
        loss(model, {"x": torch.randn(2, 8), "y": torch.randn(2, 1)}).backward()
        optimizer.step()
        optimizer.zero_grad()

    for number in (1, 2):  # checked at 0, 4, 8: steps 1 and 2 neither are checked nor precede a check
        assert check.check(number, 2) is None and len(hooks) == before
        step()
        assert check.after_update is None
    assert check.check(3, 2) is None and len(hooks) == before + 1  # step 3 precedes the check of step 4
    step()
    assert len(hooks) == before and check.after_update is not None and check.after_update.shape == (len(check.params),)
    assert torch.equal(check.after_update, check.digests())
    check.check(5, 2)
    assert check.after_update is None
    check.check(7, 2)
    for hook in kept:  # close() removes a hook left armed (a job that ends before the update)
        hook.remove()
    assert len(hooks) == before
