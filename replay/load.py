"""Load safely: turn a `Dump` (or live objects, for tests) into a `ReplaySession`, importing code only with consent.

A dump names the code that rebuilds its model (`recipe.factory`, `recipe.loss`) and its optimizer
class. Nothing a dump names is imported unless the user agreed to it:

* `trust=True` (CLI `--trust`): import what the dump names;
* `factory="module:fn"` / `loss="module:fn"` (CLI `--factory`, `--loss`): the user names the code;
* built-in recipes (forensics.recipes.BUILTIN_RECIPES: `forensics.recipes:huggingface_model`,
  `forensics.recipes:default_loss`, the demo's models) are forensics' own code (a dump can only
  *pick* one, not change it), so they are used without trust;
* optimizer classes from `torch.optim` are used without trust; any other class needs `trust=True`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from forensics.errors import RecipeError, ReplayError

logger = logging.getLogger(__name__)

DEFAULT_LOSS_PATH = "forensics.recipes:default_loss"
TRUSTED_OPTIMIZER_PREFIX = "torch.optim."
# cuBLAS needs a fixed workspace to be deterministic (CUDA docs, "Results reproducibility");
# ":4096:8" is the larger of the two documented settings.
CUBLAS_WORKSPACE = ":4096:8"

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


# --------------------------------------------------------------------------------------------
# optimizer snapshots: class + groups + state keyed by parameter NAME, rebuilt fresh on demand
# --------------------------------------------------------------------------------------------
@dataclass
class OptimizerSnapshot:
    """The pre-step optimizer, keyed by parameter name (docs/DUMP_FORMAT.md 'Optimizer state').

    `build(model)` returns a NEW optimizer over `model`'s parameters holding a deep copy of the
    pre-step state, so stepping it never changes the snapshot.
    """

    cls: type
    param_groups: list[dict]  # hyper-parameters + "params": [parameter names]
    state: dict[str, dict[str, Any]]  # name -> {key: tensor | number}

    @property
    def class_path(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        named = dict(model.named_parameters())
        groups, saved_groups, saved_state, index = [], [], {}, 0
        for group in self.param_groups:
            names = [n for n in group["params"] if n in named]
            hyper = {k: _hyper_value(v) for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": [named[n] for n in names]})
            ids = []
            for name in names:
                if name in self.state:
                    saved_state[index] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                          for k, v in self.state[name].items()}
                ids.append(index)
                index += 1
            saved_groups.append({**hyper, "params": ids})
        try:
            optimizer = self.cls(groups)
        except TypeError:  # optimizers whose constructor insists on an explicit lr
            optimizer = self.cls(groups, lr=groups[0].get("lr", 1e-3))
        except RuntimeError as exc:  # e.g. fused=True recorded on CUDA, replaying on CPU
            logger.warning("rebuilding %s as recorded failed (%s); retrying without fused/foreach",
                           self.class_path, exc)
            for group in groups + saved_groups:
                group.pop("fused", None)
                group.pop("foreach", None)
            optimizer = self.cls(groups)
        optimizer.load_state_dict({"state": saved_state, "param_groups": saved_groups})
        return optimizer

    @classmethod
    def from_live(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> "OptimizerSnapshot":
        """Snapshot of a live optimizer (deep copy), naming its parameters through `model`."""
        names = {id(p): n for n, p in model.named_parameters()}
        groups, state = [], {}
        for group in optimizer.param_groups:
            hyper = {k: copy.deepcopy(v) for k, v in group.items() if k not in ("params", "param_names")}
            group_names = []
            for p in group["params"]:
                if id(p) not in names:
                    raise ReplayError("the optimizer holds a parameter that is not in the model")
                group_names.append(names[id(p)])
                if p in optimizer.state and optimizer.state[p]:
                    state[names[id(p)]] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                           for k, v in optimizer.state[p].items()}
            groups.append({**hyper, "params": group_names})
        return cls(type(optimizer), groups, state)

    def hyper_of(self, name: str) -> dict:
        """Hyper-parameters of the group holding parameter `name` ({} when none does)."""
        for group in self.param_groups:
            if name in group["params"]:
                return {k: v for k, v in group.items() if k != "params"}
        return {}


def _hyper_value(value: Any) -> Any:
    # JSON turns tuples (Adam's betas) into lists; optimizers expect tuples.
    return tuple(value) if isinstance(value, list) else value


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
    """Per micro-batch, a forensics.rng.RngState captured right before its forward (or None)."""
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
    trigger: dict = field(default_factory=lambda: {"kind": "nonfinite_loss", "value": None, "threshold": None,
                                                   "micro_batch": None})
    param_dtype: torch.dtype = torch.float32
    warnings: list[str] = field(default_factory=list)
    """Things the report should tell the user (environment mismatch, unreplayable batch leaves...)."""
    source_cuda_device: int | None = None
    """The CUDA device index whose RNG state drives this replay (the job's local rank)."""
    expect_bitwise: bool = True
    """Same kind of machine and torch as the capture: replayed numbers should match bit for bit."""
    capture_environment: dict = field(default_factory=dict)
    world_size: int = 1
    """Ranks of the job. With more than one, the recorded grad norm covers every rank's gradients
    (after all-reduce / over all ZeRO shards), so a one-rank replay compares losses only."""

    def new_optimizer(self) -> torch.optim.Optimizer | None:
        """A fresh optimizer over the model's parameters in its pre-step state (None if not recorded)."""
        return self.optimizer.build(self.model) if self.optimizer is not None else None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        if not self.autocast.get("enabled"):
            return None
        return _dtype(self.autocast.get("dtype") or "float16")

    @property
    def scaler_enabled(self) -> bool:
        state = self.scaler_state or {}
        return bool(state) and state.get("enabled", True) is not False and state.get("scale") is not None

    @property
    def sample_refs(self) -> list:
        """Every sample of the step as a SampleRef, in micro-batch order."""
        from replay.execute import SampleRef

        refs = []
        for mb, ids in enumerate(self.sample_ids):
            refs.extend(SampleRef(mb, i, sid) for i, sid in enumerate(ids))
        return refs


def _dtype(name: Any) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ReplayError(f"unknown dtype {name!r} in the dump")
    return value


def to_device(tree: Any, device: torch.device) -> Any:
    """Moves every tensor of a batch tree (dict / list / tuple) to `device`."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(to_device(v, device) for v in tree)
    if isinstance(tree, list):
        return [to_device(v, device) for v in tree]
    return tree


def resolve_device(device: str | torch.device | None) -> torch.device:
    """"cuda:0" / "cpu" / None (CUDA when present, else CPU). A missing GPU is a clear ReplayError."""
    if device is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise ReplayError(f"{device!r} is not a device; pass e.g. --device cuda:0 or --device cpu") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ReplayError(f"device {device} was requested but this machine has no usable CUDA GPU "
                              "(torch.cuda.is_available() is False); pass --device cpu to replay on the CPU")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ReplayError(f"device {device} was requested but only {torch.cuda.device_count()} GPU(s) "
                              "are visible; pass --device cuda:0")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise ReplayError(f"replay runs on 'cpu' or 'cuda:N', not {device}")
    return device


@contextlib.contextmanager
def deterministic_mode(determinism: dict | None = None) -> Iterator[None]:
    """Deterministic kernels for the replay, and the job's TF32 choices; restores everything after.

    Sets torch.use_deterministic_algorithms(True, warn_only=True), cudnn.deterministic, no cudnn
    benchmark, CUBLAS_WORKSPACE_CONFIG (if unset; it only takes effect before cuBLAS starts), and the
    recorded allow_tf32 flags (they change results, so the replay must match the job).
    """
    determinism = determinism or {}
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    env_was = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        if env_was is None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        if isinstance(determinism.get("allow_tf32_matmul"), bool):
            torch.backends.cuda.matmul.allow_tf32 = determinism["allow_tf32_matmul"]
        if isinstance(determinism.get("allow_tf32_cudnn"), bool):
            torch.backends.cudnn.allow_tf32 = determinism["allow_tf32_cudnn"]
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
         torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) = saved[2:]
        if env_was is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def replay_environment(device: torch.device) -> dict:
    """The "replay" part of the report's environment block."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"device": str(device), "torch": torch.__version__, "gpu": gpu}


def environment_warnings(capture_env: dict | None, device: torch.device) -> list[str]:
    """Differences between the capture and the replay machine that can break bitwise fidelity."""
    capture_env = capture_env or {}
    warnings = []
    captured_torch = capture_env.get("torch")
    if captured_torch and captured_torch != torch.__version__:
        warnings.append(f"torch differs: captured with {captured_torch}, replaying with {torch.__version__}")
    gpus = capture_env.get("gpus") or []
    captured_gpu = gpus[0] if gpus and isinstance(gpus[0], dict) else None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        if captured_gpu is None:
            warnings.append(f"captured without a GPU, replaying on {props.name}")
        else:
            if captured_gpu.get("name") and captured_gpu["name"] != props.name:
                warnings.append(f"GPU differs: captured on {captured_gpu['name']}, replaying on {props.name}")
            sm = captured_gpu.get("sm_count")
            if sm is not None and sm != props.multi_processor_count:
                warnings.append(f"SM count differs: captured with {sm}, replaying with "
                                f"{props.multi_processor_count} (kernels may split work differently)")
    elif captured_gpu is not None:
        warnings.append(f"captured on GPU {captured_gpu.get('name')}, replaying on the CPU: "
                        "results cannot be bitwise identical")
    return warnings


# --------------------------------------------------------------------------------------------
# consent and imports
# --------------------------------------------------------------------------------------------
def _split_path(path: str, what: str) -> tuple[str, str]:
    if not isinstance(path, str) or ":" not in path:
        raise RecipeError(f"the {what} {path!r} is not of the form 'package.module:function'")
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise RecipeError(f"the {what} {path!r} is not of the form 'package.module:function'")
    return module, attr


def is_builtin(path: str | None) -> bool:
    """True for recipes that are forensics' own code: the list forensics.recipes.BUILTIN_RECIPES keeps
    (its factories and losses, and the demo's scenario models), never "anything under forensics."."""
    from forensics.recipes import is_builtin as builtin

    return isinstance(path, str) and builtin(path)


def import_object(path: str, what: str = "recipe", sys_path: tuple[str, ...] | list[str] = ()) -> Any:
    """Imports `module:attr.sub` (no consent check: call only for paths the user agreed to)."""
    module_name, attr = _split_path(path, what)
    for entry in reversed(list(sys_path)):
        if entry not in sys.path:
            sys.path.insert(0, entry)  # kept: model code may import lazily at forward time
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 - any import-time failure of user code is a recipe problem
        raise RecipeError(f"cannot import the {what} {path!r}: {type(exc).__name__}: {exc}. "
                          "Check the path, or pass --path DIR (sys_path=) so Python can find the module") from exc
    if not callable(obj):
        raise RecipeError(f"the {what} {path!r} is not callable")
    return obj


def _consented(path: str, what: str, trust: bool, sys_path) -> Any:
    if is_builtin(path) or trust:
        return import_object(path, what, sys_path)
    flag = "--factory" if what == "model factory" else "--loss"
    raise RecipeError(
        f"the dump asks to import the {what} {path!r}, which is not forensics' own code; it was NOT "
        f"imported. If you trust this dump and that code, pass --trust (trust=True), or name the code "
        f"yourself with {flag} module:fn (e.g. {flag} {path}).")


@dataclass
class ResolvedRecipe:
    factory: Callable[..., torch.nn.Module]
    factory_kwargs: dict
    loss_fn: LossFn
    factory_path: str
    loss_path: str


def resolve_recipe(recipe: dict | None, *, trust: bool = False, factory: str | None = None,
                   loss: str | None = None, sys_path: tuple[str, ...] | list[str] = ()) -> ResolvedRecipe:
    """Picks the model factory and loss function, importing only what the user consented to.

    Args:
        recipe: the dump's recipe {"factory", "factory_kwargs", "loss", "loss_kwargs"}.
        trust: import whatever the recipe names.
        factory / loss: "module:fn" named by the user; used instead of the recipe's (always imported).
        sys_path: extra import directories (e.g. the training repo), added in front of sys.path.
    Returns:
        ResolvedRecipe with callables; the loss takes (model, batch).
    Raises:
        RecipeError: nothing usable, not consented (message shows the path and says --trust /
            --factory), or the import failed.
    """
    recipe = recipe or {}
    factory_path = factory or recipe.get("factory")
    if not factory_path:
        raise RecipeError("the dump has no model recipe; pass --factory module:fn, a function that "
                          "returns the model (weights are loaded from the dump afterwards)")
    if factory:
        factory_fn = import_object(factory, "model factory", sys_path)
    else:
        factory_fn = _consented(factory_path, "model factory", trust, sys_path)
    loss_path = loss or recipe.get("loss") or DEFAULT_LOSS_PATH
    if not loss and "loss" in recipe and not recipe.get("loss"):
        logger.warning("the job's loss function could not be named in the dump (a lambda or closure?); "
                       "replaying with %s. Pass --loss module:fn to use the job's own.", DEFAULT_LOSS_PATH)
    if loss:
        loss_callable = import_object(loss, "loss function", sys_path)
    else:
        loss_callable = _consented(loss_path, "loss function", trust, sys_path)
    loss_kwargs = dict(recipe.get("loss_kwargs") or {}) if not loss else {}
    loss_fn: LossFn = (lambda model, batch: loss_callable(model, batch, **loss_kwargs)) if loss_kwargs \
        else loss_callable
    kwargs = dict(recipe.get("factory_kwargs") or {}) if not factory or factory == recipe.get("factory") else {}
    return ResolvedRecipe(factory_fn, kwargs, loss_fn, factory_path, loss_path)


def optimizer_class(path: str, trust: bool) -> type:
    """The optimizer class named `path` ("torch.optim.adamw.AdamW"); non-torch classes need trust."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise RecipeError(f"optimizer class {path!r} is not a dotted path")
    if not (path.startswith(TRUSTED_OPTIMIZER_PREFIX) or trust):
        raise RecipeError(f"the dump's optimizer is {path!r}, which is not a torch.optim class; it was NOT "
                          "imported. Pass --trust to import it (or replay without optimizer state).")
    cls = import_object(f"{module_name}:{name}", "optimizer class")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise RecipeError(f"{path!r} is not a torch.optim.Optimizer subclass")
    return cls


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
                    warnings.append(f"micro-batch {index + 1}: field {v.path} ({v.type_name}) was not stored "
                                    "in the dump and is left out of the replayed batch")
                    continue
                kept[k] = walk(v)
            return kept
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node

    return walk(batch)


def load_session(dump: Any, *, device: str | torch.device | None = None, trust: bool = False,
                 factory: str | None = None, loss: str | None = None,
                 sys_path: tuple[str, ...] | list[str] = ()) -> ReplaySession:
    """Rebuilds model, optimizer, loss and micro-batches of a dump's failing step.

    Args:
        dump: a forensics.format.Dump (open_dump(path, rank=...)).
        device: "cuda:0", "cpu" or None (CUDA when present).
        trust / factory / loss / sys_path: consent for imports (see resolve_recipe).
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
    recipe = resolve_recipe(dump.recipe, trust=trust, factory=factory, loss=loss, sys_path=sys_path)
    try:
        model = recipe.factory(**recipe.factory_kwargs)
    except Exception as exc:  # noqa: BLE001 - user / recipe code
        raise RecipeError(f"the model factory {recipe.factory_path!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise RecipeError(f"the model factory {recipe.factory_path!r} returned {type(model).__name__}, "
                          "not a torch.nn.Module")
    state = dump.model_state()
    precision = dump.precision or {}
    param_dtype = _param_dtype(precision.get("param_dtype"), state)
    model = model.to(device)
    _match_dtypes(model, state)
    env_warnings = environment_warnings(manifest.get("environment"), device)
    warnings = list(env_warnings)
    _load_weights(model, state, warnings)

    snapshot = None
    opt_state = dump.optimizer_state()
    if opt_state is not None:
        snapshot = OptimizerSnapshot(optimizer_class(opt_state["class"], trust),
                                     [dict(g) for g in opt_state["param_groups"]], opt_state["state"])
        snapshot.build(model)  # fail now, with a clear error, if state and model do not match

    batches, ids, rngs, losses = [], [], [], []
    for i in range(dump.num_micro_batches):
        batches.append(to_device(_check_no_unreplayable(dump.micro_batch(i), i, warnings), device))
        ids.append(dump.sample_ids(i) or _positional_ids(batches[-1], dump.step, i))
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
        model=model, loss_fn=recipe.loss_fn, micro_batches=batches, device=device, sample_ids=ids,
        rng_states=rngs, loss_divisor=float(divisor), optimizer=snapshot, autocast=autocast,
        scaler_state=scaler, scheduler_state=dump.scheduler_state(), recorded_losses=losses,
        recorded_grad_norm=loss_meta.get("grad_norm"), trigger=dict(dump.trigger), param_dtype=param_dtype,
        warnings=warnings, source_cuda_device=manifest.get("local_rank"),
        expect_bitwise=_expect_bitwise(env_warnings, device, manifest.get("determinism") or {}),
        capture_environment=dict(manifest.get("environment") or {}),
        world_size=int(getattr(dump, "world_size", None) or manifest.get("world_size") or 1))


