"""What the job ran on and with: versions, GPUs, host, command line, git commit, determinism flags."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from functools import lru_cache
from importlib import metadata

import torch

from forensics.core.redact import redacted_argv

KEY_PACKAGES = (
    "forensics",
    "transformers",
    "accelerate",
    "deepspeed",
    "safetensors",
    "numpy",
    "pytorch-lightning",
    "lightning",
)


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=2, cwd=os.getcwd()
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def _packages() -> dict[str, str]:
    found = {}
    for name in KEY_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _gpu_descriptions() -> list[dict]:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": props.name,
                "sm_count": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}",
                "memory_bytes": props.total_memory,
            }
        )
    return gpus


def script_dir() -> str | None:
    """The directory of the script the job runs (`python train.py`, torchrun): Python put it first on the job's
    sys.path, so replay puts it there too (replay/load/session.py). None for `python -c` and interactive sessions."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.dirname(os.path.abspath(path)) if isinstance(path, str) and path else None


@lru_cache(maxsize=1)
def _static_environment() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "hostname": socket.gethostname(),
        "argv": redacted_argv(sys.argv),
        "cwd": os.getcwd(),
        "script_dir": script_dir(),
        "git_commit": _git_commit(),
        "packages": _packages(),
    }


def environment() -> dict:
    """The environment section of the manifest (computed once per process, GPUs read at call time)."""
    return {**_static_environment(), "gpus": _gpu_descriptions()}


def determinism_flags() -> dict:
    """Every process-wide setting that picks a kernel or its precision, so the replay computes with the job's: the
    deterministic mode (its warn-only flag too: a strict mode excludes cuDNN's attention from SDPA's choice), the
    SDPA backends allowed, the reduced-precision reductions and TF32 choices of matmuls, cuDNN's switches."""
    matmul = torch.backends.cuda.matmul
    flags: dict = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_enabled": torch.backends.cudnn.enabled,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "allow_tf32_matmul": matmul.allow_tf32,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    for key in SETTABLE_FLAGS:
        value = getattr(matmul, key, None) if key.startswith("allow_") else _sdp_enabled(key)
        if isinstance(value, bool):
            flags[key] = value
    return flags


SETTABLE_FLAGS = (
    "allow_bf16_reduced_precision_reduction",
    "allow_fp16_reduced_precision_reduction",
    "flash_sdp",
    "mem_efficient_sdp",
    "math_sdp",
    "cudnn_sdp",
)
"""The determinism block's keys beyond the deterministic mode and TF32 that replay/load/environment.py sets back."""


def _sdp_enabled(key: str) -> bool | None:
    """torch.backends.cuda.<key>_enabled() (flash_sdp, mem_efficient_sdp, math_sdp, cudnn_sdp), None where this
    torch has no such switch."""
    read = getattr(torch.backends.cuda, f"{key}_enabled", None)
    return bool(read()) if callable(read) else None
