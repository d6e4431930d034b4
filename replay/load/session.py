"""Load: turn a `Dump` (or live objects, for tests) into a `ReplaySession`, importing code only with consent.

The consent rules and imports live in replay/load/recipe.py, the optimizer snapshot in
replay/load/optimizer_state.py, device and determinism in replay/load/environment.py; this module puts
them together: model + weights, optimizer, loss, micro-batches, RNG states and what was recorded.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from forensics.core.errors import DumpCorruptError, DumpError, RecipeError
from forensics.format import spec
from forensics.format.sample_ids import ids_are_positional, positional_ids
from forensics.core.gc_pause import gc_paused
from forensics.core.kinds import TriggerKind
from forensics.core.thirdparty import is_persistent_buffer, own_buffers, put_buffer, put_parameter, tensor_version
from forensics.core.trigger import Trigger
from forensics.core.unfilled import unfilled
from forensics.replay.load.build_budget import BuildTooLargeError, WeightsHeld, build_budget, weights_held
from forensics.replay.load.environment import dtype_from_name, environment_warnings, resolve_device, to_device
from forensics.replay.load.fsdp_precision import FsdpUnit, compute_dtype, parse_units
from forensics.replay.load.optimizer_state import DumpOptimizerState, OptimizerSnapshot
from forensics.replay.load.recipe import LossFn, TrainingScript, job_paths, optimizer_class, resolve_recipe
from forensics.replay.load.samples import SampleRef
from forensics.replay.load.allocator import prefer_expandable_segments, restore_default_segments
from forensics.replay.load.host_cache import HostBlockCache, host_cache_capacity
from forensics.replay.load.stream_plan import (
    StreamPlan,
    cache_bytes,
    compute_dtypes,
    keep_blocks_at_rest,
    plan_streaming,
    settle,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# the session
# --------------------------------------------------------------------------------------------
@dataclass
class ReplaySession:
    """Everything needed to re-execute one optimizer step, live on `device`."""

    model: torch.nn.Module
    """Rebuilt model holding the pre-step weights (the StepRunner resets it before every run)."""
    loss_fn: LossFn
    """loss_fn(model, batch) -> scalar loss of one micro-batch, before division by `loss_divisor`."""
    micro_batches: list[Any]
    """Batch trees, tensors already on `device`."""
    device: torch.device
    sample_ids: list[list[Any]] = field(default_factory=list)
    """Per micro-batch, one JSON value per sample (dim 0 of the batch)."""
    rng_states: list[Any] = field(default_factory=list)
    """Per micro-batch, a forensics.core.rng.RngState captured right before its forward (or None)."""
    loss_divisor: float = 1.0
    """The step's objective is sum(micro-batch losses) / loss_divisor (gradient accumulation)."""
    optimizer: OptimizerSnapshot | None = None
    """The pre-step optimizer; `new_optimizer()` builds a fresh copy of it."""
    autocast: dict = field(default_factory=lambda: {"enabled": False, "device_type": None, "dtype": None})
    """As recorded: {"enabled", "device_type", "dtype" (e.g. "bfloat16")}."""
    scaler_state: dict | None = None
    """GradScaler.state_dict() when the job used one (its "scale" multiplies the loss)."""
    scheduler_state: dict | None = None
    recorded_losses: list[float | None] = field(default_factory=list)
    recorded_grad_norm: float | None = None
    exception: dict | None = None
    """The manifest's `exception` section when the job's step raised (replay then catches and compares)."""
    trigger: Trigger = field(default_factory=lambda: Trigger(TriggerKind.NONFINITE_LOSS))
    """What fired in the job (the manifest's `trigger`; a window replay's own for the step that broke)."""
    param_dtype: torch.dtype = torch.float32
    warnings: list[str] = field(default_factory=list)
    """Things the report should tell the user (environment mismatch, unreplayable batch leaves...)."""
    source_cuda_device: int | None = None
    """The CUDA device index whose RNG state drives this replay (the job's local rank)."""
    expect_bitwise: bool = True
    """Same kind of machine and torch as the capture: replayed numbers should match bit for bit."""
    capture_environment: dict = field(default_factory=dict)
    pre_step_weights: Callable[..., Iterator[tuple[str, torch.Tensor]]] | None = None
    """Re-reads the pre-step weights from the dump (pread, tensor by tensor, onto `device`; `names=`: only those):
    a large model is reset from the dump instead of from a copy held in memory (forensics.replay.run.execute.StepRunner)."""
    loaded_weights: dict[str, tuple] | None = None
    """Each parameter's weight_fingerprints() right after pre_step_weights put it in place: a weight whose
    fingerprint is still this one holds the dump's pre-step values (StepRunner re-reads only the others)."""
    followup: Any = None
    """Window replay: the recorded steps after this one (forensics.replay.run.window.Followup), over which the remedies are
    carried (replay/judge/remedy_followup.py); None otherwise."""
    positional_ids: frozenset[int] = frozenset()
    """Micro-batches whose sample IDs are positions in the batch, made up because the job recorded none: a
    report may name such a sample, a blocklist never (manifest `ids_are_positional`)."""
    grad_norms_scaled: bool = False
    """The job's grad norms were measured on gradients a GradScaler still held scaled (found by replay/run/execute.py
    `_to_replay_units`): the history's are divided by their loss scale before they are read."""
    world_size: int = 1
    """Ranks of the job. With more than one, the recorded grad norm covers every rank's gradients
    (after all-reduce / over all ZeRO shards), so a one-rank replay compares losses only."""
    step_micro_batches: int = 0
    """The job's micro-batches per step (manifest `grad_accum`): more than `micro_batches` when the step raised
    part-way ("micro-batch 1 of 2", never "1 of 1" for a step of 2 that raised in its first)."""
    fsdp_units: list[FsdpUnit] = field(default_factory=list)
    """The job's FSDP2 units and mixed-precision policies (replay/load/fsdp_precision.py): the step computes in them."""
    stream: StreamPlan | None = None
    """The state does not fit the replay device: its blocks stay in the dump and are materialised a few at a time
    while the step runs (replay/load/stream_plan.py, replay/run/streamed_runner.py); None: a normal replay."""

    def new_optimizer(self) -> torch.optim.Optimizer | None:
        """A fresh optimizer over the model's parameters in its pre-step state (None if not recorded)."""
        return self.optimizer.build(self.model) if self.optimizer is not None else None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        if not self.autocast.get("enabled"):
            return None
        return dtype_from_name(self.autocast.get("dtype") or "float16")

    @property
    def fsdp_dtype(self) -> torch.dtype | None:
        """FSDP2 mixed precision: the low-precision dtype the job's units computed in, else None."""
        return compute_dtype(self.fsdp_units)

    @property
    def scaler_enabled(self) -> bool:
        state = self.scaler_state or {}
        return bool(state) and state.get("enabled", True) is not False and state.get("scale") is not None

    @property
    def loss_scale(self) -> float | None:
        """The job's GradScaler scale at the step; None without an enabled scaler."""
        return float(self.scaler_state["scale"]) if self.scaler_state is not None and self.scaler_enabled else None

    @property
    def sample_refs(self) -> list:
        """Every sample of the step as a SampleRef, in micro-batch order."""

        refs: list[SampleRef] = []
        for mb, ids in enumerate(self.sample_ids):
            refs.extend(SampleRef(mb, i, sid) for i, sid in enumerate(ids))
        return refs


