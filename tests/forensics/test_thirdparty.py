"""forensics/core/thirdparty.py against the installed torch, DeepSpeed and transformers: each adapter reads a private
member of theirs, and each test here fails loudly when that member moves or changes meaning."""

from __future__ import annotations

import subprocess
import sys
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist

from forensics.core import thirdparty


class WithMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(3)
        self.register_buffer("mask", torch.ones(3), persistent=False)
        self.register_buffer("empty", None)


def test_own_buffers_are_the_modules_own_with_none_slots_and_their_persistence():
    module = WithMask()
    assert set(thirdparty.own_buffers(module)) == {"mask", "empty"}  # not the child's running stats
    assert thirdparty.own_buffers(module)["empty"] is None
    assert set(thirdparty.own_buffers(module.norm)) == {"running_mean", "running_var", "num_batches_tracked"}
    assert thirdparty.is_persistent_buffer(module.norm, "running_mean")
    assert not thirdparty.is_persistent_buffer(module, "mask")
    assert "mask" not in module.state_dict() and "norm.running_mean" in module.state_dict()


def test_put_parameter_and_put_buffer_replace_the_slot_as_is():
    module = WithMask()
    linear = torch.nn.Linear(2, 2)
    new = torch.nn.Parameter(torch.full((2, 2), 7.0))
    thirdparty.put_parameter(linear, "weight", new)
    assert linear.weight is new and dict(linear.named_parameters())["weight"] is new
    stats = torch.full((3,), 5.0)
    thirdparty.put_buffer(module.norm, "running_mean", stats)
    assert module.norm.running_mean is stats and torch.equal(module.state_dict()["norm.running_mean"], stats)
    thirdparty.put_buffer(module, "mask", torch.zeros(3))
    assert torch.equal(module.mask, torch.zeros(3)) and "mask" not in module.state_dict()  # still non-persistent


def test_compiled_original_unwraps_torch_compile_only():
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model)  # nothing is compiled before the first call
    assert compiled is not model
    assert thirdparty.compiled_original(compiled) is model
    assert thirdparty.compiled_original(model) is None


def test_tensor_version_counts_in_place_changes_through_views():
    tensor = torch.zeros(4)
    before = thirdparty.tensor_version(tensor)
    tensor.add_(1)
    after_add = thirdparty.tensor_version(tensor)
    tensor.view(2, 2).mul_(3)
    assert before < after_add < thirdparty.tensor_version(tensor)
    _ = tensor + 1  # out of place: no change
    assert thirdparty.tensor_version(tensor) == after_add + 1


def test_foreach_copy_and_norm_are_torchs_fused_kernels_and_exact():
    assert hasattr(torch, "_foreach_copy_") and hasattr(torch, "_foreach_norm")
    sources = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64)]
    destinations = [torch.empty(3, 4), torch.empty(5, dtype=torch.float64)]
    thirdparty.foreach_copy(destinations, sources)
    assert all(torch.equal(d, s) for d, s in zip(destinations, sources))
    norms = thirdparty.foreach_norm(sources)
    assert [n.shape for n in norms] == [torch.Size([]), torch.Size([])]
    assert all(torch.allclose(n, torch.linalg.vector_norm(s)) for n, s in zip(norms, sources))


def test_the_elementwise_foreach_ops_match_their_per_tensor_forms():
    tensors = [torch.rand(3, 4) + 0.1, torch.rand(5, dtype=torch.float64) + 0.1]
    roots = thirdparty.foreach_sqrt(tensors)
    assert all(torch.equal(r, t.sqrt()) for r, t in zip(roots, tensors))
    thirdparty.foreach_neg_(roots)
    assert [float(m) for m in thirdparty.foreach_max(roots)] == [float(-t.sqrt().min()) for t in tensors]
    thirdparty.foreach_sub_(roots, 0.5)
    thirdparty.foreach_sub_(roots, torch.tensor(0.25))
    thirdparty.foreach_reciprocal_(roots)
    thirdparty.foreach_mul_(roots, tensors)
    thirdparty.foreach_mul_(roots, 2.0)
    assert all(torch.allclose(r, 2 * t / (-t.sqrt() - 0.75)) for r, t in zip(roots, tensors))


