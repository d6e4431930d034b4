"""The one place forensics reads other libraries' private members (torch, DeepSpeed, transformers, numpy, CPython).

Each read is one small function whose docstring says which versions have the member and where it was checked;
tests/forensics/test_thirdparty.py runs each against the installed library and fails loudly when it changes.
Nothing here imports DeepSpeed or transformers: the objects come from the caller.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import random
import sys
from typing import Any, Callable, Iterator

import torch
from torch.utils import _python_dispatch, _pytree  # torch imports both itself: nothing more is loaded here

# --------------------------------------------------------------------------------------------------------------
# torch.nn.Module


def own_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffers by attribute (not its children's; a None slot included), to read only.

    torch >= 2.4: `Module._buffers`; checked on torch 2.13 (CPU)."""
    return module._buffers


def is_persistent_buffer(module: torch.nn.Module, attr: str) -> bool:
    """Whether the module's buffer `attr` is in its state_dict (register_buffer(..., persistent=True)).

    torch >= 2.4: `Module._non_persistent_buffers_set`; checked on torch 2.13 (CPU)."""
    return attr not in module._non_persistent_buffers_set


def put_parameter(module: torch.nn.Module, attr: str, param: torch.nn.Parameter) -> None:
    """Puts `param` in the module's parameter slot `attr` as is (no Module.__setattr__ checks or hooks), e.g. while
    register_parameter runs, or for every name of a tied parameter.

    torch >= 2.4: `Module._parameters`; checked on torch 2.13 (CPU)."""
    module._parameters[attr] = param


def put_buffer(module: torch.nn.Module, attr: str, tensor: torch.Tensor) -> None:
    """Puts `tensor` in the module's buffer slot `attr` as is, keeping its persistence.

    torch >= 2.4: `Module._buffers`; checked on torch 2.13 (CPU)."""
    module._buffers[attr] = tensor