# --------------------------------------------------------------------------------------------
# building sessions
# --------------------------------------------------------------------------------------------
def _check_no_unreplayable(batch: Any, index: int, warnings: list[str]) -> Any:
    from forensics.format import Unreplayable

    def walk(node: Any) -> Any:
        if isinstance(node, Unreplayable):
            return node
        if isinstance(node, dict):
            kept = {}
            for k, v in node.items():
                if isinstance(v, Unreplayable):
                    warnings.append(
                        f"micro-batch {index + 1}: field {v.path} ({v.type_name}) was not stored "
                        "in the dump and is left out of the replayed batch"
                    )
                    continue
                kept[k] = walk(v)
            return kept
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node

    return walk(batch)


def step_micro_batches(manifest: dict) -> int:
    """The job's micro-batches per step: manifest `grad_accum` (0 when absent or odd)."""
    count = manifest.get("grad_accum")
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


def training_script(dump: Any) -> TrainingScript:
    """The training script the dump holds (manifest `recipe.script`; read and checked, never run here)."""
    described = (dump.recipe or {}).get("script") or {}
    if not described or not dump.has_file(spec.MAIN_SCRIPT):
        return TrainingScript()
    return TrainingScript(
        str(described.get("name") or "the training script"),
        dump.read_file(spec.MAIN_SCRIPT, spec.MAX_MAIN_SCRIPT),
        dict(described.get("globals") or {}),
        dict(described.get("unrecorded") or {}),
    )