class Schemas(thirdparty.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = thirdparty.op_schema(func)
        self.seen[schema.name] = schema
        return func(*args, **(kwargs or {}))


def test_op_schema_names_the_aten_op_its_mutability_and_aliasing():
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    with Schemas() as mode:
        torch.mm(a, b)
        a.add_(b)
    mm, add_ = (
        mode.seen["aten::mm"],
        mode.seen["aten::add_.Tensor" if "aten::add_.Tensor" in mode.seen else "aten::add_"],
    )
    assert not mm.is_mutable and all(r.alias_info is None for r in mm.returns)
    assert add_.is_mutable and any(r.alias_info is not None for r in add_.returns)


def test_pytree_flattens_an_ops_arguments_and_rebuilds_them_in_order():
    Pair = namedtuple("Pair", "a b")
    tree = ((torch.ones(2), 3), {"k": [torch.zeros(1), "s"]}, Pair(torch.full((1,), 5.0), None))
    leaves, spec = thirdparty.tree_flatten(tree)
    assert [type(v).__name__ for v in leaves] == ["Tensor", "int", "Tensor", "str", "Tensor", "NoneType"]
    assert thirdparty.tree_leaves(tree) == leaves
    rebuilt = thirdparty.tree_unflatten(list(range(len(leaves))), spec)
    assert rebuilt == ((0, 1), {"k": [2, 3]}, Pair(4, 5)) and isinstance(rebuilt[2], Pair)
    doubled = thirdparty.tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, tree)
    assert float(doubled[2].a) == 10.0 and doubled[1]["k"][1] == "s" and isinstance(doubled[2], Pair)


def test_only_a_fused_optimizer_honours_found_inf():
    params = [torch.nn.Parameter(torch.randn(3))]
    assert thirdparty.optimizer_honours_found_inf(torch.optim.AdamW(params, fused=True))
    assert not thirdparty.optimizer_honours_found_inf(torch.optim.AdamW(params))

    class Wrapper:  # forwards reads to the optimizer it wraps, as Accelerate's and Lightning's wrappers do
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    wrapped = Wrapper(torch.optim.AdamW(params, fused=True))
    assert wrapped._step_supports_amp_scaling and not thirdparty.optimizer_honours_found_inf(wrapped)


def test_grad_scaler_scale_is_the_device_tensor_once_it_scaled():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert thirdparty.grad_scaler_scale(scaler) is None  # made lazily by the first scale()
    scaler.scale(torch.tensor(2.0))
    scale = thirdparty.grad_scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and float(scale) == 1024.0 == scaler.get_scale()


def test_grads_scaled_by_is_the_scale_until_unscale_and_none_after():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert thirdparty.grads_scaled_by(scaler, optimizer) is None  # nothing scaled yet
    scaler.scale(weight.sum()).backward()
    assert float(thirdparty.grads_scaled_by(scaler, optimizer)) == 8.0
    assert torch.equal(weight.grad, torch.full((3,), 8.0))
    scaler.unscale_(optimizer)
    assert thirdparty.grads_scaled_by(scaler, optimizer) is None and torch.equal(weight.grad, torch.ones(3))
    assert thirdparty.grads_scaled_by(torch.amp.GradScaler("cpu", enabled=False), optimizer) is None
    assert thirdparty.grads_scaled_by(None, optimizer) is None


