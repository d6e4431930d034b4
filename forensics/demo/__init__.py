"""Planted-fault demo scenarios: real small training runs that crash, are captured, and are replayed.

The scenario models and losses (forensics.demo.models) are built-in recipes (the static list
forensics.recipes.BUILTIN_RECIPES), so replay rebuilds them without --trust. The scenarios themselves
(forensics.demo.scenarios) and the demo driver (forensics.demo.run) load on first use: they import
transformers.
"""

from __future__ import annotations

from forensics.core.lazy import lazy_exports

__all__ = ["SCENARIOS", "SCENARIO_NAMES", "DEFAULT_SCENARIO", "run_demo"]

SCENARIO_NAMES = ("bad_sample", "log_zero", "fp16_overflow", "adam_eps_zero", "pair", "sdc", "dropout_mask", "spike")
"""The scenarios' names, for the CLI's help without importing torch (tests check they match SCENARIOS)."""

__getattr__ = lazy_exports(
    __name__,
    {
        "SCENARIOS": "forensics.demo.scenarios",
        "DEFAULT_SCENARIO": "forensics.demo.scenarios",
        "run_demo": "forensics.demo.run",
    },
)
