"""Built-in replay recipes: how to rebuild a model and compute its loss offline.

These are forensics' own code, so replay may use them without `--trust`; a dump can only name them,
never change what they do. Anything else a dump names is imported only with the user's consent.
"""

from __future__ import annotations

import importlib.util
from typing import Any, TypeVar

import torch

from forensics.core import thirdparty
from forensics.core.errors import RecipeError
from forensics.report.wording import clean

BUILTIN_PREFIX = "forensics.recipes:"
DEFAULT_LOSS = BUILTIN_PREFIX + "default_loss"
HUGGINGFACE_FACTORY = BUILTIN_PREFIX + "huggingface_model"
TORCHTITAN_FACTORY = BUILTIN_PREFIX + "torchtitan_model"
TORCHTITAN_LOSS = BUILTIN_PREFIX + "torchtitan_loss"

# Import paths replay may resolve without --trust: forensics' own factories and losses, listed one by
# one (never "anything under forensics.", which would let a dump call arbitrary functions of ours).
# A static list: what is allowed never depends on which modules happen to be imported.
# tests/forensics/test_demo.py checks that the demo entries name real functions of forensics.demo.models.
DEMO_MODELS = "forensics.demo.models"
DEMO_MODEL_CODE = ("forensics.demo.gpt2",)
"""Modules the demo's factories build their models from: model code, like the recipes' own modules (an exception
raised there is the model's, not a bug of forensics: replay/load/user_code.py)."""
BUILTIN_RECIPES: frozenset[str] = frozenset(
    {
        DEFAULT_LOSS,
        HUGGINGFACE_FACTORY,
        TORCHTITAN_FACTORY,
        TORCHTITAN_LOSS,
        *(
            f"{DEMO_MODELS}:{name}"
            for name in ("adapter_lm", "sensor_classifier", "gated_lm", "tiny_gpt2", "quality_weighted_loss")
        ),
    }
)


def is_builtin(import_path: str | None) -> bool:
    """True when `import_path` ('module:function') is one of forensics' own recipes."""
    return isinstance(import_path, str) and import_path in BUILTIN_RECIPES


# What a recorded Hugging Face config may select, by rule: only implementations built into torch and transformers
# themselves. transformers reads anything else as code from elsewhere — "org/repo[:kernel]" a kernel downloaded from
# the Hugging Face Hub and run, "sonicmoe" / "deepgemm" experts loading kernels-community kernels — which a dump's
# settings must never make a replay fetch or load. A name this list lacks is refused with the reason, not tried.
BUILTIN_ATTENTION = frozenset({"eager", "sdpa", "flex_attention", "paged|eager"})
"""transformers' AttentionInterface: eager attention in Python, torch's scaled_dot_product_attention and flex_attention."""
FLASH_ATTENTION_PACKAGES = {
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn_interface",
    "flash_attention_4": "flash_attn",
}
"""flash_attention_N runs the installed flash-attn package; without it transformers falls back to a Hub kernel
(kernels-community/flash-attn2 ...) when the `kernels` package is installed: allowed only with the package here."""
BUILTIN_EXPERTS = frozenset({"eager", "batched_mm", "grouped_mm"})
"""transformers' ExpertsInterface implementations written in torch; the others load Hub kernels."""
ATTN_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")
EXPERTS_KEYS = ("experts_implementation", "_experts_implementation", "_experts_implementation_internal")
# Config keys through which a config can ask transformers to load code that is not part of transformers.
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")
MAX_CONFIG_DEPTH = 8  # configs nest a few levels (text_config.rope_scaling ...); deeper is not a transformers config


