"""Loading with consent: nothing a dump names is imported without --trust / --factory; built-in recipes,
torch optimizers, devices, deterministic mode, environment warnings, optimizer snapshots."""

import sys

import pytest
import torch

from forensics.core.errors import RecipeError, ReplayError
from forensics.replay.load.environment import deterministic_mode, environment_warnings, resolve_device
from forensics.replay.load.optimizer_state import MASTER_KEY, OptimizerSnapshot
from forensics.replay.load.recipe import optimizer_class, resolve_recipe

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")

def build(**kwargs):
    import torch
    return torch.nn.Linear(2, 2)

def loss(model, batch):
    return model(batch).sum()
"""


@pytest.fixture
def evil_module(tmp_path):
    """A module outside forensics.recipes that leaves a marker file when imported."""
    name = f"dump_supplied_{tmp_path.name.replace('-', '_')}"
    marker = tmp_path / "IMPORTED"
    (tmp_path / f"{name}.py").write_text(EVIL.format(marker=str(marker)))
    yield name, marker, str(tmp_path)
    sys.modules.pop(name, None)
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def test_dump_named_factory_is_not_imported_without_trust(evil_module):
    name, marker, path = evil_module
    recipe = {"factory": f"{name}:build", "factory_kwargs": {}, "loss": None}

    with pytest.raises(RecipeError) as err:
        resolve_recipe(recipe, sys_path=[path])

    message = str(err.value)
    assert f"{name}:build" in message and "--trust" in message and "--factory" in message
    assert "NOT imported" in message
    assert not marker.exists() and name not in sys.modules


def test_dump_named_loss_is_not_imported_without_trust(evil_module):
    name, marker, path = evil_module
    recipe = {"factory": "forensics.recipes:huggingface_model", "factory_kwargs": {}, "loss": f"{name}:loss"}
    with pytest.raises(RecipeError, match="--loss"):
        resolve_recipe(recipe, sys_path=[path])
    assert not marker.exists()


def test_trust_or_user_named_factory_imports(evil_module):
    name, marker, path = evil_module
    recipe = {"factory": f"{name}:build", "factory_kwargs": {}, "loss": f"{name}:loss"}

    resolved = resolve_recipe(recipe, trust=True, sys_path=[path])

    assert marker.exists()
    model = resolved.factory(**resolved.factory_kwargs)
    with torch.no_grad():
        assert float(resolved.loss_fn(model, torch.ones(1, 2))) == float(model(torch.ones(1, 2)).sum())
    # naming the code yourself is consent too (the dump's recipe is then not used)
    user = resolve_recipe({"factory": "somewhere.else:fn"}, factory=f"{name}:build", loss=f"{name}:loss")
    assert isinstance(user.factory(), torch.nn.Linear)


def test_builtin_recipe_needs_no_trust(kit):
    config = kit.build_gpt2().config.to_dict()
    recipe = {
        "factory": "forensics.recipes:huggingface_model",
        "factory_kwargs": {"architecture": "GPT2LMHeadModel", "config": config},
        "loss": "forensics.recipes:default_loss",
        "loss_kwargs": {"ignore_keys": ["sample_ids"]},
    }

    resolved = resolve_recipe(recipe)

    model = resolved.factory(**resolved.factory_kwargs)
    batch = kit.build_batches(poison=False)[0]
    assert torch.isfinite(resolved.loss_fn(model, batch))  # sample_ids left out by loss_kwargs


def test_unimportable_recipe_is_a_recipe_error():
    with pytest.raises(RecipeError, match="no_such_module_xyz"):
        resolve_recipe({"factory": "no_such_module_xyz:fn"}, trust=True)
    with pytest.raises(RecipeError, match="--factory"):
        resolve_recipe({"factory": None})


def test_optimizer_classes_outside_torch_need_trust():
    assert optimizer_class("torch.optim.adamw.AdamW", trust=False) is torch.optim.AdamW
    with pytest.raises(RecipeError, match="--trust"):
        optimizer_class("evil.optim.Thing", trust=False)


def test_optimizer_snapshot_rebuilds_state_by_name_bitwise(kit):
    model = kit.build_gpt2(dropout=0.0)
    batch = kit.build_batches(poison=False)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):  # real state (exp_avg, exp_avg_sq, step)
        kit.hf_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    snapshot = OptimizerSnapshot.from_live(opt, model)
    clone = kit.build_gpt2(dropout=0.0)
    clone.load_state_dict(model.state_dict())

    rebuilt = snapshot.build(clone)

    for (n, p), q in zip(model.named_parameters(), clone.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(rebuilt.state[q][key], value), (n, key)
    for m, o in ((model, opt), (clone, rebuilt)):  # one more step on each: bitwise the same weights
        kit.hf_loss(m, batch).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), clone.parameters()))
    assert snapshot.build(clone).state[next(clone.parameters())]["step"] == 2  # the snapshot was not stepped


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_gpu_is_a_clear_replay_error():
    with pytest.raises(ReplayError, match="--device cpu"):
        resolve_device("cuda:0")
    assert resolve_device(None) == torch.device("cpu")


def test_deterministic_mode_is_restored():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    with deterministic_mode({"allow_tf32_matmul": True}):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.backends.cuda.matmul.allow_tf32
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == before


def test_the_replay_computes_with_the_jobs_sdpa_backends_and_reduced_precision_flags():
    """The job's process-wide kernel choices travel in the manifest's determinism block and are set for the replay:
    a job in the strict deterministic mode never ran cuDNN's attention (PyTorch leaves it out of SDPA's choice), so
    its replay, in the warn-only mode that would pick it, turns it off; everything is put back afterwards."""
    from forensics.capture.dumping.environment import determinism_flags

    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.math_sdp_enabled(), cuda.matmul.allow_bf16_reduced_precision_reduction)
    try:
        torch.use_deterministic_algorithms(True)
        recorded = determinism_flags()
    finally:
        torch.use_deterministic_algorithms(False)
    assert recorded["deterministic_algorithms"] is True and recorded["deterministic_warn_only"] is False
    assert recorded["cudnn_sdp"] is True and recorded["flash_sdp"] is True
    assert isinstance(recorded["allow_bf16_reduced_precision_reduction"], bool)
    job = {**recorded, "math_sdp": False, "allow_bf16_reduced_precision_reduction": False}
    with deterministic_mode(job):
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # the replay's own mode: warn only
        assert not cuda.cudnn_sdp_enabled() and not cuda.math_sdp_enabled() and cuda.flash_sdp_enabled()
        assert not cuda.matmul.allow_bf16_reduced_precision_reduction
    assert (cuda.cudnn_sdp_enabled(), cuda.math_sdp_enabled(), cuda.matmul.allow_bf16_reduced_precision_reduction) == (
        before
    )
    with deterministic_mode({**recorded, "deterministic_warn_only": True}):  # a warn-only job could run cuDNN's
        assert cuda.cudnn_sdp_enabled()


def test_environment_warnings_name_what_differs():
    warnings = environment_warnings(
        {"torch": "2.0.0", "gpus": [{"name": "NVIDIA H100", "sm_count": 132}]}, torch.device("cpu")
    )
    assert any("torch differs" in w and "2.0.0" in w for w in warnings)
    assert any("NVIDIA H100" in w and "CPU" in w for w in warnings)
    assert environment_warnings({"torch": torch.__version__, "gpus": []}, torch.device("cpu")) == []


def test_deepspeed_fp32_master_is_set_aside_and_a_bf16_model_gets_a_working_optimizer():
    """A DeepSpeed bf16 dump carries `fp32_master` per parameter: it never reaches the torch optimizer."""
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    state = {
        n: {
            "step": torch.tensor(4.0),
            "exp_avg": torch.full(p.shape, 0.1),
            "exp_avg_sq": torch.full(p.shape, 0.01),
            MASTER_KEY: p.detach().float() + 1e-3,
        }
        for n, p in model.named_parameters()
    }
    snapshot = OptimizerSnapshot(
        torch.optim.AdamW,
        [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "params": names}],
        state,
    )
    assert sorted(snapshot.masters) == sorted(names)
    assert snapshot.masters["weight"].dtype == torch.float32
    assert all(MASTER_KEY not in entries for entries in snapshot.state.values())
    optimizer = snapshot.build(model)
    assert all(MASTER_KEY not in s for s in optimizer.state.values())
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _nan_step_dump(tmp_path, model) -> str:
    """The Guard's dump of one AdamW step of a GPT-2 whose loss is NaN."""
    from forensics.capture import DetectionConfig, Guard, GuardConfig

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="nan", detection=DetectionConfig(on_nonfinite="skip")),
    )
    ids = torch.randint(0, 64, (2, 8))
    guard.record_batch({"input_ids": ids, "labels": ids, "sample_ids": ["a", "b"]})
    loss = model(input_ids=ids, labels=ids).loss * float("nan")
    guard.record_loss(loss)
    loss.backward()
    guard.check()
    guard.close()
    return guard.dumps[0]