def test_deterministic_setter_sets_what_torch_reports():
    setter = thirdparty.deterministic_setter()
    assert setter is not None
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        setter(True, warn_only=True)
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        setter(was, warn_only=warn)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A real gloo process group of one rank, in this process."""
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_fsdp_mixed_precision_is_the_policy_fully_shard_was_given(one_rank_group):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model)
    inner = thirdparty.fsdp_mixed_precision(model[0])
    assert (inner.param_dtype, inner.reduce_dtype, inner.output_dtype, inner.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        None,
        True,
    )
    assert thirdparty.fsdp_mixed_precision(model).param_dtype is None  # the root's own default policy


def test_dtensor_local_box_is_this_ranks_shape_and_offset(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    tensor = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    assert thirdparty.dtensor_local_box(tensor) == ((6, 4), (0, 0))
    assert tuple(tensor.to_local().shape) == (6, 4)


def test_zero_fragment_is_deepspeeds_link_from_a_parameter_to_its_fp32_partition():
    pytest.importorskip("deepspeed")
    from deepspeed.utils.mixed_precision_linkage import link_hp_params

    first, second = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(6))
    assert not thirdparty.zero_linked(first) and thirdparty.zero_fragment(first) is None
    flat = torch.arange(6, dtype=torch.float32)  # this rank's partition: elements 4..9 of the flat params
    link_hp_params(
        [first, second],
        flat,
        gradient_dict={0: [None, None]},
        offload_gradient_dict={},
        use_offload=False,
        param_group_index=0,
        partition_start=4,
        partition_size=6,
        dp_group="group",
    )
    assert thirdparty.zero_linked(first) and thirdparty.zero_fragment(first) is None  # none of it on this rank
    fragment = thirdparty.zero_fragment(second)
    assert (fragment.lp_fragment_address.start, fragment.lp_fragment_address.numel) == (0, 6)
    assert (fragment.hp_fragment_address.start, fragment.param_group_index) == (0, 0)
    assert torch.equal(fragment.hp_fragment, flat)
    assert thirdparty.zero_dp_group(second) == "group"


ZERO_INTERNALS = """
import json, os, sys
os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import torch, deepspeed
from forensics.core import thirdparty
out = {}
for stage in (0, 2, 3):  # ZeRO-0 bf16: DeepSpeed's unfused fp16 wrapper; 2: flat partitions; 3: partitioned params
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    loss = engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    optimizer, param = engine.optimizer, next(engine.module.parameters())
    grads = thirdparty.zero_gradient_partitions(optimizer)
    lp, per_param, flats = thirdparty.fp16_optimizer_masters(optimizer)
    master = thirdparty.zero_master_partition(optimizer, 0)
    out[stage] = {"grads": None if grads is None else sum(g.numel() for g in grads),
                  "groups": [(i, len(p)) for i, p in thirdparty.zero_param_groups(optimizer) or []],
                  "master": None if master is None else master.numel(),
                  "zero3_masters": [t.numel() for t in thirdparty.zero3_master_partitions(optimizer)],
                  "fp16": [len(lp), per_param is not None, flats is not None],
                  "partitioned": thirdparty.zero3_partitioned(param), "shape": list(thirdparty.full_shape(param)),
                  "partition": list(thirdparty.zero3_partition(param)[1:3]) if thirdparty.zero3_partitioned(param)
                  else None}
print("RESULT", json.dumps(out))
"""


@pytest.mark.slow  # a DeepSpeed launch (~20 s); the ZeRO-2 / ZeRO-3 multi-rank dumps read the same members
def test_deepspeeds_zero_internals_are_where_the_adapters_read_them(tmp_path):
    """One process, ZeRO-0 / 2 / 3 on CPU: what each adapter reads of a real DeepSpeed optimizer (58 parameters in 4
    tensors, one group)."""
    pytest.importorskip("deepspeed")
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", ZERO_INTERNALS, port], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    line = next((text for text in done.stdout.splitlines() if text.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    found = {int(k): v for k, v in json.loads(line.removeprefix("RESULT ")).items()}
    assert found[0]["fp16"] == [1, True, False] and found[0]["grads"] is None and found[0]["master"] is None
    assert found[2]["grads"] == 58 and found[2]["master"] == 58 and found[2]["fp16"][0] == 0
    assert found[3]["zero3_masters"] == [58] and found[3]["master"] is None
    assert found[3]["partitioned"] and found[3]["partition"] == [32, [8, 4]] and found[3]["shape"] == [8, 4]
    assert not found[2]["partitioned"] and found[2]["partition"] is None
    assert all(found[stage]["groups"] == [[0, 4]] for stage in (0, 2, 3))


def test_call_before_runs_first_and_removes_itself():
    class Engine:
        def step(self, x):
            calls.append(("step", x))
            return x + 1

    calls: list = []
    engine = Engine()
    remove = thirdparty.call_before(engine, "step", lambda: calls.append("before"))
    assert engine.step(1) == 2 and calls == ["before", ("step", 1)]
    remove()
    assert engine.step(2) == 3 and calls[-1] == ("step", 2) and "step" not in vars(engine)
    remove()  # twice: nothing left to remove


def test_attn_implementation_is_what_a_transformers_model_is_built_with():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    thirdparty.set_attn_implementation(config, "eager")
    assert thirdparty.attn_implementation(config) == "eager"
    model = transformers.GPT2LMHeadModel(config)
    assert thirdparty.attn_implementation(model.config) == "eager"


def test_raw_rng_states_match_the_public_ones_and_change_with_every_draw():
    """The raw bytes RngCapture compares (a byte compare instead of a state copy) are the generators' states: equal
    to what getstate()/get_state() say, and different after any draw."""
    import random
    import sys

    import numpy as np

    generator = random.Random(3)
    raw = thirdparty.python_random_raw(generator)
    assert raw is not None and len(raw) == 2500
    internal = generator.getstate()[1]
    assert raw[:4] == internal[-1].to_bytes(4, sys.byteorder) and raw[4:8] == internal[0].to_bytes(4, sys.byteorder)
    generator.random()
    assert thirdparty.python_random_raw(generator) != raw
    bit_generator = thirdparty.numpy_global_bit_generator()
    np.random.seed(3)
    raw = thirdparty.numpy_mt19937_raw(bit_generator)
    state = np.random.get_state()
    assert raw is not None and raw[:2496] == state[1].astype("=u4").tobytes()
    np.random.rand()
    assert thirdparty.numpy_mt19937_raw(bit_generator) != raw
    assert thirdparty.numpy_mt19937_raw(np.random.PCG64()) is None  # another bit generator: no raw read


def test_hub_kernel_loaders_are_where_hub_kernels_refused_looks():
    """transformers' switch and loaders of Hub kernels exist under the names the adapter replaces (a renamed one would
    slip past it)."""
    pytest.importorskip("transformers")
    import transformers.integrations.hub_kernels as hub

    assert isinstance(hub._kernels_enabled, bool)
    for name in thirdparty.HUB_KERNEL_LOADERS["transformers.integrations.hub_kernels"]:
        assert callable(getattr(hub, name)), name
    refused: list[str] = []
    with thirdparty.hub_kernels_refused(refused.append):
        assert hub._kernels_enabled is False
        hub.get_kernel("org/repo")
    assert refused == ["transformers.integrations.hub_kernels.get_kernel('org/repo')"]
    assert hub.get_kernel.__module__ == "transformers.integrations.hub_kernels"


def test_defer_dynamo_import_keeps_torch_dynamo_out_until_someone_else_loads_it():
    # a fresh interpreter: this test process may have imported torch._dynamo already
    code = """
