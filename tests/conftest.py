"""Shared fixtures: `helpers` (tests/helpers.py: tiny GPT-2, seeded data, the Guard loop, synthetic dumps)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

# Tiny models on a shared 2-core box: one intra-op thread is several times faster than two threads
# fighting other test processes for the cores, and it keeps every float reduction order fixed.
torch.set_num_threads(1)


def _load_helpers():
    # tests/ is not a package; load helpers.py under a name no other test directory can shadow.
    name = "forensics_test_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("helpers.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_load_helpers()  # importable as `forensics_test_helpers` from test modules too


@pytest.fixture(scope="session")
def helpers():
    """The tests/helpers.py module."""
    return _load_helpers()


@pytest.fixture
def gpt2():
    """Factory: gpt2(seed=0, dropout=0.1) -> a tiny random-init GPT2LMHeadModel in train mode."""
    return _load_helpers().make_gpt2
