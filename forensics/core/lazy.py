"""Lazy package exports: a package's public names imported from their modules on first use (PEP 562), so
importing the package stays light (`import forensics.capture` never imports a framework; `forensics inspect` never torch)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The package's module-level `__getattr__`: `exports` maps a public name to the module that defines it
    ("pkg.mod"), or to "pkg.mod:other" when the module calls it something else.

    Example:
        >>> __getattr__ = lazy_exports(__name__, {"run_replay": "forensics.replay.engine"})  # doctest: +SKIP
    """

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = target.partition(":")
        return getattr(importlib.import_module(module), attribute or name)

    return __getattr__


__all__ = ["lazy_exports"]