def compiled_original(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module torch.compile wrapped (None when `model` is not a compiled wrapper).

    torch >= 2.0: `OptimizedModule._orig_mod`; checked on torch 2.13 (CPU)."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


# --------------------------------------------------------------------------------------------------------------
# torch tensors, ops, optimizers, AMP


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter (bumped by every in-place change of its storage through it).

    torch >= 1.0: `Tensor._version`; checked on torch 2.13 (CPU)."""
    return tensor._version


def foreach_copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copies each source into its destination: one fused kernel per device and dtype where torch has one.

    torch >= 2.1: `torch._foreach_copy_` (older: one copy per tensor); checked on torch 2.13 (CPU)."""
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None:
        fused(destinations, sources)
        return
    for destination, source in zip(destinations, sources):
        destination.copy_(source)


def foreach_norm(tensors: list[torch.Tensor], ord: float = 2) -> list[torch.Tensor]:
    """Each tensor's `ord` norm (2, 1 or math.inf: the abs-max), as 0-d tensors on its device, in one fused kernel
    per device and dtype on CUDA (a CPU runs it tensor by tensor).

    torch >= 1.13: `torch._foreach_norm` (ord=inf on CUDA's fused path from 2.1); checked on torch 2.13 (CPU) and
    2.11 (CUDA)."""
    return list(torch._foreach_norm(tensors, ord))


def foreach_mul_(tensors: list[torch.Tensor], other: Any) -> None:
    """Multiplies each tensor in place by `other` (a number, a list of numbers, a 0-d tensor or a list of tensors),
    in one fused kernel per device and dtype.

    torch >= 2.1 (the 0-d tensor form): `torch._foreach_mul_`; checked on torch 2.13 (CPU)."""
    torch._foreach_mul_(tensors, other)


def foreach_sqrt(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's elementwise square root, as new tensors, in one fused kernel per device and dtype.

    torch >= 1.7: `torch._foreach_sqrt`; checked on torch 2.13 (CPU)."""
    return list(torch._foreach_sqrt(tensors))


def foreach_neg_(tensors: list[torch.Tensor]) -> None:
    """Negates each tensor in place (one fused kernel per device and dtype).

    torch >= 1.7: `torch._foreach_neg_`; checked on torch 2.13 (CPU)."""
    torch._foreach_neg_(tensors)


def foreach_sub_(tensors: list[torch.Tensor], value: float | torch.Tensor) -> None:
    """Subtracts `value` (a number or a 0-d tensor on their device) from each tensor in place.

    torch >= 2.1 (the 0-d tensor form): `torch._foreach_add_(..., alpha=-1)`; checked on torch 2.13 (CPU)."""
    if isinstance(value, torch.Tensor):
        torch._foreach_add_(tensors, value, alpha=-1)
    else:
        torch._foreach_add_(tensors, -value)


def foreach_reciprocal_(tensors: list[torch.Tensor]) -> None:
    """Replaces each tensor by its elementwise reciprocal, in place.

    torch >= 1.7: `torch._foreach_reciprocal_`; checked on torch 2.13 (CPU)."""
    torch._foreach_reciprocal_(tensors)


def foreach_max(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each (non-empty) tensor's largest element, as 0-d tensors: one fused kernel per device and dtype.

    torch >= 2.6: `torch._foreach_max` (older: one amax per tensor); checked on torch 2.13 (CPU)."""
    fused = getattr(torch, "_foreach_max", None)
    return list(fused(tensors)) if fused is not None else [t.amax() for t in tensors]


def op_schema(func: Any) -> Any:
    """The schema of an ATen op overload seen by a TorchDispatchMode: `.name` ("aten::mm"), `.is_mutable`,
    `.arguments` and `.returns` (each with `.alias_info`).

    torch >= 2.0: `OpOverload._schema`; checked on torch 2.13 (CPU)."""
    return func._schema


TorchDispatchMode = _python_dispatch.TorchDispatchMode
"""The base class of a mode that sees every ATen op (`__torch_dispatch__(func, types, args, kwargs)`) while it is
entered: subclass it, as the localisation and margin checks do.

torch >= 2.0: `torch.utils._python_dispatch.TorchDispatchMode`; checked on torch 2.13 (CPU)."""


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of a tree of tuples / lists / dicts / named tuples (as torch's ops see arguments), and the spec
    `tree_unflatten` rebuilds it from.

    torch >= 2.0: `torch.utils._pytree.tree_flatten`; checked on torch 2.13 (CPU)."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """The tree `tree_flatten` took apart, with `leaves` in place of its leaves.

    torch >= 2.0: `torch.utils._pytree.tree_unflatten`; checked on torch 2.13 (CPU)."""
    return _pytree.tree_unflatten(leaves, spec)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """The tree with every leaf replaced by `fn(leaf)` (torch's own rule: an op's arguments as it sees them).

    torch >= 2.0: `torch.utils._pytree.tree_map`; checked on torch 2.13 (CPU)."""
    return _pytree.tree_map(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of the tree, in `tree_flatten`'s order.

    torch >= 2.0: `torch.utils._pytree.tree_leaves`; checked on torch 2.13 (CPU)."""
    return _pytree.tree_leaves(tree)


def optimizer_honours_found_inf(optimizer: Any) -> bool:
    """Whether the optimizer's step() takes GradScaler's `found_inf` itself and skips a non-finite step on the
    device (fused Adam / AdamW / SGD / Adagrad), with no host sync. The optimizer's own attribute only: a wrapper that
    forwards attribute reads to the optimizer it wraps (Accelerate's, Lightning's) would take `found_inf` on itself,
    where the fused step never sees it.

    torch >= 2.0: `Optimizer._step_supports_amp_scaling`, set in the instance by a fused optimizer's __init__; checked
    on torch 2.13 (CPU)."""
    return bool(vars(optimizer).get("_step_supports_amp_scaling", False)) if hasattr(optimizer, "__dict__") else False


def grad_scaler_scale(scaler: Any) -> torch.Tensor | None:
    """The GradScaler's current scale as its device tensor (None before its first scale()); get_scale() would copy
    it to the host.

    torch >= 2.3: `torch.amp.GradScaler._scale`; checked on torch 2.13 (CPU)."""
    return getattr(scaler, "_scale", None)


def grads_scaled_by(scaler: Any, optimizer: Any) -> torch.Tensor | None:
    """What the optimizer's gradients are multiplied by right now: the GradScaler's scale (its device tensor) between
    `scaler.scale(loss).backward()` and `scaler.unscale_(optimizer)`; None once unscaled, before the first scale(),
    or without an enabled scaler.

    torch >= 2.3: `GradScaler._per_optimizer_states[id(optimizer)]["stage"]` (an OptState; no entry yet: READY)
    and `_scale`; checked on torch 2.13 (CPU)."""
    if scaler is None or not callable(getattr(scaler, "is_enabled", None)) or not scaler.is_enabled():
        return None
    states = getattr(scaler, "_per_optimizer_states", None)
    entry = states.get(id(optimizer)) if isinstance(states, dict) else None
    stage = entry.get("stage") if isinstance(entry, dict) else None
    if getattr(stage, "name", None) == "UNSCALED":
        return None
    return grad_scaler_scale(scaler)


def deterministic_setter() -> Callable[..., None] | None:
    """torch.use_deterministic_algorithms's own setter (mode, warn_only=...), which skips importing torch._inductor
    for its flag; None where torch has none.

    torch >= 2.4: `torch._C._set_deterministic_algorithms`; checked on torch 2.13 (CPU)."""
    return getattr(torch._C, "_set_deterministic_algorithms", None)


def allocator_settings_setter() -> Callable[[str], None] | None:
    """The CUDA caching allocator's run-time settings parser (the PYTORCH_CUDA_ALLOC_CONF syntax, "name:value,..."),
    applied to segments made from then on; None where torch has none.

    torch >= 2.9: `torch._C._accelerator_setAllocatorSettings`; torch 2.1-2.8: `torch.cuda.memory._set_allocator_settings`
    (deprecated on 2.13); checked on torch 2.11 (CUDA: the segments made after it expandable) and 2.13 (CPU)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    return setter or getattr(torch.cuda.memory, "_set_allocator_settings", None)


# --------------------------------------------------------------------------------------------------------------
# torch.distributed (FSDP2, DTensor)


def fsdp_mixed_precision(module: Any) -> Any:
    """The MixedPrecisionPolicy an FSDP2 unit (fully_shard) was built with (`param_dtype`, `reduce_dtype`,
    `output_dtype`, `cast_forward_inputs`), or None.

    torch >= 2.4: `FSDPModule._get_fsdp_state()._mp_policy`; checked on torch 2.13 (CPU, gloo)."""
    return getattr(module._get_fsdp_state(), "_mp_policy", None)


def dtensor_local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (local shape, global offset) of a DTensor with plain placements, computed from its mesh.

    torch >= 2.4: `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`; checked on torch 2.13
    (CPU, gloo)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


# --------------------------------------------------------------------------------------------------------------
# DeepSpeed (ZeRO-1/2 and the bf16 optimizer link each model parameter to its fp32 fragment)


def zero_linked(param: Any) -> bool:
    """Whether DeepSpeed linked the parameter to the flat fp32 partitions (ZeRO-1/2, bf16 optimizer).

    deepspeed >= 0.10: `param._hp_mapping` is set (None on a rank that holds none of it) by
    deepspeed.utils.mixed_precision_linkage; checked on deepspeed 0.19.8."""
    return hasattr(param, "_hp_mapping")


def zero_fragment(param: Any) -> Any:
    """This rank's fragment of the parameter's fp32 master (`hp_fragment`, `hp_fragment_address`,
    `lp_fragment_address` with `.start` / `.numel`, `param_group_index`); None when this rank holds none of it.

    deepspeed >= 0.10: `param._hp_mapping` (a deepspeed.utils.tensor_fragment.tensor_fragment); checked on
    deepspeed 0.19.8."""
    return getattr(param, "_hp_mapping", None)


def zero_dp_group(param: Any) -> Any:
    """The data-parallel process group the parameter's partitions are spread over (None: the default group).

    deepspeed >= 0.10: `param._dp_group`; checked on deepspeed 0.19.8."""
    return getattr(param, "_dp_group", None)


def zero_gradient_partitions(optimizer: Any) -> list[torch.Tensor] | None:
    """ZeRO-1/2: the gradient partitions this rank holds before the step (averaged over the ranks); None where the
    optimizer keeps none in that form (ZeRO-3, a plain optimizer).

    deepspeed >= 0.10: `DeepSpeedZeroOptimizer.averaged_gradients`, `{group index: [tensor | None]}` (a list of lists
    in older releases); checked on deepspeed 0.19.8."""
    grads = getattr(optimizer, "averaged_gradients", None)
    if not isinstance(grads, (dict, list)):
        return None
    groups = grads.values() if isinstance(grads, dict) else grads
    return [t for group in groups if group is not None for t in group if t is not None]


def zero_param_groups(optimizer: Any) -> list[tuple[int, list[Any]]] | None:
    """The model's parameters in each of the user's optimizer groups, in DeepSpeed's order, as (group index,
    parameters); None for an optimizer DeepSpeed does not wrap.

    deepspeed >= 0.10: `bit16_groups` (ZeRO-1/2), `bf16_groups` (BF16_Optimizer), `fp16_groups` with
    `sub_group_to_group_id` (ZeRO-3 splits a group into sub-groups), `fp16_groups` (FP16_Optimizer); checked on
    deepspeed 0.19.8."""
    for attribute in ("bit16_groups", "bf16_groups"):
        groups = getattr(optimizer, attribute, None)
        if groups:
            return list(enumerate(groups))
    sub_groups = getattr(optimizer, "fp16_groups", None)
    if sub_groups and hasattr(optimizer, "sub_group_to_group_id"):
        merged: dict[int, list[Any]] = {}
        for index, params in enumerate(sub_groups):
            merged.setdefault(optimizer.sub_group_to_group_id[index], []).extend(params)
        return sorted(merged.items())
    return list(enumerate(sub_groups)) if sub_groups else None


def zero_master_partition(optimizer: Any, group_index: int) -> torch.Tensor | None:
    """ZeRO-1/2 and the bf16 optimizer: this rank's flat fp32 master partition of group `group_index`, the key its
    optimizer state is kept under; None when the optimizer has none.

    deepspeed >= 0.10: `single_partition_of_fp32_groups` (ZeRO-1/2), `fp32_groups_flat_partition` (BF16_Optimizer);
    checked on deepspeed 0.19.8."""
    for attribute in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        flats = getattr(optimizer, attribute, None)
        if flats:
            master: torch.Tensor = flats[group_index]
            return master
    return None


def zero3_master_partitions(optimizer: Any) -> list[torch.Tensor]:
    """ZeRO-3: the flat fp32 partitions its optimizer steps, one per sub-group (the keys of its state).

    deepspeed >= 0.10: `DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat`; checked on deepspeed 0.19.8."""
    return list(getattr(optimizer, "fp32_partitioned_groups_flat", []))


def fp16_optimizer_masters(
    optimizer: Any,
) -> tuple[list[list[Any]], list[list[torch.Tensor]] | None, list[torch.Tensor] | None]:
    """ZeRO-0 with bf16 / fp16: (the low-precision parameter groups, the unfused wrapper's fp32 master per parameter,
    the fused wrapper's flat fp32 master per group, laid out in parameter order); the masters not kept are None.

    deepspeed >= 0.10: `fp16_groups`, `fp32_groups` (FP16_UnfusedOptimizer), `fp32_groups_flat` (FP16_Optimizer);
    checked on deepspeed 0.19.8."""
    return (
        list(getattr(optimizer, "fp16_groups", None) or []),
        getattr(optimizer, "fp32_groups", None) or None,
        getattr(optimizer, "fp32_groups_flat", None) or None,
    )


def loss_scale(optimizer: Any) -> float:
    """The current loss scale of a DeepSpeed fp16 optimizer.

    deepspeed >= 0.10: the `loss_scale` property of its fp16 / ZeRO optimizers; checked on deepspeed 0.19.8."""
    return float(optimizer.loss_scale)


def loss_scaler(optimizer: Any) -> Any:
    """A DeepSpeed fp16 optimizer's loss scaler (`dynamic`, `min_scale`, `scale_factor`, `scale_window`,
    `cur_hysteresis`, `cur_iter` ...); None when it keeps none.

    deepspeed >= 0.10: `loss_scaler` (deepspeed.runtime.fp16.loss_scaler); checked on deepspeed 0.19.8."""
    return getattr(optimizer, "loss_scaler", None)


def zero3_partitioned(param: Any) -> bool:
    """Whether ZeRO-3 partitioned the parameter (its data is a placeholder; `zero3_partition` reads this rank's part).

    deepspeed >= 0.10: `param.ds_id`; checked on deepspeed 0.19.8."""
    return hasattr(param, "ds_id")


def zero3_partition(param: Any) -> tuple[torch.Tensor, int, tuple[int, ...], Any]:
    """A ZeRO-3 parameter's part on this rank: (this rank's flat, padded slice of the flattened parameter, the full
    number of elements, the full shape, the process group it is partitioned over).

    deepspeed >= 0.10: `ds_tensor`, `ds_numel`, `ds_shape`, `ds_process_group`; checked on deepspeed 0.19.8."""
    return param.ds_tensor, int(param.ds_numel), tuple(param.ds_shape), param.ds_process_group


def full_shape(param: Any) -> torch.Size:
    """The parameter's shape before ZeRO-3 partitioned it (its own shape otherwise).

    deepspeed >= 0.10: `param.ds_shape`; checked on deepspeed 0.19.8."""
    shape: torch.Size = getattr(param, "ds_shape", None) or param.shape
    return shape


def call_before(obj: Any, name: str, before: Callable[[], None]) -> Callable[[], None]:
    """Makes `obj.<name>(...)` call `before()` first, through an instance attribute that shadows the class's method
    (DeepSpeed's `engine.step`, which Accelerate and the Trainer call themselves); returns the function that removes
    it, after which the class's method shows through again. When `before` raises, the method is not called and the
    exception goes on (a TrainingFaultError under 'raise' stops the step)."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before()
        return original(*args, **kwargs)

    setattr(obj, name, wrapped)

    def remove() -> None:
        if name in vars(obj):
            delattr(obj, name)

    return remove


# --------------------------------------------------------------------------------------------------------------
# Raw RNG states: whether a generator drew since the last look, in a byte compare instead of a state copy

MT_WORDS = 624  # the Mersenne Twister's 624 32-bit words
_RAW_BYTES = MT_WORDS * 4 + 4
_raw_layout_ok: dict[type, bool] = {}  # per generator type: the raw bytes matched its public state once
_raw_views: dict[str, tuple[Any, Any]] = {}  # "python" / "numpy": (the generator, a ctypes array over its state)


def _raw_view(slot: str, generator: Any, address: Callable[[Any], int]) -> bytes:
    """The `_RAW_BYTES` bytes at `address(generator)` inside `generator`, read through a ctypes array made once per generator
    (held with it, so its address stays valid): `.raw` is a plain copy, no foreign-function call (`ctypes.string_at`
    goes through libffi: 1-4 us between steps, but measured at ~300 us inside an FSDP2 step on a GPU host)."""
    held = _raw_views.get(slot)
    if held is None or held[0] is not generator:
        held = _raw_views[slot] = (generator, (ctypes.c_char * _RAW_BYTES).from_address(address(generator)))
    return held[1].raw


def raw_view(generator: Any) -> Any:
    """The raw state of `generator` (a `random.Random`, or a numpy MT19937 bit generator) as a ctypes array over the
    generator's own memory, made once per generator and cached (the array keeps no reference to it: hold the
    generator while you use the view); None when the raw bytes cannot be read (`python_random_raw` /
    `numpy_mt19937_raw` say when). Compare it in place with `same_raw` (no copy); `bytes(view)` copies it."""
    if isinstance(generator, random.Random):
        return _raw_views["python"][1] if python_random_raw(generator) is not None else None
    if numpy_mt19937_raw(generator) is None:
        return None
    return _raw_views["numpy"][1]


def same_raw(held: bytes | None, view: Any) -> bool:
    """Whether the generator's raw state under `view` (`raw_view`) still equals `held` (`bytes(view)` taken earlier),
    compared in place: one memcmp over the generator's memory, which stops at the first differing byte (Python's
    index comes first: a draw since is told in its first four bytes), and no copy of 2,500 bytes per call.

    `bytes.startswith` takes any buffer and compares with memcmp (CPython 3.x); equal lengths make it equality."""
    return held is not None and len(held) == len(view) and held.startswith(view)


def numpy_global_random_state() -> Any:
    """numpy's global legacy RandomState (np.random.rand, np.random.get_state are its bound methods); its current bit
    generator is `._bit_generator` (np.random.set_bit_generator replaces that, never the RandomState), read per
    call for a fraction of `np.random.get_bit_generator()`'s cost.

    numpy >= 1.17: `np.random.mtrand._rand` and `RandomState._bit_generator`; checked on numpy 2.4."""
    import numpy as np

    return np.random.mtrand._rand


def cuda_rng_key(generator: torch.Generator) -> tuple[int, int] | None:
    """(seed, Philox offset) of a CUDA generator, read as two integers, when they are all its `get_state()` holds
    (its 16 bytes: the seed, then the offset, in native order): two calls instead of a new tensor. Checked once per
    process against get_state(); None when they differ, or for a generator without an offset (a CPU one).

    torch >= 2.0: `CUDAGeneratorImpl::get_state` packs `current_seed()` and `philox_offset_per_thread()`, which
    `initial_seed()` and `get_offset()` return; checked on torch 2.11 (CUDA) by scripts/bench/paired_cost.py."""
    ok = _raw_layout_ok.get(torch.Generator)
    if ok is False:
        return None
    try:
        key = (generator.initial_seed(), generator.get_offset())
    except RuntimeError:  # a generator without an offset
        return None
    if ok is None:
        state = generator.get_state()
        packed = b"".join((value & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, sys.byteorder) for value in key)  # (two's
        # complement, as get_state's int64 offset holds it)
        _raw_layout_ok[torch.Generator] = ok = state.dtype == torch.uint8 and bytes(state.numpy()) == packed
    return key if ok else None


def numpy_global_bit_generator() -> Any:
    """The bit generator behind numpy's legacy global functions (np.random.rand, np.random.get_state).

    numpy >= 1.25: `np.random.get_bit_generator()`; older: `np.random.mtrand._rand._bit_generator`; checked on numpy
    2.4."""
    import numpy as np

    getter = getattr(np.random, "get_bit_generator", None)
    return getter() if getter is not None else np.random.mtrand._rand._bit_generator


def numpy_mt19937_raw(bit_generator: Any) -> bytes | None:
    """The raw state of a numpy MT19937 bit generator (its 624 key words, then its int position: 2,500 bytes), read
    through its documented ctypes interface (`BitGenerator.ctypes.state_address`); None for another generator, or
    when the bytes did not match `bit_generator.state` the first time (checked once per process).

    The layout is numpy's `mt19937_state` (uint32 key[624]; int pos): numpy >= 1.17; checked on numpy 2.4."""
    kind = type(bit_generator)
    if kind.__name__ != "MT19937" or _raw_layout_ok.get(kind) is False:
        return None
    raw = _raw_view("numpy", bit_generator, _numpy_state_address)
    if kind not in _raw_layout_ok:
        state = bit_generator.state["state"]
        expected = state["key"].astype("=u4").tobytes() + int(state["pos"]).to_bytes(4, sys.byteorder)
        _raw_layout_ok[kind] = raw == expected
        return raw if _raw_layout_ok[kind] else None
    return raw


def _numpy_state_address(bit_generator: Any) -> int:
    return int(bit_generator.ctypes.state_address)


def _python_state_address(generator: random.Random) -> int:
    return id(generator) + object.__basicsize__  # the C struct's fields right after the object header


def python_random_raw(generator: random.Random) -> bytes | None:
    """The raw Mersenne Twister state of a `random.Random` (its int index, then its 624 words: 2,500 bytes), read
    from the object's C struct right after the object header; None when the bytes did not match `getstate()` the
    first time for its type (checked once per process: another interpreter, another layout). `gauss_next` (a plain
    attribute) is not in it.

    The layout is CPython's `RandomObject` (PyObject_HEAD; int index; uint32_t state[624]): CPython 3.x; checked on
    CPython 3.11 and 3.12."""
    kind = type(generator)
    if not isinstance(generator, random.Random) or _raw_layout_ok.get(kind) is False:
        return None
    raw = _raw_view("python", generator, _python_state_address)
    if kind not in _raw_layout_ok:
        internal = generator.getstate()[1]
        words = internal[:MT_WORDS]
        _raw_layout_ok[kind] = len(internal) == MT_WORDS + 1 and raw == (
            int(internal[MT_WORDS]).to_bytes(4, sys.byteorder, signed=True) + array.array("I", words).tobytes()
        )
        return raw if _raw_layout_ok[kind] else None
    return raw


# --------------------------------------------------------------------------------------------------------------
# transformers


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a transformers config selects ("eager", "sdpa", "flash_attention_2"...).

    transformers >= 4.36: `PretrainedConfig._attn_implementation`; checked on transformers 5.24."""
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config: Any, value: str) -> None:
    """Selects the attention implementation on a transformers config before the model is built from it.

    transformers >= 4.36: `PretrainedConfig._attn_implementation`; checked on transformers 5.24."""
    config._attn_implementation = value


# Where transformers (4.5x - 5.x) fetches a kernel from the Hugging Face Hub: `lazy_load_kernel` (a model's init or
# forward asking for e.g. "causal-conv1d") runs only while `_kernels_enabled`; `get_kernel` and
# `load_and_register_attn_kernel` (an attention kernel "org/repo", the flash-attention fallback) are looked up as
# attributes of the module when called; the `kernels` package's own loaders as attributes of `kernels`.
HUB_KERNEL_LOADERS = {
    "transformers.integrations.hub_kernels": ("get_kernel", "load_and_register_attn_kernel", "lazy_load_kernel"),
    "kernels": ("get_kernel", "get_locked_kernel", "load_kernel", "get_local_kernel", "install_kernel"),
}


@contextlib.contextmanager
def hub_kernels_refused(refuse: Callable[[str], Any]) -> Iterator[None]:
    """While a transformers model is built: transformers' Hub kernels switched off, and every loader of Hub kernel
    code (HUB_KERNEL_LOADERS, where imported) replaced by `refuse(what)` (which raises); all restored after.

    transformers >= 4.56: `integrations.hub_kernels._kernels_enabled`, read at call time; checked on transformers 5.24
    (without the `kernels` package, which this host lacks: its loaders are then absent)."""
    saved: list[tuple[Any, str, Any]] = []
    hub: Any = sys.modules.get("transformers.integrations.hub_kernels")
    try:
        if hub is not None and hasattr(hub, "_kernels_enabled"):
            saved.append((hub, "_kernels_enabled", hub._kernels_enabled))
            hub._kernels_enabled = False
        for module_name, names in HUB_KERNEL_LOADERS.items():
            module = sys.modules.get(module_name)
            for name in names if module is not None else ():
                if callable(getattr(module, name, None)):
                    saved.append((module, name, getattr(module, name)))

                    def refused(*args: Any, _what: str = f"{module_name}.{name}", **kwargs: Any) -> Any:
                        return refuse(f"{_what}({', '.join(map(repr, args[:1]))})")

                    setattr(module, name, refused)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


__all__ = [
    "attn_implementation",
    "hub_kernels_refused",
    "call_before",
    "compiled_original",
    "cuda_rng_key",
    "deterministic_setter",
    "dtensor_local_box",
    "foreach_copy",
    "foreach_max",
    "foreach_mul_",
    "foreach_neg_",
    "foreach_norm",
    "foreach_reciprocal_",
    "foreach_sqrt",
    "foreach_sub_",
    "fp16_optimizer_masters",
    "fsdp_mixed_precision",
    "full_shape",
    "grad_scaler_scale",
    "is_persistent_buffer",
    "loss_scale",
    "loss_scaler",
    "numpy_global_bit_generator",
    "numpy_global_random_state",
    "numpy_mt19937_raw",
    "op_schema",
    "optimizer_honours_found_inf",
    "own_buffers",
    "put_buffer",
    "put_parameter",
    "python_random_raw",
    "raw_view",
    "same_raw",
    "set_attn_implementation",
    "tensor_version",
    "TorchDispatchMode",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "zero3_master_partitions",
    "zero3_partition",
    "zero3_partitioned",
    "zero_dp_group",
    "zero_fragment",
    "zero_gradient_partitions",
    "zero_linked",
    "zero_master_partition",
    "zero_param_groups",
]


# --------------------------------------------------------------------------------------------------------------
# torch._compile


def _disable_dynamo_parts(function: Any) -> tuple[Any, bool] | None:
    """(the wrapped function, recursive) when `function` is a `torch._compile._disable_dynamo` wrapper, else None."""
    code = getattr(function, "__code__", None)
    if code is None or code.co_name != "inner" or not code.co_filename.endswith("_compile.py"):
        return None
    cells = dict(zip(code.co_freevars, function.__closure__ or ()))
    if "fn" not in cells or "recursive" not in cells:
        return None
    return cells["fn"].cell_contents, bool(cells["recursive"].cell_contents)


def defer_dynamo_import(cls: type) -> None:
    """Makes `cls`'s methods wrapped by torch._compile._disable_dynamo (torch.optim.Optimizer's add_param_group,
    zero_grad, state_dict, load_state_dict ...) stop importing torch._dynamo while no one else has imported it.

    Each wrapper imports torch._dynamo on its first call (about as long as `import torch` itself, through sympy and
    torch.distributed.tensor) to build `torch._dynamo.disable(fn)`, which only matters while torch.compile traces
    the call; it caches that in `fn.__dynamo_disable`. This fills the cache with a stand-in that calls `fn` directly
    while torch._dynamo is not in sys.modules (then nothing is being compiled), and otherwise builds and caches the
    very function torch would have. torch 2.1 - 2.13: `_disable_dynamo`'s `inner` closes over `fn` and `recursive`
    and reads `fn.__dynamo_disable`; checked on torch 2.13 (CPU). A wrapper of another shape is left alone.
    """
    for klass in cls.__mro__:
        for member in list(vars(klass).values()):
            parts = _disable_dynamo_parts(member)
            if parts is None or getattr(parts[0], "__dynamo_disable", None) is not None:
                continue
            fn, recursive = parts
            fn.__dynamo_disable = _dynamo_disable_when_loaded(fn, recursive)


def _dynamo_disable_when_loaded(fn: Any, recursive: bool) -> Callable[..., Any]:
    """`fn` itself while torch._dynamo is not imported; once it is, torch._dynamo.disable(fn), built once and cached
    where torch's wrapper looks for it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None or not hasattr(dynamo, "disable"):
            return fn(*args, **kwargs)
        real = dynamo.disable(fn, recursive, wrapping=False)
        fn.__dynamo_disable = real
        return real(*args, **kwargs)

    return call