def _expect_bitwise(env_warnings: list[str], device: torch.device, determinism: dict) -> bool:
    """Same machine kind and torch, and kernels that give the same bits twice: CPU, or a GPU job that
    ran with deterministic algorithms (GPU backward kernels otherwise may accumulate with atomics)."""
    if env_warnings:
        return False
    return device.type == "cpu" or bool(determinism.get("deterministic_algorithms"))


def _positional_ids(batch: Any, step: int, index: int) -> list[str]:
    """Ids for a micro-batch recorded without any: its positions (so bisection still covers it)."""
    from replay.samples import BatchSizeError, batch_size

    try:
        size = batch_size(batch)
    except BatchSizeError:
        return []
    return [f"step{step}/mb{index}/{j}" for j in range(size)]


def _match_dtypes(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Gives every floating parameter / buffer the dtype its dump tensor has (mixed-dtype models kept)."""
    live = dict(model.named_parameters())
    live.update(dict(model.named_buffers()))
    for name, saved in state.items():
        tensor = live.get(name)
        if tensor is not None and tensor.is_floating_point() and saved.is_floating_point() \
                and tensor.dtype != saved.dtype:
            tensor.data = tensor.data.to(saved.dtype)


def _param_dtype(recorded: Any, state: dict[str, torch.Tensor]) -> torch.dtype:
    if recorded:
        return _dtype(recorded)
    for tensor in state.values():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], warnings: list[str]) -> None:
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatch: the recipe built a different model
        raise RecipeError(f"the weights in the dump do not fit the model the recipe built: {exc}") from exc
    param_names = {n for n, _ in model.named_parameters()}
    missing_params = [k for k in result.missing_keys if k in param_names]
    if missing_params:
        raise RecipeError(f"the dump has no weights for parameters {missing_params[:5]}"
                          f"{' ...' if len(missing_params) > 5 else ''}: the recipe built a different model")
    if result.missing_keys:
        warnings.append(f"buffers not in the dump, left as built: {sorted(result.missing_keys)[:5]}")
    if result.unexpected_keys:
        warnings.append(f"dump entries the model does not have, ignored: {sorted(result.unexpected_keys)[:5]}")


def session_from_objects(model: torch.nn.Module, micro_batches: list[Any], loss_fn: LossFn | None = None,
                         optimizer: torch.optim.Optimizer | None = None, *, sample_ids: list[list] | None = None,
                         rng_states: list | None = None, loss_divisor: float | None = None,
                         autocast: dict | None = None, scaler_state: dict | None = None,
                         device: str | torch.device | None = "cpu", trigger: dict | None = None,
                         recorded_losses: list | None = None, recorded_grad_norm: float | None = None,
                         sample_id_key: str | None = "sample_ids") -> ReplaySession:
    """A ReplaySession from live objects (no dump): for tests and in-process replays.

    The model's current weights and the optimizer's current state are the "pre-step" state.
    `sample_ids` default: batch[sample_id_key] when present, else "mb<i>/<j>".
    `rng_states` default: captured now for every micro-batch (same state for all).
    """
    from forensics.recipes import default_loss
    from forensics.rng import capture_rng

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
        model=model, loss_fn=loss_fn, micro_batches=batches, device=device, sample_ids=sample_ids,
        rng_states=list(rng_states), loss_divisor=float(loss_divisor or len(batches)),
        optimizer=OptimizerSnapshot.from_live(optimizer, model) if optimizer is not None else None,
        autocast=dict(autocast or {"enabled": False, "device_type": None, "dtype": None}),
        scaler_state=scaler_state, recorded_losses=list(recorded_losses or [None] * len(batches)),
        recorded_grad_norm=recorded_grad_norm,
        trigger=dict(trigger or {"kind": "nonfinite_loss", "value": None, "threshold": None, "micro_batch": None}),
        param_dtype=first.dtype if first is not None else torch.float32)


def _ids_of(batch: Any, index: int, key: str | None) -> list:
    if key and isinstance(batch, dict) and key in batch:
        value = batch[key]
        return value.tolist() if isinstance(value, torch.Tensor) else list(value)
    from replay.samples import BatchSizeError, batch_size

    try:
        return [f"mb{index}/{j}" for j in range(batch_size(batch))]
    except BatchSizeError:
        return []


def finite_float(value: Any) -> float | None:
    """float(value) or None; keeps nan / inf (the report encodes them)."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


__all__ = ["ReplaySession", "OptimizerSnapshot", "ResolvedRecipe", "load_session", "session_from_objects",
           "resolve_recipe", "resolve_device", "deterministic_mode", "environment_warnings", "is_builtin",
           "import_object", "optimizer_class", "to_device"]
