"""Fixtures of the integration tests: `harness` (tests/integrations/harness.py) and the plain-torch `reference`."""

from __future__ import annotations

from pathlib import Path

import pytest


def _load_harness():
    from forensics_test_helpers import load_test_module  # set by tests/conftest.py

    return load_test_module("forensics_integration_harness", Path(__file__).with_name("harness.py"))


@pytest.fixture(scope="session")
def harness():
    """The tests/integrations/harness.py module."""
    return _load_harness()


@pytest.fixture(scope="session")
def reference(harness):
    """Plain-torch weights and AdamW state (by parameter name) right before the corrupt step of the examples."""
    harness.requires("transformers")
    return harness.reference_state()