import sys, torch
from forensics.core.thirdparty import defer_dynamo_import, _disable_dynamo_parts
defer_dynamo_import(torch.optim.AdamW)
wrapped = [m for m in vars(torch.optim.Optimizer).values() if _disable_dynamo_parts(m)]
assert {m.__name__ for m in wrapped} >= {"add_param_group", "zero_grad", "load_state_dict"}, wrapped
p = torch.nn.Parameter(torch.ones(3))
opt = torch.optim.AdamW([p], lr=0.1)
opt.zero_grad(); opt.load_state_dict(opt.state_dict())
assert "torch._dynamo" not in sys.modules  # (step() itself imports it: torch's _use_grad_for_differentiable)
import torch._dynamo
opt.zero_grad()  # now torch's own torch._dynamo.disable(fn) is built and cached, as torch would have
fn = _disable_dynamo_parts(torch.optim.Optimizer.zero_grad)[0]
assert getattr(fn, "__dynamo_disable").__module__.startswith("torch._dynamo")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert done.stdout.strip() == "ok", done.stderr


def test_raw_views_compare_in_place_and_numpy_s_global_state_is_the_one_get_state_reads():
    """raw_view is the generator's own memory (a draw shows in it without a new read), same_raw compares it with the
    bytes kept, numpy_global_random_state's bit generator is np.random.get_bit_generator()'s, and a CPU generator has
    no (seed, offset) key (its state is not a seed and an offset)."""
    import random

    import numpy as np

    generator = random.Random(5)
    view = thirdparty.raw_view(generator)
    held = bytes(view)
    assert held == thirdparty.python_random_raw(generator) and thirdparty.same_raw(held, view)
    generator.random()
    assert not thirdparty.same_raw(held, view) and bytes(view) == thirdparty.python_random_raw(generator)
    assert not thirdparty.same_raw(None, view) and not thirdparty.same_raw(held[:-1], view)
    assert thirdparty.numpy_global_random_state()._bit_generator is np.random.get_bit_generator()
    bit_generator = np.random.MT19937(5)
    view = thirdparty.raw_view(bit_generator)
    held = bytes(view)
    assert held == thirdparty.numpy_mt19937_raw(bit_generator)
    bit_generator.random_raw()
    assert not thirdparty.same_raw(held, view)
    assert thirdparty.raw_view(np.random.PCG64()) is None
    assert thirdparty.cuda_rng_key(torch.Generator()) is None


def test_allocator_settings_setter_takes_the_allocators_syntax():
    """torch >= 2.1 has a run-time setter of the CUDA allocator's settings (what a streamed GPU replay uses for
    expandable segments); a CPU build takes the setting too (nothing to apply it to)."""
    setter = thirdparty.allocator_settings_setter()
    assert setter is not None
    if not torch.cuda.is_available():
        setter("expandable_segments:False")
