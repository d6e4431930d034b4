"""The manifest's schema, checked once when a dump is opened, so no later code meets a wrong type.

`check_manifest(raw, where)` walks every field readers use (docs/DUMP_FORMAT.md "manifest.json") and
refuses wrong JSON types, out-of-range numbers, oversized lists and names that are not plain names,
with a message naming the field. An optional section (OPTIONAL_SECTIONS) may be absent, never null or of
another type; fields inside sections may be null where documented; unknown keys are kept (a newer writer
may add them). `trigger.kind` must be a kind this forensics knows. Names from a dump (run id, file names) must match NAME_PATTERN: they may
later become part of a path or be printed, and neither may escape.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from forensics.core.errors import DumpCorruptError
from forensics.format import spec
from forensics.format.digest import digest_of_chunks
from forensics.format.limits import MAX_MICRO_BATCHES, MAX_NAME_CHARS, MAX_WORLD_SIZE
from forensics.core.kinds import Phase, StateHolds, TriggerKind

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]*")
"""A run id or a file name: letters, digits, `_ . + -`, not starting with a dot (no '..', no '/')."""
SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_STEP = 1 << 62
OPTIONAL_SECTIONS: dict[str, type] = {
    "loss": dict,
    "precision": dict,
    "recipe": dict,
    "determinism": dict,
    "environment": dict,
    "recheck": dict,
    "distributed": dict,
    "exception": dict,
    "layout": dict,
    "window": dict,
    "data_recipe": dict,
    "snapshot": dict,
    "state_missing": str,
    "missing_ranks": list,
    "dump_budget": dict,
}
"""Top-level sections a writer omits when it has nothing to say: when present, each has this JSON type."""
_TYPE_WORDS: dict[type, str] = {dict: "an object", str: "a string", list: "a list"}


def safe_name(value: Any) -> bool:
    """True for a string usable as one path component and printable as it is (NAME_PATTERN)."""
    return isinstance(value, str) and len(value) <= MAX_NAME_CHARS and NAME_PATTERN.fullmatch(value) is not None


class _Checker:
    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, what: str) -> DumpCorruptError:
        return DumpCorruptError(f"{self.where}: '{field}' {what}; the manifest was edited or damaged", spec.MANIFEST)

    def integer(self, value: Any, field: str, low: int = 0, high: int = MAX_STEP, optional: bool = False) -> None:
        if value is None and optional:
            return
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise self.fail(field, f"must be an integer in [{low}, {high}], got {_short(value)}")

    def number(self, value: Any, field: str) -> None:
        """A number, null, or a non-finite float (decoded from the float tag)."""
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise self.fail(field, f"must be a number or null, got {_short(value)}")

    def kind(self, value: Any, field: str, types: type | tuple, optional: bool = True) -> None:
        if value is None and optional:
            return
        if not isinstance(value, types) or isinstance(value, bool) and bool not in _tuple(types):
            names = " or ".join(t.__name__ for t in _tuple(types))
            raise self.fail(field, f"must be {names}{' or null' if optional else ''}, got {_short(value)}")

    def each(
        self, values: Any, field: str, check: Callable[[Any, str], None], limit: int, optional: bool = True
    ) -> None:
        if values is None and optional:
            return
        if not isinstance(values, list):
            raise self.fail(field, f"must be a list, got {_short(values)}")
        if len(values) > limit:
            raise self.fail(field, f"has {len(values)} entries (at most {limit})")
        for index, value in enumerate(values):
            check(value, f"{field}[{index}]")


def check_manifest(manifest: dict, where: str) -> None:
    """Raises DumpCorruptError naming the first field that does not match the schema (format version and
    required keys are checked by the caller)."""
    c = _Checker(where)
    if not safe_name(manifest["run_id"]):
        raise c.fail(
            "run_id",
            f"must be a plain name ({NAME_PATTERN.pattern}, at most {MAX_NAME_CHARS} "
            f"characters), got {_short(manifest['run_id'])}",
        )
    c.integer(manifest["step"], "step")
    c.integer(manifest["world_size"], "world_size", 1, MAX_WORLD_SIZE)
    c.integer(manifest["rank"], "rank", 0, manifest["world_size"] - 1)
    c.integer(manifest.get("local_rank"), "local_rank", 0, MAX_WORLD_SIZE, optional=True)
    c.integer(manifest.get("grad_accum"), "grad_accum", 0, MAX_MICRO_BATCHES, optional=True)
    c.kind(manifest["created_at"], "created_at", str, optional=False)
    for key, expected in OPTIONAL_SECTIONS.items():
        if key in manifest and not isinstance(manifest[key], expected):
            raise c.fail(
                key,
                f"must be {_TYPE_WORDS[expected]} when present (a writer leaves out a section it has "
                f"nothing for), got {_short(manifest[key])}",
            )
    batches = manifest["micro_batches"]
    c.each(batches, "micro_batches", lambda b, f: _micro_batch(c, b, f), MAX_MICRO_BATCHES, optional=False)
    _trigger(c, manifest["trigger"], len(batches))
    _loss(c, manifest.get("loss"))
    _check_precision(c, manifest.get("precision"))
    _check_recipe(c, manifest.get("recipe"))
    gpus = (manifest.get("environment") or {}).get("gpus")
    c.each(gpus, "environment.gpus", lambda g, f: c.kind(g, f, dict, optional=False), MAX_WORLD_SIZE)
    for key in ("cwd", "script_dir"):  # put on sys.path at replay (--trust): a string or nothing
        c.kind((manifest.get("environment") or {}).get(key), f"environment.{key}", str)
    _check_exception(c, manifest.get("exception"))
    _layout(c, manifest.get("layout"), manifest["format_version"])
    _check_window(c, manifest.get("window"), manifest.get("data_recipe"))
    _snapshot(c, manifest.get("snapshot"), manifest["step"])
    c.kind(manifest.get("state_missing"), "state_missing", str)
    c.each(
        manifest.get("missing_ranks"), "missing_ranks", lambda r, f: c.integer(r, f, 0, MAX_WORLD_SIZE), MAX_WORLD_SIZE
    )
    _files(c, manifest["files"], manifest["format_version"])


def _micro_batch(c: _Checker, batch: Any, field: str) -> None:
    c.kind(batch, field, dict, optional=False)
    c.integer(batch.get("index"), f"{field}.index", 0, MAX_MICRO_BATCHES, optional=True)
    c.integer(batch.get("batch_size"), f"{field}.batch_size", 0, 1 << 40, optional=True)
    c.number(batch.get("loss"), f"{field}.loss")
    c.kind(batch.get("sample_ids"), f"{field}.sample_ids", list)
    c.kind(batch.get("ids_are_positional"), f"{field}.ids_are_positional", bool)
    c.kind(batch.get("unreplayable"), f"{field}.unreplayable", list)


def _trigger(c: _Checker, trigger: Any, num_micro_batches: int) -> None:
    c.kind(trigger, "trigger", dict, optional=False)
    kind = trigger.get("kind")
    if kind is not None and kind not in TriggerKind.values():
        raise c.fail(
            "trigger.kind",
            f"is {_short(kind)}, which is none of the kinds this forensics knows "
            f"({', '.join(TriggerKind.values())}); if a newer forensics wrote the dump, "
            "upgrade (pip install -U forensics)",
        )
    c.number(trigger.get("value"), "trigger.value")
    c.number(trigger.get("threshold"), "trigger.threshold")
    c.integer(trigger.get("micro_batch"), "trigger.micro_batch", 0, max(num_micro_batches - 1, 0), optional=True)
    c.kind(trigger.get("detail"), "trigger.detail", str)
    c.kind(trigger.get("local"), "trigger.local", bool)


def _loss(c: _Checker, loss: Any) -> None:
    c.kind(loss, "loss", dict)
    if not loss:
        return
    c.each(loss.get("per_micro_batch"), "loss.per_micro_batch", c.number, MAX_MICRO_BATCHES)
    for key in ("divisor", "grad_norm", "step_loss"):
        c.number(loss.get(key), f"loss.{key}")
    divisor = loss.get("divisor")
    if divisor is not None and not (math.isfinite(divisor) and divisor > 0):
        raise c.fail("loss.divisor", f"must be a positive number, got {_short(divisor)}")


def _check_precision(c: _Checker, precision: Any) -> None:
    c.kind(precision, "precision", dict)
    if not precision:
        return
    c.kind(precision.get("param_dtype"), "precision.param_dtype", str)
    c.kind(precision.get("grad_scaler"), "precision.grad_scaler", dict)
    autocast = precision.get("autocast")
    c.kind(autocast, "precision.autocast", dict)
    if autocast:
        c.kind(autocast.get("enabled"), "precision.autocast.enabled", bool)
        c.kind(autocast.get("device_type"), "precision.autocast.device_type", str)
        c.kind(autocast.get("dtype"), "precision.autocast.dtype", str)
    units = precision.get("fsdp")
    c.kind(units, "precision.fsdp", list)
    if units and len(units) > MAX_TENSORS:
        raise c.fail("precision.fsdp", f"lists {len(units)} units (at most {MAX_TENSORS})")
    for index, unit in enumerate(units or []):
        field = f"precision.fsdp[{index}]"
        c.kind(unit, field, dict, optional=False)
        c.kind(unit.get("module"), f"{field}.module", str, optional=False)
        if len(unit["module"]) > 4096:
            raise c.fail(f"{field}.module", "is longer than 4096 characters")
        for key in ("param_dtype", "reduce_dtype", "output_dtype"):
            if unit.get(key) is not None and unit.get(key) not in FLOAT_DTYPES:
                raise c.fail(
                    f"{field}.{key}", f"must be null or one of {list(FLOAT_DTYPES)}, got {_short(unit.get(key))}"
                )
        c.kind(unit.get("cast_forward_inputs"), f"{field}.cast_forward_inputs", bool)


def _check_recipe(c: _Checker, recipe: Any) -> None:
    c.kind(recipe, "recipe", dict)
    if not recipe:
        return
    for key in ("factory", "loss", "source", "model_class", "note"):
        c.kind(recipe.get(key), f"recipe.{key}", str)
    for key in ("factory_kwargs", "loss_kwargs"):
        c.kind(recipe.get(key), f"recipe.{key}", dict)
    script = recipe.get("script")
    c.kind(script, "recipe.script", dict)
    if script:
        if script.get("file") != spec.MAIN_SCRIPT:
            raise c.fail("recipe.script.file", f"must be {spec.MAIN_SCRIPT!r}, got {_short(script.get('file'))}")
        c.kind(script.get("name"), "recipe.script.name", str)
        c.kind(script.get("globals"), "recipe.script.globals", dict)
        c.kind(script.get("unrecorded"), "recipe.script.unrecorded", dict)
        for key in ("globals", "unrecorded"):
            for name, value in (script.get(key) or {}).items():
                if not name.isidentifier() or name.startswith("__"):
                    raise c.fail(f"recipe.script.{key}", f"names {_short(name)}, not a plain Python name")
                if key == "unrecorded":
                    c.kind(value, f"recipe.script.unrecorded.{name}", str, optional=False)


def _check_exception(c: _Checker, exception: Any) -> None:
    c.kind(exception, "exception", dict)
    if not exception:
        return
    for key in ("type", "message", "during", "traceback", "qualified_type", "state_holds"):
        c.kind(exception.get(key), f"exception.{key}", str)
    for key, kind in (("during", Phase), ("state_holds", StateHolds)):
        if exception.get(key) is not None and exception[key] not in kind.values():
            raise c.fail(f"exception.{key}", f"must be one of {', '.join(kind.values())}, got {_short(exception[key])}")
    frame = exception.get("user_frame")
    c.kind(frame, "exception.user_frame", dict)
    if frame:
        for key in ("file", "function", "code"):
            c.kind(frame.get(key), f"exception.user_frame.{key}", str)
        c.integer(frame.get("line"), "exception.user_frame.line", optional=True)
    c.each(exception.get("frames"), "exception.frames", lambda f, name: c.kind(f, name, dict, optional=False), 1000)


def _check_window(c: _Checker, window: Any, data_recipe: Any) -> None:
    """The flight recorder's summary and the data recipe (both optional)."""
    c.kind(window, "window", dict)
    if window:
        for key in ("first_step", "last_step", "steps"):
            c.integer(window.get(key), f"window.{key}")
        c.number(window.get("max_grad_norm"), "window.max_grad_norm")
    c.kind(data_recipe, "data_recipe", dict)
    if data_recipe:
        c.kind(data_recipe.get("dataset"), "data_recipe.dataset", str, optional=False)
        c.kind(data_recipe.get("collate"), "data_recipe.collate", str)
        c.kind(data_recipe.get("dataset_kwargs"), "data_recipe.dataset_kwargs", dict)