@gc_paused()  # the model's libraries import and its state loads: forensics.core.gc_pause
def load_session(
    dump: Any,
    *,
    device: str | torch.device | None = None,
    trust: bool = False,
    factory: str | None = None,
    loss: str | None = None,
    sys_path: tuple[str, ...] | list[str] = (),
    weights: bool = True,
    memory_budget: int | None = None,
    factory_kwargs: dict | None = None,
    loss_kwargs: dict | None = None,
    host_cache_bytes: int | None = None,
) -> ReplaySession:
    """Rebuilds model, optimizer, loss and micro-batches of a dump's failing step.

    Args:
        dump: a forensics.format.Dump (open_dump(path, rank=...)).
        device: "cuda:0", "cpu" or None (CUDA when present).
        trust / factory / loss / sys_path: consent for imports (see resolve_recipe); with it, the job's script and
            working directories follow `sys_path` (forensics.replay.load.recipe.job_paths).
        factory_kwargs / loss_kwargs: instead of the recorded ones (None: the recorded ones).
        weights: False for a window replay of a dump without pre-step state (`state_missing`): the model is built
            with its own init and no state or batch is read (the checkpoint and the data recipe supply them).
        memory_budget: bytes the replay may use on `device` (CLI --memory-budget); a state that does not fit them (or,
            without a budget, a CUDA device's free memory) is streamed (`ReplaySession.stream`).
        host_cache_bytes: host memory for a streamed model's blocks (replay/load/host_cache.py); None: half the
            available memory on a GPU, none on the CPU.
    Returns:
        ReplaySession holding the pre-step state on `device`; `warnings` lists environment
        differences and anything left out.
    Raises:
        RecipeError: recipe not consented / not importable / model does not match the weights.
        ReplayError: device not available.
    Example:
        >>> from forensics.format import open_dump  # doctest: +SKIP
        >>> session = load_session(open_dump("dumps/run/step-000000042"), device="cpu")  # doctest: +SKIP
    """
    device = resolve_device(device)
    manifest = dump.manifest
    if dump.state_missing and weights:
        raise DumpError(
            f"the dump holds no pre-step state ({dump.state_missing}). It names the step's samples "
            "(`forensics inspect`); to replay the step, re-execute up to it from an earlier state: the "
            "Guard's host snapshot in the dump (GuardConfig.recording.snapshot_every, with a data recipe; pass "
            "--trust) or --from CHECKPOINT --trust"
        )
    recipe = resolve_recipe(
        dump.recipe,
        trust=trust,
        factory=factory,
        loss=loss,
        sys_path=sys_path,
        script=training_script(dump),
        factory_kwargs=factory_kwargs,
        loss_kwargs=loss_kwargs,
        job_dirs=job_paths(manifest.get("environment"), dump.path),
    )
    precision = dump.precision or {}
    env_warnings = environment_warnings(manifest.get("environment"), device)
    warnings = list(env_warnings) + recipe.notes
    plan = None
    held = weights_held(dump)  # every size the recipe asks for is held to what the dump holds while it is built
    if not weights:
        model = build_model(recipe, on_meta=False, held=held).to(device)
    else:
        built = build_model(recipe, held=held)
        plan = plan_streaming(built, device, memory_budget)
        if plan is not None:  # the cache holds each block as the passes compute it (FSDP2: param_dtype), and where
            # asked for with room to spare also as the dump holds it (the fp32 re-run's, the update check's blocks)
            plan.allocator, plan.allocator_set = prefer_expandable_segments(device)  # before the load's first block
            keep = compute_dtypes(built, plan, parse_units(precision.get("fsdp")))
            computed = cache_bytes(built, plan, keep)
            dump_values = cache_bytes(built, plan, {}, set(keep))
            room = host_cache_capacity(device, computed, host_cache_bytes, dump_values)
            plan.cache = HostBlockCache(room, device, keep, reserve=computed) if room > 0 else None
        try:
            try:
                model = stream_weights(built, _weights(dump, device, plan, built), device, warnings)
            except MetaBuffersError:  # a buffer computed from a parameter at init, and not in the dump
                logger.info("a buffer of the model was derived from meta parameters; building the model normally")
                built = build_model(recipe, on_meta=False, held=held)
                model = stream_weights(built, _weights(dump, device, plan, built), device, warnings)
            if plan is not None:
                settle(plan, model, parse_units(precision.get("fsdp")))
        except BaseException:
            if plan is not None and plan.cache is not None:  # its fill threads stopped, its locked memory let go
                plan.cache.close()
            if plan is not None and plan.allocator_set:
                restore_default_segments()
            raise
    param_dtype = _param_dtype(precision.get("param_dtype"), model)

    snapshot = None
    opt_meta = dump.optimizer_meta()  # tensors are read later, one parameter at a time, if the check runs
    if opt_meta is not None:
        cls = optimizer_class(opt_meta["class"], trust)
        try:
            snapshot = OptimizerSnapshot(
                cls, [dict(g) for g in opt_meta["param_groups"]], DumpOptimizerState(dump, opt_meta["state"], device)
            )
            snapshot.check(model)  # fail now, with a clear error, if state and model do not match
        except (TypeError, ValueError, KeyError, IndexError, RuntimeError, OverflowError) as exc:
            raise DumpCorruptError(
                f"the dump's optimizer state does not rebuild a {cls.__name__} for this model "
                f"({type(exc).__name__}: {str(exc)[:200]})",
                "optimizer.json",
            ) from exc

    batches, ids, rngs, losses = [], [], [], []
    for i in range(dump.num_micro_batches):
        if weights:  # else: rebuilt from the data recipe by the window replay
            batches.append(to_device(_check_no_unreplayable(dump.micro_batch(i), i, warnings), device))
        ids.append(dump.sample_ids(i) or (_positional_ids(batches[-1], dump.step, i) if weights else []))
        rngs.append(dump.rng_state(i))
        meta = dump.micro_batches_meta[i]
        losses.append(meta.get("loss"))
    loss_meta = manifest.get("loss") or {}
    divisor = loss_meta.get("divisor") or manifest.get("grad_accum") or len(batches) or 1
    autocast = dict(precision.get("autocast") or {"enabled": False, "device_type": None, "dtype": None})
    scaler = dump.scaler_state()
    if scaler is None and (precision.get("grad_scaler") or {}).get("enabled"):
        scaler = dict(precision["grad_scaler"])
    return ReplaySession(
        model=model,
        loss_fn=recipe.loss_fn,
        micro_batches=batches,
        device=device,
        sample_ids=ids,
        rng_states=rngs,
        loss_divisor=float(divisor),
        step_micro_batches=step_micro_batches(manifest),
        optimizer=snapshot,
        autocast=autocast,
        scaler_state=scaler,
        scheduler_state=dump.scheduler_state(),
        recorded_losses=losses,
        recorded_grad_norm=loss_meta.get("grad_norm"),
        trigger=dump.trigger,
        param_dtype=param_dtype,
        exception=manifest.get("exception") if isinstance(manifest.get("exception"), dict) else None,
        warnings=warnings,
        source_cuda_device=manifest.get("local_rank"),
        expect_bitwise=_expect_bitwise(env_warnings, device, manifest.get("determinism") or {}),
        capture_environment=dict(manifest.get("environment") or {}),
        pre_step_weights=lambda names=None: dump.iter_model_tensors(device, names=names),
        loaded_weights=weight_fingerprints(model) if weights else None,
        world_size=int(getattr(dump, "world_size", None) or manifest.get("world_size") or 1),
        fsdp_units=parse_units(precision.get("fsdp")),
        stream=plan,
        positional_ids=frozenset(i for i, meta in enumerate(dump.micro_batches_meta) if ids_are_positional(meta)),
    )


