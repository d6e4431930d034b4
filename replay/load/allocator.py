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
own settings are theirs. torch >= 2.1 sets it at run time (`torch._C._accelerator_setAllocatorSettings`, before 2.9
`torch.cuda.memory._set_allocator_settings`; new segments only); an older torch, or a platform without it, replays with the default allocator and says so.
"""

from __future__ import annotations

import os

import torch

USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
SETTING = "expandable_segments:True"


def prefer_expandable_segments(device: torch.device) -> str:
    """Asks the caching allocator for expandable segments for a streamed replay on `device` (CUDA) unless the user
    configured the allocator; the stage log's words for what was done ("" on a CPU)."""
    if device.type != "cuda":
        return ""
    for name in USER_SETTINGS:
        if os.environ.get(name):
            return f"CUDA allocator: as {name} sets it"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9; before it, the CUDA one
    setter = setter or getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return f"CUDA allocator: the default (this torch {torch.__version__} cannot set {SETTING} at run time)"
    try:
        setter(SETTING)
    except (RuntimeError, ValueError) as exc:  # a platform without expandable segments
        return f"CUDA allocator: the default ({SETTING} refused: {str(exc).splitlines()[0][:120]})"
    return f"CUDA allocator: {SETTING} (fewer synchronising cudaMalloc/cudaFree under the budget)"


__all__ = ["prefer_expandable_segments", "SETTING", "USER_SETTINGS"]