def _snapshot(c: _Checker, snapshot: Any, step: int) -> None:
    """The Guard's host snapshot of an earlier step (optional): `{"step"}`, before the dumped step."""
    c.kind(snapshot, "snapshot", dict)
    if snapshot:
        c.integer(snapshot.get("step"), "snapshot.step", 0, max(step - 1, 0))


MAX_DIMS = 32
MAX_TENSORS = 1 << 20
MAX_COPIES = 64
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


def _layout(c: _Checker, layout: Any, version: int) -> None:
    """The sharded layout (format version 2): the complete state's table and this rank's shards."""
    if layout is None:
        return
    c.kind(layout, "layout", dict, optional=False)
    if layout.get("kind") != spec.SHARDED:
        raise c.fail("layout.kind", f"must be {spec.SHARDED!r}, got {_short(layout.get('kind'))}")
    if version < spec.SHARDED_VERSION:
        raise c.fail(
            "layout",
            f"(a sharded state) needs format_version {spec.SHARDED_VERSION} or later, but the "
            f"manifest says format_version {version}",
        )
    for section in ("tensors", "shards"):
        value = layout.get(section)
        c.kind(value, f"layout.{section}", dict, optional=False)
        for file, rows in value.items():
            if file not in spec.SHARDED_FILES:
                raise c.fail(f"layout.{section}", f"names {_short(file)}; only {list(spec.SHARDED_FILES)} are sharded")
            _check_rows(c, rows, f"layout.{section}.{file}", section == "shards")
    copies = layout.get("copies")
    c.kind(copies, "layout.copies", dict)
    if copies and len(copies) > 2 * len(spec.SHARDED_FILES) * MAX_COPIES:
        raise c.fail("layout.copies", f"lists {len(copies)} files (at most {MAX_COPIES} source ranks' copies)")
    for stored, entry in (copies or {}).items():
        field = f"layout.copies[{_short(stored)}]"
        if not safe_name(stored) or stored in spec.SHARDED_FILES:
            raise c.fail(
                "layout.copies",
                f"names {_short(stored)}, which is not a plain file name inside the dump "
                "apart from its own state files",
            )
        c.kind(entry, field, dict, optional=False)
        if entry.get("of") not in spec.SHARDED_FILES:
            raise c.fail(f"{field}.of", f"must be one of {list(spec.SHARDED_FILES)}, got {_short(entry.get('of'))}")
        c.integer(entry.get("rank"), f"{field}.rank", 0, (1 << 20) - 1)
        _check_rows(c, entry.get("shards"), f"{field}.shards", shards=True)


