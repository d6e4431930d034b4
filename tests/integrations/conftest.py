"""Fixtures of the integration tests: `harness` (tests/integrations/harness.py) and the plain-torch `reference`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _load_harness():
    # tests/ is not a package; load harness.py under a name no other test directory can shadow.
    name = "forensics_integration_harness"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("harness.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def harness():
    """The tests/integrations/harness.py module."""
    return _load_harness()


@pytest.fixture(scope="session")
def reference(harness):
    """Plain-torch weights and AdamW state (by parameter name) right before the corrupt step of the examples."""
    harness.requires("transformers")
    return harness.reference_state()
