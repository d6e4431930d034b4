"""The model a recipe builds, held to the size of the weights the dump holds: checked while it is built.

A dump's recipe is data (`recipe.factory_kwargs`, e.g. a Hugging Face config): an edit of `n_layer` from 2 to
1,000,000 made the replay build a million blocks (3.5 GB, minutes) before comparing them with the 2 blocks of weights
the dump holds. So the factory runs under a `BuildBudget`: every tensor a factory function creates (torch.empty,
zeros, ones, full, rand*, arange, eye, new_* ...) is sized first on the meta device, before it is allocated, and every
parameter registered is counted; as soon as the elements created or the parameters registered pass what the dump's
weights hold (with a slack for the buffers no dump keeps, such as masks and rotary tables), the build stops with a
RecipeError naming both sizes (exit 2). Nothing is special about n_layer: any size in any recipe is held to the dump.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from forensics.core.errors import RecipeError

SLACK_ELEMENTS = 64 << 20
"""Elements a build may create beyond the dump's weights: non-persistent buffers (a GPT-2 causal mask of 1024 x 1024
per block, rotary tables), temporaries of the init, parameters built in another dtype (counted in elements, not
bytes, for that reason). 64 M elements is 256 MB in fp32: a tiny model's masks fit, a million blocks do not."""
SLACK_SHARE = 0.25
"""And this share of the dump's own elements (a model's buffers grow with it)."""
SLACK_PARAMETERS = 16
"""Parameters a build may register beyond the tensors the dump's weights hold (plus SLACK_SHARE of them): the weights
hold every parameter (tied ones under each name) and persistent buffer, so a model needs none; a few spare."""

_FACTORIES = frozenset(
    {
        torch.empty,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.arange,
        torch.eye,
        torch.empty_strided,
        torch.linspace,
        torch.logspace,
        torch.normal,
        torch.Tensor.new_empty,
        torch.Tensor.new_zeros,
        torch.Tensor.new_ones,
        torch.Tensor.new_full,
        torch.Tensor.new_empty_strided,
    }
)
"""Functions that allocate a tensor whose size comes from their arguments (a `*_like` or `torch.tensor` is bounded by
what exists already)."""


@dataclass(frozen=True)
class WeightsHeld:
    """What a dump's weights hold: how many tensors, how many elements."""

    tensors: int
    elements: int

    @property
    def max_elements(self) -> int:
        return int(self.elements * (1 + SLACK_SHARE)) + SLACK_ELEMENTS

    @property
    def max_parameters(self) -> int:
        return int(self.tensors * (1 + SLACK_SHARE)) + SLACK_PARAMETERS


class BuildTooLargeError(RecipeError):
    """The recipe's model grew past what the dump's weights hold while it was built (bad input, exit 2)."""


class BuildBudget(TorchFunctionMode):
    """Counts what a model build creates and stops it once it passes `held` (WeightsHeld.max_*)."""

    def __init__(self, held: WeightsHeld, what: str):
        super().__init__()
        self.held, self.what = held, what
        self.elements = 0
        self.parameters = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES:
            self.add_elements(_elements(func, args, kwargs))
        return func(*args, **kwargs)

    def add_elements(self, count: int) -> None:
        self.elements += count
        if self.elements > self.held.max_elements:
            raise self._too_large(f"{self.elements:,} elements of tensors", f"{self.held.elements:,} elements")

    def add_parameter(self) -> None:
        self.parameters += 1
        if self.parameters > self.held.max_parameters:
            raise self._too_large(f"{self.parameters:,} parameters", f"{self.held.tensors:,} tensors")

    def _too_large(self, built: str, held: str) -> BuildTooLargeError:
        return BuildTooLargeError(
            f"the model {self.what} is larger than the weights the dump holds: the build was stopped after it "
            f"created {built}, and the dump's weights hold {held}. A size in the recipe (its factory_kwargs, e.g. "
            "a config's number of layers or width) does not match the dump: it was edited, or --factory / "
            "--factory-kwargs name another model"
        )


def _elements(func: Any, args: tuple, kwargs: dict) -> int:
    """The elements `func(*args, **kwargs)` would allocate, found by running it on the meta device (nothing is
    allocated); 0 when it cannot run there (it then fails or allocates as it would have)."""
    try:
        probe = func(*args, **{**kwargs, "device": "meta"})
    except Exception:  # noqa: BLE001 - not sizeable on meta: the real call decides
        return 0
    return probe.numel() if isinstance(probe, torch.Tensor) else 0


@contextlib.contextmanager
def build_budget(held: WeightsHeld | None, what: str) -> Iterator[BuildBudget | None]:
    """Inside: factory functions and parameter registrations count against `held` (None: nothing is counted — no
    weights to compare with). Raises BuildTooLargeError as soon as the build passes it."""
    if held is None:
        yield None
        return
    budget = BuildBudget(held, what)
    register = torch.nn.Module.register_parameter

    def counted(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None:
            budget.add_parameter()
        register(module, name, param)

    torch.nn.Module.register_parameter = counted  # type: ignore[method-assign, assignment]  # for this block only
    try:
        with budget:
            yield budget
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def weights_held(dump: Any) -> WeightsHeld | None:
    """What the dump's weights hold (its pre-step state, else the Guard's host snapshot in it), from the tensor
    headers or a sharded dump's table only; None when it holds neither (a checkpoint the user trusts fills it)."""
    from forensics.format import spec

    for files in (spec.PRE_STEP_STATE, spec.SNAPSHOT_STATE):
        if files is spec.PRE_STEP_STATE and dump.state_missing:
            continue  # written without a state (an unusable device): its model file holds nothing to compare with
        if files is spec.PRE_STEP_STATE and dump.sharded:
            rows = ((dump.manifest.get("layout") or {}).get("tensors") or {}).get(files.model) or {}
            shapes = [row["shape"] for row in rows.values()]
        elif dump.has_file(files.model):
            handle = dump.tensor_file(files.model)
            shapes = [handle.shape(key) for key in handle.keys()]
        else:
            continue
        if not shapes:
            continue
        return WeightsHeld(len(shapes), sum(_product(shape) for shape in shapes))
    return None


def _product(shape: list[int]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out