def _check_rows(c: _Checker, rows: Any, field: str, shards: bool) -> None:
    """A `layout.tensors` table (global shapes and dtypes) or a `shards` table (boxes) of one file."""
    c.kind(rows, field, dict, optional=False)
    if len(rows) > MAX_TENSORS:
        raise c.fail(field, f"lists {len(rows)} tensors (at most {MAX_TENSORS})")
    for name, row in rows.items():
        where = f"{field}[{_short(name)}]"
        c.kind(row, where, dict, optional=False)
        for key in ("shape", "offsets") if shards else ("shape",):
            c.each(row.get(key), f"{where}.{key}", lambda n, f: c.integer(n, f, 0, 1 << 48), MAX_DIMS, optional=False)
        if not shards and row.get("dtype") not in spec.DTYPES:
            raise c.fail(f"{where}.dtype", f"must be one of {list(spec.DTYPES)}, got {_short(row.get('dtype'))}")
        if shards:
            c.kind(row.get("flat"), f"{where}.flat", bool, optional=False)
            if len(row["shape"]) != len(row["offsets"]):
                raise c.fail(where, "has offsets and shape of different lengths")


def _files(c: _Checker, files: Any, version: int) -> None:
    c.kind(files, "files", dict, optional=False)
    if len(files) > 4 * MAX_MICRO_BATCHES + 64:
        raise c.fail("files", f"lists {len(files)} files")
    for name, entry in files.items():
        if not safe_name(name) or name == spec.MANIFEST:
            raise c.fail("files", f"lists {_short(name)}, which is not a plain file name inside the dump")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and not isinstance(entry["size"], bool)
            and 0 <= entry["size"] < 1 << 50
            and isinstance(entry.get("sha256"), str)
            and SHA256.fullmatch(entry["sha256"])
        ):
            raise c.fail(f"files.{name}", 'must be {"size": int >= 0, "sha256": 64 lowercase hex digits}')
        if "chunks" in entry or "chunk_size" in entry:
            chunk_size, chunks = entry.get("chunk_size"), entry.get("chunks")
            c.integer(chunk_size, f"files.{name}.chunk_size", 1 << 20, 1 << 32)
            expected = -(-entry["size"] // chunk_size)
            if (
                not isinstance(chunks, list)
                or len(chunks) != expected
                or not all(isinstance(d, str) and SHA256.fullmatch(d) for d in chunks)
            ):
                raise c.fail(f"files.{name}.chunks", f"must list {expected} sha256 digests, one per chunk")
            if version >= spec.CHUNK_DIGEST_VERSION and entry["sha256"] != digest_of_chunks(chunks):
                raise c.fail(
                    f"files.{name}.sha256",
                    f"must be the sha256 of the file's chunk digests (format version {spec.CHUNK_DIGEST_VERSION})",
                )


def _tuple(types: type | tuple) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _short(value: Any) -> str:
    """A value for an error message: repr, escaped, cut (the dump is untrusted)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
