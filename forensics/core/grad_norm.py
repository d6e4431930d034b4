"""The total gradient norm, computed one way for capture and replay (bitwise fidelity needs one function).

It is the norm `torch.nn.utils.clip_grad_norm_` returns, so a loop that passes clip_grad_norm_'s value to
`Guard.check` and one that lets the Guard compute it record the same number, and replay recomputes it
bit for bit.
"""

from __future__ import annotations

from typing import Iterable

import torch


def total_grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm over all `grads` (one fused reduction per device and dtype; no host sync).

    Args:
        grads: gradient tensors (any devices and dtypes).
    Returns:
        A 0-dim tensor on the first gradient's device, or None when there is no gradient.
    Example:
        >>> total_grad_norm([torch.ones(3), torch.ones(1)])
        tensor(2.)
    """
    grads = list(grads)
    if not grads:
        return None
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6: what clip_grad_norm_ uses
    if get_total_norm is not None:
        norm: torch.Tensor = get_total_norm(grads, 2.0)
        return norm
    first = grads[0].device
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
    return total
