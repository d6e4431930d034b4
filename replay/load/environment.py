"""The replay machine: device choice, deterministic kernels, and how it differs from the capture machine.

`resolve_device` turns "cuda:0" / "cpu" / None into a usable device (clear errors otherwise);
`deterministic_mode` sets deterministic kernels and the job's TF32 flags for the replay;
`environment_warnings` lists capture-vs-replay differences that break bitwise fidelity.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Iterator

import torch

from forensics.core.errors import ReplayError
from forensics.format.batch_tree import map_tensors
from forensics.core.thirdparty import deterministic_setter

logger = logging.getLogger(__name__)

# cuBLAS needs a fixed workspace to be deterministic (CUDA docs, "Results reproducibility");
# ":4096:8" is the larger of the two documented settings.
CUBLAS_WORKSPACE = ":4096:8"


def dtype_from_name(name: Any) -> torch.dtype:
    """torch.bfloat16 from "bfloat16" / "torch.bfloat16" (a dtype passes through); ReplayError otherwise."""
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ReplayError(f"unknown dtype {name!r} in the dump")
    return value


def to_device(tree: Any, device: torch.device) -> Any:
    """Moves every tensor of a batch tree to `device` (forensics.format.batch_tree.map_tensors: containers keep their
    type)."""
    return map_tensors(tree, lambda t: t.to(device))


def resolve_device(device: str | torch.device | None) -> torch.device:
    """ "cuda:0" / "cpu" / None (CUDA when present, else CPU). A missing GPU is a clear ReplayError."""
    if device is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise ReplayError(f"{device!r} is not a device; pass e.g. --device cuda:0 or --device cpu") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ReplayError(
                f"device {device} was requested but this machine has no usable CUDA GPU "
                "(torch.cuda.is_available() is False); pass --device cpu to replay on the CPU"
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ReplayError(
                f"device {device} was requested but only {torch.cuda.device_count()} GPU(s) "
                "are visible; pass --device cuda:0"
            )
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise ReplayError(f"replay runs on 'cpu' or 'cuda:N', not {device}")
    return device


def _deterministic_algorithms(mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms without its import of torch._inductor (2-4 s, most of a small replay's
    start-up, for a flag only compiled code reads): inductor's flag is set too once something imported it."""
    setter = deterministic_setter()
    if setter is None or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        setter(mode, warn_only=warn_only)


# The determinism block's switches set back as the job had them: torch.backends.cuda.matmul attributes, and SDPA's
# backends through torch.backends.cuda.enable_<key>(bool) / <key>_enabled().
_MATMUL_FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
_SDP_FLAGS = ("flash_sdp", "mem_efficient_sdp", "math_sdp", "cudnn_sdp")


def _sdp(key: str, value: bool | None = None) -> bool | None:
    """SDPA backend switch `key`: read (value None) or set; None where this torch has no such switch."""
    read = getattr(torch.backends.cuda, f"{key}_enabled", None)
    if value is not None:
        enable = getattr(torch.backends.cuda, f"enable_{key}", None)
        if callable(enable):
            enable(value)
    return bool(read()) if callable(read) else None


def job_settings(determinism: dict) -> dict[str, Any]:
    """The switches the replay sets to the job's (those recorded, of a known type): `flash_sdp` ... `cudnn_sdp`,
    the reduced-precision reductions, `float32_matmul_precision`, `cudnn_enabled`. A job in the strict deterministic
    mode (warn_only False) never ran cuDNN's attention (PyTorch leaves it out of SDPA's choice there), while the
    replay's warn-only mode would pick it: cudnn_sdp is off for such a job's replay."""
    settings: dict[str, Any] = {
        k: determinism[k] for k in (*_MATMUL_FLAGS, *_SDP_FLAGS) if isinstance(determinism.get(k), bool)
    }
    if determinism.get("float32_matmul_precision") in ("highest", "high", "medium"):
        settings["float32_matmul_precision"] = determinism["float32_matmul_precision"]
    if isinstance(determinism.get("cudnn_enabled"), bool):
        settings["cudnn_enabled"] = determinism["cudnn_enabled"]
    if determinism.get("deterministic_algorithms") is True and determinism.get("deterministic_warn_only") is False:
        settings["cudnn_sdp"] = False
    return settings


def _current(key: str) -> Any:
    if key in _SDP_FLAGS:
        return _sdp(key)
    if key == "float32_matmul_precision":
        return torch.get_float32_matmul_precision()
    if key == "cudnn_enabled":
        return torch.backends.cudnn.enabled
    return getattr(torch.backends.cuda.matmul, key, None)


def _apply(key: str, value: Any) -> None:
    try:
        _set(key, value)
    except (RuntimeError, TypeError, ValueError) as exc:  # a torch that refuses a mix of its TF32 APIs
        logger.warning("forensics: could not set %s=%r for the replay (%s): its bits may differ", key, value, exc)


def _set(key: str, value: Any) -> None:
    if key in _SDP_FLAGS:
        _sdp(key, value)
    elif key == "float32_matmul_precision":
        torch.set_float32_matmul_precision(value)
    elif key == "cudnn_enabled":
        torch.backends.cudnn.enabled = value
    elif hasattr(torch.backends.cuda.matmul, key):
        setattr(torch.backends.cuda.matmul, key, value)


@contextlib.contextmanager
def deterministic_mode(determinism: dict | None = None) -> Iterator[None]:
    """Deterministic kernels for the replay, and the job's kernel and precision choices; restores everything after.

    Sets torch.use_deterministic_algorithms(True, warn_only=True), cudnn.deterministic, no cudnn
    benchmark, CUBLAS_WORKSPACE_CONFIG (if unset; it only takes effect before cuBLAS starts), and the
    recorded allow_tf32 flags, SDPA backends, reduced-precision reductions, float32 matmul precision and cuDNN switch
    (`job_settings`: they change which kernel runs or its results, so the replay must match the job).
    """
    determinism = determinism or {}
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    settings = job_settings(determinism)
    kept = {key: _current(key) for key in settings}
    env_was = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        if env_was is None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        _deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        if isinstance(determinism.get("allow_tf32_matmul"), bool):
            torch.backends.cuda.matmul.allow_tf32 = determinism["allow_tf32_matmul"]
        if isinstance(determinism.get("allow_tf32_cudnn"), bool):
            torch.backends.cudnn.allow_tf32 = determinism["allow_tf32_cudnn"]
        for key, value in settings.items():
            _apply(key, value)
        yield
    finally:
        _deterministic_algorithms(saved[0], warn_only=saved[1])
        (
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
        ) = saved[2:]
        for key, value in kept.items():
            if value is not None:
                _apply(key, value)
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
                warnings.append(
                    f"SM count differs: captured with {sm}, replaying with "
                    f"{props.multi_processor_count} (kernels may split work differently)"
                )
    elif captured_gpu is not None:
        warnings.append(
            f"captured on GPU {captured_gpu.get('name')}, replaying on the CPU: results cannot be bitwise identical"
        )
    return warnings


__all__ = [
    "dtype_from_name",
    "to_device",
    "resolve_device",
    "deterministic_mode",
    "job_settings",
    "replay_environment",
    "environment_warnings",
    "CUBLAS_WORKSPACE",
]
