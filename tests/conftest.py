"""Shared fixtures: `helpers` (tests/helpers.py: tiny GPT-2, seeded data, the Guard loop, synthetic dumps)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# Compiled bytecode kept outside the checkout and the venv where the environment forbids writing it beside the sources
# (PYTHONDONTWRITEBYTECODE=1 with a venv installed --no-compile): otherwise every process of the suite (each test
# worker, torchrun rank, script and forked server) compiles torch and transformers from source again, about 5 s of CPU
# per process that imports transformers' models (measured 2026-11-28: the scenario fixture spent 14 of its 24 s in
# `compile`). Set here, before the tests import them, and through the environment for the processes they start.
if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
    import tempfile

    os.environ.pop("PYTHONDONTWRITEBYTECODE")
    os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), f"forensics-pycache-{os.getuid()}")
    sys.pycache_prefix, sys.dont_write_bytecode = os.environ["PYTHONPYCACHEPREFIX"], False

# Tiny models on a shared 2-core box: one intra-op thread is several times faster than two threads
# fighting other test processes for the cores, and it keeps every float reduction order fixed.
torch.set_num_threads(1)


def load_test_module(name: str, path: Path):
    """Loads a test support file under a name no test directory can shadow (tests/ is not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _load_helpers():
    return load_test_module("forensics_test_helpers", Path(__file__).with_name("helpers.py"))


_load_helpers()  # importable as `forensics_test_helpers` from test modules too
sys.modules["forensics_test_helpers"].load_test_module = load_test_module  # for sub-directories' conftests


@pytest.fixture(scope="session")
def helpers():
    """The tests/helpers.py module."""
    return _load_helpers()


@pytest.fixture
def gpt2():
    """Factory: gpt2(seed=0, dropout=0.1) -> a tiny random-init GPT2LMHeadModel in train mode."""
    return _load_helpers().make_gpt2


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (more multi-process launches; CI runs without them)",
    )


def pytest_configure(config):
    # pyproject.toml's "error:..." warning filters (our own deprecated spellings) reach only pytest's processes; the
    # jobs the tests launch (torchrun ranks, job scripts) get them through PYTHONWARNINGS, so a subprocess that
    # builds GuardConfig(max_dumps=...) or reads dump.trigger["kind"] fails too.
    own = [f for f in config.getini("filterwarnings") if f.startswith("error:")]
    given = [f for f in os.environ.get("PYTHONWARNINGS", "").split(",") if f]
    os.environ["PYTHONWARNINGS"] = ",".join(given + [f for f in own if f not in given])
    config.addinivalue_line("markers", "slow: a multi-process or long test beyond the CI set; runs with --runslow")
    config.addinivalue_line(  # pytest-xdist's own marker, named here so that runs without xdist know it too
        "markers", "xdist_group(name): tests that one xdist worker runs (their module shares an expensive fixture)"
    )
    if getattr(config.option, "numprocesses", None) and config.option.dist == "load":  # `-n N` without --dist
        config.option.dist = "loadgroup"  # xdist_group marks hold (below), other tests go one by one
        config.option.loadscopereorder = False  # in the order below: the slowest first
    if getattr(config, "workerinput", {}).get("forensics_loadgroup"):  # an xdist worker of such a run
        config.option.loadgroup = True  # xdist decides grouping on the worker from this option
        config.pluginmanager.register(_GroupIds(), "forensics-group-ids")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: on the controller, for each worker it starts
def pytest_configure_node(node):
    """Tells each worker that the run groups: xdist reads `loadgroup` on the worker, where it comes from the command
    line's --dist alone, so the `loadgroup` chosen in pytest_configure above would hold on the controller only."""
    node.workerinput["forensics_loadgroup"] = node.config.option.dist == "loadgroup"


# The test modules that take longest, longest first (2-core machine, 2026-11-27): under `-n 2` (the README's command,
# made `--dist loadgroup --no-loadscope-reorder` above) the workers start with them, so that no long module is left
# to run alone at the end. A module missing here only runs later; nothing depends on the order.
SLOWEST_FIRST = [
    "tests/replay/test_exceptions.py",
    "tests/replay/test_repro.py",
    "tests/integrations/test_sharded.py",
    "tests/integrations/test_multirank.py",
    "tests/natural/test_natural_runs.py",
    "tests/forensics/test_hostile.py",
    "tests/test_docs.py",
    "tests/replay/test_nanogpt_style.py",
    "tests/replay/test_main_script.py",
    "tests/integrations/test_callbacks.py",
    "tests/integrations/test_timeline_run.py",
]


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    """Skips the slow tests without --runslow; keeps each module whose tests share a module-scoped fixture on one
    xdist worker (the fixture is built once); puts the slowest modules first."""
    for item in items:
        scopes = {d.scope for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs}
        if scopes & {"module", "class", "package"}:
            item.add_marker(pytest.mark.xdist_group(_module(item)))
    rank = {module: i for i, module in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: the rest keep their order
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


class _GroupIds:
    """Puts a test's xdist_group into its node id, as pytest-xdist's loadgroup does (`name@group`: its scheduler keeps
    one group on one worker). pytest-xdist 3.8 writes `item._nodeid`, which pytest 9.2 no longer reads (its node id
    is `item._id`): without this, loadgroup spread a module's tests over both workers and each built the module's
    fixture, e.g. test_guard_distributed's two-rank run and test_repro's repro scripts ran twice (issue 31)."""

    @pytest.hookimpl(trylast=True)  # after pytest-xdist's hook (a worker's), which did this where it still works
    def pytest_collection_modifyitems(self, config, items):
        for item in items:
            groups = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
            node_id = getattr(item, "_id", None)
            if groups and node_id is not None and "@" not in item.nodeid:
                item._id = type(node_id).parse(f"{item.nodeid}@{'_'.join(groups)}")
