"""Module paths that moved, kept importable for one release with a DeprecationWarning that names the new path.

The one list of them is `MOVED` (CHANGELOG.md lists them for users). `install()` (called by `forensics/__init__.py`)
puts a finder in front of `sys.meta_path` that answers an old name with the module now at the new path (the same
module object, so classes and isinstance checks are shared); it claims nothing that exists:
- `forensics.<old>`: the names below that are not modules any more (`forensics.errors` -> `forensics.core.errors`);
- `capture.<...>` / `replay.<...>`: forensics' two sides before they moved under `forensics.` (0.1.0), with the moves
  inside them applied (`capture.detectors` -> `forensics.capture.detection.detectors`); only once `forensics` is
  imported (there is no top-level `capture` package to install: it would shadow a user's own) and only while no
  `capture` / `replay` of the user's own is on sys.path. A torchtitan job launched with
  `-m forensics.capture.integrations.torchtitan` reads a TOML naming `capture.integrations.torchtitan` this way.
Dumps name modules too: of those only the one path forensics itself wrote into old dumps is rewritten
(`replay/load/recipe.py`, LEGACY_PATHS); any other `replay.*` / `capture.*` a dump names is the user's own package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

# Old module path -> new one. A name whose longest listed prefix matches moves with it (`capture.check.sync` ->
# `capture.detection.sync`); module names in a row are one string, split (between_steps is a kind's string too).
# Names of a side (capture., replay.) are relative to `forensics.`. A name that is a module today keeps its current
# meaning (the module `capture/dumping.py` of 0.1.0 is now the package `dumping/`).
MOVED: dict[str, str] = {
    # forensics/ in rooms: entry points in commands/, the shared modules in core/
    "forensics.catalog": "forensics.commands.catalog",
    "forensics.summary": "forensics.commands.summary",
    **{
        f"forensics.{name}": f"forensics.core.{name}"
        for name in (
            "device_sync errors fsio gc_pause grad_norm headroom kinds lazy rng sizes thirdparty trend trigger "
            "unfilled uploads"
        ).split()
    },
    "forensics.format.tree": "forensics.format.batch_tree",
    # capture/: folders named by their config groups, then by stage
    "capture.check": "capture.detection",
    "capture.record": "capture.recording",
    "capture.dump": "capture.dumping",
    "capture.dump.recipe": "capture.state.recipe",
    "capture.agreement": "capture.detection.agreement",
    "capture.detectors": "capture.detection.detectors",
    "capture.checking": "capture.detection.sync",
    "capture.deferred": "capture.detection.sync_free",
    "capture.update_check": "capture.detection.update",
    "capture.dump_budget": "capture.dumping.budget",
    "capture.environment": "capture.dumping.environment",
    "capture.main_script": "capture.dumping.main_script",
    "capture.recipe": "capture.state.recipe",
    "capture.uploads": "capture.dumping.uploads",
    "capture.writer_thread": "capture.dumping.writer_thread",
    "capture.precursor_stats": "capture.precursors.statistics",
    "capture.exceptions": "capture.raised.exceptions",
    "capture.optimizer_steps": "capture.raised.optimizer_steps",
    **{f"capture.{name}": f"capture.recording.{name}" for name in "datasets history incident misuse window".split()},
    **{f"capture.{name}": f"capture.state.{name}" for name in "buddy buffers host_snapshots sharding snapshot".split()},
    # replay/: grouped by the engine's stages
    **{f"replay.{name}": f"replay.culprits.{name}" for name in "bisect per_sample sample_facts sizes".split()},
    **{
        f"replay.{name}": f"replay.judge.{name}"
        for name in (
            "assemble between_steps findings history_pattern precision precursor remedies remedy_followup verdict"
        ).split()
    },
    **{
        f"replay.{name}": f"replay.load.{name}"
        for name in "environment fsdp_precision main_script optimizer_state recipe samples user_code".split()
    },
    "replay.localize_exception": "replay.localize.exception",
    "replay.localize_update": "replay.localize.update",
    "replay.localize_weights": "replay.localize.weights",
    **{f"replay.{name}": f"replay.run.{name}" for name in "execute rng_dependence window".split()},
    "replay.load.streamed": "replay.load.stream_plan",
    "replay.run.streamed": "replay.run.streamed_runner",
}

SIDES = ("capture", "replay")  # top-level packages before 0.2.0, now forensics.capture and forensics.replay


def current_name(name: str) -> str | None:
    """The module path `name` stands for today, or None when it is not an old name (a current one included)."""
    top = name.partition(".")[0]
    if top not in SIDES and name not in MOVED:
        return None
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        new = MOVED.get(".".join(parts[:cut]))
        if new is not None:
            name = ".".join([new, *parts[cut:]])
            break
    return f"forensics.{name}" if top in SIDES else name


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder: exec_module puts the module at the new path in its place

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        warnings.warn(
            f"{old} moved to {self.new}; import it from there (the old path goes in forensics 0.3)",
            DeprecationWarning,
            stacklevel=2,  # importlib's own frames are skipped: the warning names the importing line
        )
        sys.modules[old] = importlib.import_module(self.new)


def _found_elsewhere(this: importlib.abc.MetaPathFinder, name: str) -> bool:
    """Whether a finder other than `this` (sys.path's, or one a replay adds for the job's recorded directories) has
    a module `name`: then it is the user's, never an old name of ours."""
    for finder in list(sys.meta_path):
        if finder is this or not hasattr(finder, "find_spec"):
            continue
        try:
            if finder.find_spec(name, None) is not None:
                return True
        except (ImportError, ValueError, AttributeError):
            continue
    return False


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top in SIDES:
            if fullname == top:
                if _found_elsewhere(self, top):
                    return None  # the user's own capture / replay (on sys.path, or served by another finder)
            elif sys.modules.get(top) is None or sys.modules.get(top) is not sys.modules.get(f"forensics.{top}"):
                return None  # below the user's own package
        elif fullname not in MOVED or not fullname.startswith("forensics."):
            return None
        new = current_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Puts the finder of old names in front of sys.meta_path, once."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