def check_no_remote_code(config: Any, where: str = "config", depth: int = 0) -> None:
    """Raises RecipeError when a recorded Hugging Face config asks for code from outside transformers and torch: an
    attention or experts implementation that is not built in (a Hub kernel), remote code (`auto_map`,
    `trust_remote_code`), at any level of nesting."""
    if depth > MAX_CONFIG_DEPTH:
        raise RecipeError(
            f"the dump's model {where} nests deeper than {MAX_CONFIG_DEPTH} levels; it is not a transformers config"
        )
    if isinstance(config, dict):
        for key, value in config.items():
            field = f"{where}.{clean(str(key), 60)}"
            if key in REMOTE_CODE_KEYS and value:
                raise RecipeError(
                    f"the dump's model {field} asks transformers to load code from outside the package "
                    "(remote code); forensics' built-in recipe never does. Replay with your own "
                    "--factory module:fn if you need that model class"
                )
            if key in ATTN_KEYS and value is not None:
                check_attn_implementation(value, field)
            if key in EXPERTS_KEYS and value is not None:
                check_experts_implementation(value, field)
            check_no_remote_code(value, field, depth + 1)
    elif isinstance(config, list):
        for item in config:
            check_no_remote_code(item, where, depth + 1)


def _per_sub_config(value: Any, where: str, check: Any) -> bool:
    """transformers 5 takes an implementation per sub-config (`{"": "sdpa", "text_config": "eager"}`): each checked."""
    if not isinstance(value, dict) or len(value) > 64:
        return False
    for sub, implementation in value.items():
        check(implementation, f"{where}.{clean(str(sub), 60)}" if sub else where)
    return True


def check_attn_implementation(value: Any, where: str = "attn_implementation") -> None:
    """An attention implementation built into torch / transformers (BUILTIN_ATTENTION), or flash_attention_N with its
    package installed here; never a Hub kernel ("org/repo:kernel"), nor a fallback to one, nor anything else."""
    if value is None or _per_sub_config(value, where, check_attn_implementation):
        return
    if isinstance(value, str) and value in BUILTIN_ATTENTION:
        return
    package = FLASH_ATTENTION_PACKAGES.get(value) if isinstance(value, str) else None
    if package is not None:
        if importlib.util.find_spec(package) is not None:
            return
        why = (
            f"the {package} package is not installed here, so transformers would fall back to a flash-attention "
            "kernel downloaded from the Hugging Face Hub (kernels-community/...)"
        )
    elif isinstance(value, str) and ("/" in value or ":" in value):
        why = "a name like 'org/repo' makes transformers download and run a kernel from the Hugging Face Hub"
    else:
        why = "it is not an implementation built into torch or transformers (eager, sdpa, flex_attention)"
    raise RecipeError(
        f"the dump's {where} {clean(repr(value), 80)} is refused: {why}, which a replay never does. Pass "
        '--factory-kwargs \'{..."attn_implementation": "sdpa"}\' (or "eager"), or your own --factory'
    )


def check_experts_implementation(value: Any, where: str = "experts_implementation") -> None:
    """A mixture-of-experts implementation written in torch (BUILTIN_EXPERTS); "sonicmoe", "deepgemm" and any other
    load kernels from the Hugging Face Hub."""
    if value is None or _per_sub_config(value, where, check_experts_implementation):
        return
    if isinstance(value, str) and value in BUILTIN_EXPERTS:
        return
    raise RecipeError(
        f"the dump's {where} {clean(repr(value), 80)} is refused: only the experts implementations written in torch "
        f"({', '.join(sorted(BUILTIN_EXPERTS))}) are built without code from elsewhere; others load a kernel from the "
        "Hugging Face Hub, which a replay never does. Pass --factory-kwargs with the config's experts_implementation "
        'set to "grouped_mm" (or "eager"), or your own --factory'
    )


def _refuse_hub_kernel(what: str) -> Any:
    raise RecipeError(
        f"building the dump's model asked transformers to load a kernel from the Hugging Face Hub ({clean(what, 120)});"
        " a replay never loads code from elsewhere. Replay with your own --factory if you need that kernel"
    )