def test_the_model_is_built_on_meta_and_streamed_with_tied_weights_kept_tied(tmp_path, helpers):
    """The replay builds parameters on the meta device (no random init) and streams the dump's tensors into
    them: GPT-2's tied lm_head / wte stay one parameter, and every weight equals the job's bit for bit."""
    from forensics.format import open_dump
    from forensics.replay.load.session import load_session

    model = helpers.make_gpt2(dropout=0.0)
    session = load_session(open_dump(_nan_step_dump(tmp_path, model)), device="cpu")
    replayed = session.model
    assert replayed.lm_head.weight is replayed.transformer.wte.weight
    assert not any(p.is_meta for p in replayed.parameters())
    for name, tensor in model.state_dict().items():
        assert torch.equal(replayed.state_dict()[name], tensor), name


class _DerivedBuffer(torch.nn.Module):
    """A module whose non-persistent buffer is computed from a parameter at init (not in any dump)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("scale", self.weight.detach() * 2, persistent=False)

    def forward(self, x):
        return (x * self.weight * self.scale).sum()


def build_derived_buffer():
    return _DerivedBuffer()


def test_a_buffer_derived_from_a_parameter_at_init_falls_back_to_a_normal_build(tmp_path):
    from forensics.capture import DetectionConfig, Guard, GuardConfig
    from forensics.format import open_dump
    from forensics.replay.load.session import load_session

    model = _DerivedBuffer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(tmp_path), run_id="derived", detection=DetectionConfig(on_nonfinite="skip")),
        loss_fn=_derived_loss,
    )
    x = torch.tensor([1.0, float("nan"), 2.0])
    guard.record_batch({"x": x.unsqueeze(0)}, sample_ids=["only"])
    loss = _derived_loss(model, {"x": x.unsqueeze(0)})
    guard.record_loss(loss)
    loss.backward()
    guard.check()
    guard.close()
    session = load_session(
        open_dump(guard.dumps[0]),
        device="cpu",
        factory=f"{__name__}:build_derived_buffer",
        loss=f"{__name__}:_derived_loss",
    )
    assert not session.model.scale.is_meta and torch.equal(session.model.scale, torch.full((3,), 2.0))


def _derived_loss(model, batch):
    return model(batch["x"])


def test_loading_runs_no_garbage_collection_and_gives_the_collector_back_as_it_was(tmp_path, helpers):
    """A replay's start (the model's libraries import, the dump's state loads) runs with the cyclic garbage
    collector paused (forensics.core.gc_pause): no collection walks the new objects again and again. Afterwards the
    collector is on again; a caller that had turned it off finds it off; a load that fails gives it back too."""
    import gc

    from forensics.format import open_dump
    from forensics.replay.load.session import load_session

    dump = open_dump(_nan_step_dump(tmp_path, helpers.make_gpt2(dropout=0.0)))
    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
    thresholds = gc.get_threshold()
    try:
        gc.collect()  # counts start at 0: no collection is due before load_session begins
        collections.clear()
        gc.set_threshold(50)  # unpaused, the load would collect every 50 new objects: hundreds of times
        try:
            session = load_session(dump, device="cpu")
        finally:
            gc.set_threshold(*thresholds)
        during = list(collections)
        assert gc.isenabled()
        gc.disable()
        try:
            load_session(dump, device="cpu")
            assert not gc.isenabled()
        finally:
            gc.enable()
        with pytest.raises(RecipeError):
            load_session(dump, device="cpu", factory="forensics_no_such_module:build")
        assert gc.isenabled()
    finally:
        gc.callbacks.pop()
    # at most the one pass over the young objects as the collector comes back
    assert len(during) <= 1 and session.model is not None