def _weights(
    dump: Any, device: torch.device, plan: StreamPlan | None, model: torch.nn.Module
) -> Iterator[tuple[str, torch.Tensor]]:
    """The dump's weights onto `device`; a streamed model's blocks left at rest (replay/load/stream_plan.py)."""
    tensors = dump.iter_model_tensors(device)
    return tensors if plan is None else keep_blocks_at_rest(tensors, plan, model)


def weight_fingerprints(model: torch.nn.Module) -> dict[str, tuple]:
    """{parameter name (tied ones under each name): what changes when its values may have: its storage, dtype,
    shape and in-place version counter}."""
    return {
        name: (p.data_ptr(), p.dtype, tuple(p.shape), tensor_version(p))
        for name, p in model.named_parameters(remove_duplicate=False)
    }


def _expect_bitwise(env_warnings: list[str], device: torch.device, determinism: dict) -> bool:
    """Same machine kind and torch, and kernels that give the same bits twice: CPU, or a GPU job that
    ran with deterministic algorithms (GPU backward kernels otherwise may accumulate with atomics)."""
    if env_warnings:
        return False
    return device.type == "cpu" or bool(determinism.get("deterministic_algorithms"))


def _positional_ids(batch: Any, step: int, index: int) -> list[str]:
    """Ids for a micro-batch recorded without any: its positions (so bisection still covers it)."""
    from forensics.replay.load.samples import BatchSizeError, batch_size

    try:
        size = batch_size(batch)
    except BatchSizeError:
        return []
    return positional_ids(index, size, step)  # forensics/format/sample_ids.py


