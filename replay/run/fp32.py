"""The fp32 re-run as it says: hold every pass marked fp32 to float32 whatever the user's code does, and count what ran.

Dropping the replay's own autocast is not enough: user code often enters autocast itself (inside the forward or the
loss function: `with torch.autocast("cuda", dtype=torch.float16)`, a `torch.amp.autocast` decorator, HF's and
Lightning's wrappers, which all go through `torch.amp.autocast_mode.autocast`) or casts with `.half()` /
`.to(torch.bfloat16)`. Inside `held_to_fp32()`:

* every autocast context entered is entered disabled (the one class all spellings share: torch.autocast,
  torch.amp.autocast, torch.cuda.amp.autocast, torch.cpu.amp.autocast);
* a dispatch mode turns each op's requested float16 / bfloat16 `dtype=` (casts, factories) into float32 and counts
  the output dtypes of the compute ops (matmuls, convolutions, attention), so the report can say what ran
  ("fp32 checked: 214 ops in float32, none in float16") and a pass that still ran below fp32 draws no conclusion.

A pass is the forward (and the loss) of each micro-batch: autograd's backward runs in the dtypes the forward saved.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from forensics.core.thirdparty import TorchDispatchMode, tree_leaves

LOW = (torch.float16, torch.bfloat16)
COMPUTE_OPS = frozenset(
    name
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "convolution",
        "_convolution",
        "cudnn_convolution",
        "mkldnn_convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "_scaled_mm",
    )
    if hasattr(torch.ops.aten, name)
)
"""The ops whose output dtype says what precision a pass computed in (matrix products, convolutions, attention)."""


@dataclass
class Fp32Count:
    """What one fp32 pass ran: compute-op outputs by dtype, and how many low-precision requests were held to fp32."""

    ops: Counter = field(default_factory=Counter)
    """dtype name ('float32', 'float16' ...) -> compute ops whose output had it."""
    held_casts: int = 0
    """Casts or new tensors the code asked for in float16 / bfloat16, made in float32 instead."""
    held_autocasts: int = 0
    """Autocast contexts the code entered, entered disabled."""

    @property
    def low_ops(self) -> int:
        return sum(n for dtype, n in self.ops.items() if dtype in ("float16", "bfloat16"))

    @property
    def verified(self) -> bool:
        """The pass ran compute ops, none of them below float32."""
        return sum(self.ops.values()) > 0 and self.low_ops == 0

    def as_dict(self) -> dict:
        return {
            "ops": dict(sorted(self.ops.items())),
            "held_casts": self.held_casts,
            "held_autocasts": self.held_autocasts,
            "verified": self.verified,
        }


class _HoldToFp32(TorchDispatchMode):
    def __init__(self, count: Fp32Count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") in LOW:
            kwargs = {**kwargs, "dtype": torch.float32}
            self.count.held_casts += 1
        out = func(*args, **kwargs)
        _count_output(func, out, self.count.ops)
        return out


class CountDtypes(TorchDispatchMode):
    """Counts the compute ops' output dtypes and changes nothing (a pass in the job's own precision)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        _count_output(func, out, self.ops)
        return out


def _count_output(func: Any, out: Any, ops: Counter) -> None:
    if func.overloadpacket.__name__ in COMPUTE_OPS:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                ops[str(t.dtype).removeprefix("torch.")] += 1
                break


_patch_lock = threading.Lock()


@contextlib.contextmanager
def _autocast_entered_disabled(count: Fp32Count) -> Iterator[None]:
    """Within: every autocast entered is entered disabled. On leaving (an exception in the user's code included), the
    class's `__enter__` and every instance it disabled are as they were: an instance outlives the pass when the user
    reuses it (a `@torch.autocast(...)` decorator holds one for every call, a module may keep one as an attribute),
    and one left disabled would run every later pass of the replay in fp32."""
    autocast = torch.amp.autocast_mode.autocast
    original = autocast.__enter__
    touched: dict[int, tuple[Any, Any]] = {}  # id -> (instance, its `_enabled` before the pass)

    def enter_disabled(self: Any) -> Any:
        if getattr(self, "_enabled", False):
            count.held_autocasts += 1
        touched.setdefault(id(self), (self, getattr(self, "_enabled", False)))
        self._enabled = False
        return original(self)

    with _patch_lock:
        autocast.__enter__ = enter_disabled  # type: ignore[method-assign]  # for this block only
        try:
            yield
        finally:
            autocast.__enter__ = original  # type: ignore[method-assign]
            for instance, enabled in touched.values():
                instance._enabled = enabled


@contextlib.contextmanager
def held_to_fp32(count: Fp32Count) -> Iterator[Fp32Count]:
    """Within: the code runs in float32 (see the module docstring); `count` collects what ran."""
    with autocasts_entered_disabled(count), held_to_fp32_in_thread(count):
        yield count


def autocasts_entered_disabled(count: Fp32Count) -> contextlib.AbstractContextManager[None]:
    """The process-wide part of `held_to_fp32`: every autocast entered, on any thread, is entered disabled (one
    holder at a time: several passes of one thread run together, replay/run/lockstep.py, enter it once for all and
    each the thread's own part, `held_to_fp32_in_thread`)."""
    return _autocast_entered_disabled(count)


@contextlib.contextmanager
def held_to_fp32_in_thread(count: Fp32Count) -> Iterator[Fp32Count]:
    """The calling thread's part of `held_to_fp32`: its autocast off, its low-precision requests held to float32
    and its compute ops counted."""
    with torch.autocast("cpu", enabled=False), _HoldToFp32(count):
        if torch.cuda.is_available():
            with torch.autocast("cuda", enabled=False):
                yield count
        else:
            yield count


__all__ = ["CountDtypes", "Fp32Count", "autocasts_entered_disabled", "held_to_fp32", "held_to_fp32_in_thread"]