def huggingface_model(
    architecture: str, config: dict, attn_implementation: str | None = None, dtype: str | None = None
) -> torch.nn.Module:
    """Builds a transformers model of class `architecture` from a config dict (random init, no download).

    Only classes exported by the `transformers` package itself are accepted, and nothing from elsewhere is ever
    loaded (no remote code, no Hub kernels: check_no_remote_code), so a dump cannot make this import or run anything
    else.
    """
    import transformers

    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise RecipeError("the dump's Hugging Face recipe has no config with a model_type")
    check_no_remote_code(config)
    if attn_implementation is not None:
        check_attn_implementation(attn_implementation)
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if dtype is not None and not isinstance(torch_dtype, torch.dtype):
        raise RecipeError(f"the dump's model dtype {clean(repr(dtype), 40)} is not a torch dtype")
    model_class = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise RecipeError(f"{clean(repr(architecture), 80)} is not a transformers model class")
    config = {k: v for k, v in config.items() if not (k == "loss_type" and v is None)}  # avoids a warning
    model_type = config.pop("model_type")
    with thirdparty.hub_kernels_refused(_refuse_hub_kernel):  # whatever else would fetch a kernel while it is built
        hf_config = transformers.AutoConfig.for_model(model_type, **config)
        if attn_implementation:
            thirdparty.set_attn_implementation(hf_config, attn_implementation)
        model = name_default_loss(model_class(hf_config))
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    return model


M = TypeVar("M", bound=torch.nn.Module)


def name_default_loss(model: M) -> M:
    """`model`, its Hugging Face loss named where transformers would fall back to it with a warning.

    transformers picks a model's loss from its class name; for one that names none (GPT2LMHeadModel) it warns
    "`loss_type=None` was set in the config but it is unrecognized" at the first loss and uses `ForCausalLM`.
    Naming that same loss changes nothing but the warning, which would otherwise look like forensics' own.
    """
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"  # type: ignore[assignment]  # a transformers attribute, not a submodule
    return model


def default_loss(model: torch.nn.Module, batch: Any, ignore_keys: tuple | list = ()) -> torch.Tensor:
    """`model(**batch).loss` for dict batches (keys in `ignore_keys`, e.g. sample ids, left out);
    the output itself when the model returns a scalar tensor."""
    from forensics.format.batch_tree import Unreplayable

    try:
        if isinstance(batch, dict):
            output = model(
                **{k: v for k, v in batch.items() if k not in ignore_keys and not isinstance(v, Unreplayable)}
            )
        elif isinstance(batch, (list, tuple)):
            output = model(*batch)
        else:
            output = model(batch)
    except TypeError as exc:
        if "argument" not in str(exc):  # a TypeError inside the forward is the model's own
            raise
        raise RecipeError(
            f"the default loss calls the model with the batch, and {type(model).__name__} does not "
            f"take it ({exc}); pass --loss module:fn, a function (model, batch) -> loss "
            "(or record loss_fn= in the job)"
        ) from exc
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None:
        raise RecipeError(
            "the model output has no .loss and is not a scalar; pass a loss function "
            "(loss_fn= in capture, --loss module:fn in replay)"
        )
    return loss