def _param_dtype(recorded: Any, model: torch.nn.Module) -> torch.dtype:
    if recorded:
        return dtype_from_name(recorded)
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


_META_FILLS = frozenset(
    {
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.erfinv_,
        torch.Tensor.exponential_,
        torch.Tensor.log_normal_,
        torch.Tensor.cauchy_,
        torch.Tensor.geometric_,
        torch.nn.init.normal_,
        torch.nn.init.uniform_,
        torch.nn.init.trunc_normal_,
        torch.nn.init.kaiming_normal_,
        torch.nn.init.kaiming_uniform_,
        torch.nn.init.xavier_normal_,
        torch.nn.init.xavier_uniform_,
        torch.nn.init.orthogonal_,
        torch.nn.init.sparse_,
    }
)
"""In-place fills of a model's init (nn.init's random ones, and the Tensor methods they call: a mode sees the
outermost call only). On a meta tensor they change nothing, and
some of them (normal_, erfinv_ ...) run as torch._refs decompositions that import torch._dynamo (1 s and more on a
small machine, through sympy and torch.distributed.tensor) for values nobody will ever read."""


class _SkipMetaFills(torch.overrides.TorchFunctionMode):
    """Returns a meta tensor's in-place init fill (_META_FILLS) without running it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
        if func in _META_FILLS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no random init work);
    buffers stay real, since the non-persistent ones (masks, rotary tables) are not in any dump."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            put_parameter(module, name, torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]  # for this block only
    try:
        with unfilled(), _SkipMetaFills():  # parameters go to meta at once (a buffer left unset is the model's bug)
            yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


class MetaBuffersError(RuntimeError):
    """stream_weights: the model built on meta derived a buffer from a parameter; build it normally instead."""


def build_model(recipe: Any, on_meta: bool = True, held: WeightsHeld | None = None) -> torch.nn.Module:
    """The recipe's model with its parameters on the meta device (their values come from the dump); a
    factory that cannot build that way is called again normally (and `on_meta=False` builds normally). With `held`
    (what the dump's weights hold), the build stops with BuildTooLargeError as soon as it creates more
    (replay/load/build_budget.py)."""

    def call() -> torch.nn.Module:
        try:
            with build_budget(held, f"that {recipe.factory_path!r} builds"):
                model = recipe.factory(**recipe.factory_kwargs)
        except BuildTooLargeError:
            raise
        except Exception as exc:  # user / recipe code
            raise RecipeError(f"the model factory {recipe.factory_path!r} failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(model, torch.nn.Module):
            raise RecipeError(
                f"the model factory {recipe.factory_path!r} returned {type(model).__name__}, not a torch.nn.Module"
            )
        return model

    if not on_meta:
        return call()
    try:
        with parameters_on_meta():
            return call()
    except BuildTooLargeError:
        raise
    except RecipeError as exc:
        logger.info("the factory does not build with meta parameters (%s); building it normally", exc)
        return call()


def stream_weights(
    model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device, warnings: list[str]
) -> torch.nn.Module:
    """Puts the dump's tensors into the model one at a time, already on `device`, keeping their dtypes and
    the model's tied parameters tied; every parameter must come from the dump.

    Raises:
        RecipeError: a tensor's shape does not fit, or a parameter is not in the dump (another model).
    """
    aliases: dict[str, list[str]] = {}  # first name of a parameter -> every name it has (tied weights)
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(first_name.setdefault(id(param), name), []).append(name)
    canonical = {alias: first for first, names in aliases.items() for alias in names}
    buffers = {name for name, _ in model.named_buffers()}
    loaded: set[str] = set()
    unexpected = []
    for key, tensor in tensors:
        if key in canonical:
            first = canonical[key]
            old = model.get_parameter(first)
            if first in loaded:  # the tied twin of a parameter already put in place: it must fit as well
                _check_fits(key, tensor, old, "parameter")
                continue
            _check_fits(key, tensor, old, "parameter")
            new = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
            for name in aliases[first]:
                owner, _, attr = name.rpartition(".")
                put_parameter(model.get_submodule(owner), attr, new)
            loaded.add(first)
        elif key in buffers:
            owner, _, attr = key.rpartition(".")
            module = model.get_submodule(owner)
            old_buffer = own_buffers(module)[attr]
            if old_buffer is not None:
                _check_fits(key, tensor, old_buffer, "buffer")
            put_buffer(module, attr, tensor)
            loaded.add(key)
        else:
            unexpected.append(key)
    missing = [name for name in aliases if name not in loaded]
    if missing:
        raise RecipeError(
            f"the dump has no weights for parameters {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}: the recipe built a different model"
        )
    if any(t.is_meta for t in model.buffers()):
        raise MetaBuffersError("a buffer not in the dump was computed from meta parameters")
    model.to(device)  # the buffers the dump does not hold (non-persistent ones) follow the weights (a streamed
    # block's placeholders are on the device already: replay/load/stream_plan.py)
    left = sorted(buffers - loaded - {n for n, _ in model.named_buffers() if not _persistent(model, n)})
    if left:
        warnings.append(f"buffers not in the dump, left as built: {left[:5]}")
    if unexpected:
        warnings.append(f"dump entries the model does not have, ignored: {sorted(unexpected)[:5]}")
    return model


def _dtype_family(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating-point"
    return "boolean" if dtype == torch.bool else "integer"


def _check_fits(key: str, tensor: torch.Tensor, old: torch.Tensor, what: str) -> None:
    """A tensor of the dump fits the model's parameter / buffer it replaces: the same shape, and a dtype of the same
    family (a bfloat16 dump of a float32-built model is how the job ran; an integer weight is not).

    Raises:
        RecipeError: naming the tensor, what the dump holds and what the model has.
    """
    if tuple(old.shape) != tuple(tensor.shape):
        raise RecipeError(
            f"the weights in the dump do not fit the model the recipe built: {what} {key} is "
            f"{tuple(tensor.shape)} in the dump, {tuple(old.shape)} in the model"
        )
    if _dtype_family(tensor.dtype) != _dtype_family(old.dtype):
        raise RecipeError(
            f"the dtype of tensor {key} in the dump ({str(tensor.dtype).removeprefix('torch.')}) does "
            f"not match the model's {what} ({str(old.dtype).removeprefix('torch.')}): the dump was "
            "changed, or the recipe builds another model than the job's"
        )


def _persistent(model: torch.nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return is_persistent_buffer(model.get_submodule(owner), attr)


def session_from_objects(
    model: torch.nn.Module,
    micro_batches: list[Any],
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    sample_ids: list[list] | None = None,
    rng_states: list | None = None,
    loss_divisor: float | None = None,
    autocast: dict | None = None,
    scaler_state: dict | None = None,
    device: str | torch.device | None = "cpu",
    trigger: Trigger | Mapping | None = None,
    recorded_losses: list | None = None,
    recorded_grad_norm: float | None = None,
    sample_id_key: str | None = "sample_ids",
) -> ReplaySession:
    """A ReplaySession from live objects (no dump): for tests and in-process replays.

    The model's current weights and the optimizer's current state are the "pre-step" state.
    `sample_ids` default: batch[sample_id_key] when present, else "mb<i+1>/<j>" (micro-batches counted from 1, as the report's text counts them).
    `rng_states` default: captured now for every micro-batch (same state for all).
    `trigger`: a forensics.core.trigger.Trigger or its dict form (default: a non-finite loss).
    """
    from forensics.recipes import default_loss
    from forensics.core.rng import capture_rng

    device = resolve_device(device)
    model = model.to(device)
    batches = [to_device(b, device) for b in micro_batches]
    if sample_ids is None:
        sample_ids = [_ids_of(b, i, sample_id_key) for i, b in enumerate(batches)]
    if loss_fn is None:
        keys = (sample_id_key,) if sample_id_key else ()
        loss_fn = lambda m, b: default_loss(m, b, ignore_keys=keys)  # noqa: E731
    if rng_states is None:
        state = capture_rng()
        rng_states = [state] * len(batches)
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    return ReplaySession(
        model=model,
        loss_fn=loss_fn,
        micro_batches=batches,
        device=device,
        sample_ids=sample_ids,
        rng_states=list(rng_states),
        loss_divisor=float(loss_divisor or len(batches)),
        optimizer=OptimizerSnapshot.from_live(optimizer, model) if optimizer is not None else None,
        autocast=dict(autocast or {"enabled": False, "device_type": None, "dtype": None}),
        scaler_state=scaler_state,
        recorded_losses=list(recorded_losses or [None] * len(batches)),
        recorded_grad_norm=recorded_grad_norm,
        trigger=trigger if isinstance(trigger, Trigger) else Trigger.from_dict(trigger),
        param_dtype=first.dtype if first is not None else torch.float32,
    )


def _ids_of(batch: Any, index: int, key: str | None) -> list:
    if key and isinstance(batch, dict) and key in batch:
        value = batch[key]
        return value.tolist() if isinstance(value, torch.Tensor) else list(value)
    from forensics.replay.load.samples import BatchSizeError, batch_size

    try:
        return positional_ids(index, batch_size(batch))
    except BatchSizeError:
        return []


__all__ = ["ReplaySession", "load_session", "session_from_objects"]
