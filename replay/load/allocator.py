"""Load, streamed on a GPU: the CUDA caching allocator asked to grow its segments in place (expandable segments).

A streamed replay under a memory budget allocates and frees a block's tensors at every step of every walk, of many
sizes (each block's weights, their casts, the load's tensors on their way to the host cache). With the default
allocator a pool held near the budget is cut into segments of fixed sizes: a request that fits none of the free ones
frees the cached segments (cudaFree: the device synchronised) and asks for a new one (cudaMalloc), again and again.
Expandable segments map more memory into one segment instead (no search for a fitting segment, no cudaFree in the
stream's path). Measured on one H200 (2026-11-28, FSDP2 bf16 Llama 6.7 B, a quarter of its fp32 weights enforced,
BENCHMARKS.md "Streamed replay"): the load 12.2 s -> 7.1 s, the replay 25.4 s -> 19.4 s (2.77 x -> 2.12 x the
unconstrained replay), the process's CPU time 150 -> 86 s; same verdict.

Only where the user left the allocator alone (neither PYTORCH_CUDA_ALLOC_CONF nor PYTORCH_ALLOC_CONF set): their
own settings are theirs. torch >= 2.1 sets it at run time (forensics/core/thirdparty.allocator_settings_setter; new
segments only); an older torch, or a platform without it, replays with the default allocator and says so. When the
streamed replay ends the default is set back (a replay run from the user's own process leaves the allocator as it
found it).
"""

from __future__ import annotations

import os

import torch

from forensics.core import thirdparty

USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
SETTING = "expandable_segments:True"
DEFAULT = "expandable_segments:False"


def prefer_expandable_segments(device: torch.device) -> tuple[str, bool]:
    """Asks the caching allocator for expandable segments for a streamed replay on `device` (CUDA) unless the user
    configured the allocator: (the stage log's words for what was done, "" on a CPU; whether it was set, so that
    `restore_default_segments` puts the default back when the replay ends)."""
    if device.type != "cuda":
        return "", False
    for name in USER_SETTINGS:
        if os.environ.get(name):
            return f"CUDA allocator: as {name} sets it", False
    setter = thirdparty.allocator_settings_setter()
    if setter is None:
        return f"CUDA allocator: the default (this torch {torch.__version__} cannot set {SETTING} at run time)", False
    try:
        setter(SETTING)
    except (RuntimeError, ValueError) as exc:  # a platform without expandable segments
        return f"CUDA allocator: the default ({SETTING} refused: {str(exc).splitlines()[0][:120]})", False
    return f"CUDA allocator: {SETTING} (fewer synchronising cudaMalloc/cudaFree under the budget)", True


def restore_default_segments() -> None:
    """The allocator's default (fixed-size segments) for segments made from now on: a replay called from the user's
    own process leaves the allocator as it found it. Segments made during the replay stay as they are."""
    setter = thirdparty.allocator_settings_setter()
    if setter is not None:
        try:
            setter(DEFAULT)
        except (RuntimeError, ValueError):  # it took the setting, so it takes this one; nothing to undo otherwise
            pass


__all__ = ["prefer_expandable_segments", "restore_default_segments", "SETTING", "USER_SETTINGS"]