def model_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` swaps in a generated `FSDP<Name>` subclass, skipped here (its
    module is torch.distributed's, or `abc` when the model's class has an ABC metaclass, as torchtitan's do)."""
    for cls in type(model).__mro__:
        generated = any(base.__module__.startswith("torch.distributed.") for base in cls.__bases__)
        if not cls.__module__.startswith("torch.distributed.") and not generated:
            return cls
    return type(model)


def huggingface_recipe(model: torch.nn.Module) -> dict | None:
    """The recipe for a transformers model (from model.config), or None for any other model."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict) or not hasattr(config, "model_type"):
        return None
    kwargs: dict[str, Any] = {"architecture": model_class(model).__name__, "config": to_dict()}
    attn = thirdparty.attn_implementation(config)
    if attn:
        kwargs["attn_implementation"] = attn
    return {"factory": HUGGINGFACE_FACTORY, "factory_kwargs": kwargs, "source": "auto:huggingface"}


# torchtitan's model families (torchtitan.models._supported_models in 0.2.0): the only modules torchtitan_model imports.
TORCHTITAN_MODELS = frozenset({"deepseek_v3", "llama3", "llama3_ft", "llama4", "qwen3"})
TORCHTITAN_ARG_TYPES = (int, float, str, bool, type(None))


def torchtitan_model(model: str, model_args: dict) -> torch.nn.Module:
    """Builds torchtitan's model of family `model` (llama3, qwen3 ...) from its model args (random init, no download).

    `model` must be one of torchtitan's own families (TORCHTITAN_MODELS): its train spec names the model class and
    the model-args dataclass; `model_args` holds that dataclass's fields (numbers, strings, booleans; a nested
    dataclass as a dict of those), as the job ran them (after `update_from_config`). Nothing else is imported.
    """
    import dataclasses
    import importlib

    if not (isinstance(model, str) and model in TORCHTITAN_MODELS):
        raise RecipeError(
            f"{clean(repr(model), 60)} is not one of torchtitan's model families "
            f"({', '.join(sorted(TORCHTITAN_MODELS))}); pass your own --factory"
        )
    if not isinstance(model_args, dict):
        raise RecipeError("the dump's torchtitan recipe has no model_args dict")
    spec = importlib.import_module(f"torchtitan.models.{model}").get_train_spec()
    args_type = type(next(iter(spec.model_args.values())))
    defaults = args_type()
    kwargs: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(args_type)}
    for name, value in model_args.items():
        if name not in fields:
            raise RecipeError(f"torchtitan's {args_type.__name__} has no field {clean(repr(name), 60)}")
        default = getattr(defaults, name)
        if dataclasses.is_dataclass(default) and not isinstance(default, type) and isinstance(value, dict):
            nested = {f.name for f in dataclasses.fields(default)}
            if not set(value) <= nested or not all(isinstance(v, TORCHTITAN_ARG_TYPES) for v in value.values()):
                raise RecipeError(f"the dump's torchtitan model_args.{name} is not a {type(default).__name__}")
            value = dataclasses.replace(default, **value)
        elif not isinstance(value, TORCHTITAN_ARG_TYPES):
            raise RecipeError(f"the dump's torchtitan model_args.{name} is not a number, string or boolean")
        kwargs[name] = value
    built = spec.model_cls(dataclasses.replace(defaults, **kwargs))
    with torch.no_grad():
        built.init_weights()  # the buffers torchtitan computes at init (rotary frequencies); weights come from the dump
    return built


def torchtitan_recipe(model: torch.nn.Module, model_args: Any) -> dict | None:
    """The recipe of a model built by torchtitan's trainer from `model_args`, or None when its class is not one of
    torchtitan's own families (then name a factory: GuardConfig.dumping.recipe, or --factory at replay)."""
    import dataclasses

    cls = model_class(model)
    parts = cls.__module__.split(".")
    family = parts[2] if len(parts) > 2 and parts[:2] == ["torchtitan", "models"] else None
    if family not in TORCHTITAN_MODELS or not dataclasses.is_dataclass(model_args) or isinstance(model_args, type):
        return None
    return {
        "factory": TORCHTITAN_FACTORY,
        "loss": TORCHTITAN_LOSS,
        "loss_kwargs": {},
        "factory_kwargs": {"model": family, "model_args": dataclasses.asdict(model_args)},
    }


def torchtitan_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The loss of torchtitan's trainer for one recorded micro-batch: `cross_entropy_loss(model(input, **extra),
    labels)`, torchtitan's own (before its division by the accumulation count). The batch is what
    forensics.capture.integrations.torchtitan records: torchtitan's input dict plus `labels`."""
    from torchtitan.components.loss import cross_entropy_loss

    from forensics.format.batch_tree import Unreplayable

    extra = {k: v for k, v in batch.items() if k not in ("input", "labels") and not isinstance(v, Unreplayable)}
    return cross_entropy_loss(model(batch["input"], **extra), batch["labels"])
