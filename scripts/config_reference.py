"""Writes docs/CONFIGURATION.md, the configuration reference, from the dataclasses of capture/config.py.

Each group's docstring, then each field with its default (as the source spells it) and its docstring (or the comment
on its line). The source is read, not imported. Run after changing capture/config.py:

    python -m scripts.config_reference          # rewrites docs/CONFIGURATION.md
    python -m scripts.config_reference --check  # exit 1 when the file is not current (tests/test_docs.py does this)
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "capture" / "config.py"
TARGET = ROOT / "docs" / "CONFIGURATION.md"

ORDER = (
    "GuardConfig",
    "DetectionConfig",
    "SpikeConfig",
    "SilentConfig",
    "DumpConfig",
    "RecordConfig",
    "PrecursorConfig",
)
WHERE = {
    "GuardConfig": "`Guard(..., config=GuardConfig(...))`",
    "DetectionConfig": "`GuardConfig(detection=DetectionConfig(...))`",
    "SpikeConfig": "`DetectionConfig(loss_spike=SpikeConfig(...), grad_norm_spike=SpikeConfig(...))`",
    "SilentConfig": "`DetectionConfig(silent=SilentConfig(...))` (off unless given)",
    "DumpConfig": "`GuardConfig(dumping=DumpConfig(...))`",
    "RecordConfig": "`GuardConfig(recording=RecordConfig(...))`",
    "PrecursorConfig": "`GuardConfig(precursors=PrecursorConfig(...))` (off unless given)",
}

HEADER = """# Configuration reference

Every setting of the Guard, one group per stage of the capture. Generated from `capture/config.py` by
`python -m scripts.config_reference`; edit the docstrings there, not this file (tests/test_docs.py checks that it
is current).

```
GuardConfig(dump_dir=..., run_id=...,
            detection=DetectionConfig(...),   # what fires, and what the Guard then does
            dumping=DumpConfig(...),          # how many dumps, what each holds, where it goes next
            recording=RecordConfig(...),      # what is kept of each step and of the steps before it
            precursors=PrecursorConfig(...))  # opt-in early warning
```

The flat spelling of the previous release (`GuardConfig(on_nonfinite="skip")`) still works, with a FutureWarning
that names the nested one, until the next release.
"""


def _default(node: ast.expr | None, source: str) -> str:
    """The default as a user would write it: `field(default_factory=X)` -> `X()`, a lambda's body as it is."""
    if node is None:
        return "required"
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "field":
        for keyword in node.keywords:
            if keyword.arg == "default_factory":
                factory = keyword.value
                if isinstance(factory, ast.Lambda):
                    return ast.get_source_segment(source, factory.body) or ""
                return f"{ast.get_source_segment(source, factory)}()"
    spelt = ast.get_source_segment(source, node) or ""
    enum = re.fullmatch(r"(?:Policy|StateLayout)\.([A-Z_]+)", spelt)  # a kind: users write its value
    return f'"{enum.group(1).lower()}"' if enum else spelt


def _words(text: str) -> str:
    """A docstring as Markdown: its paragraphs kept, each paragraph's lines joined; an example (a line ending in ':'
    over indented lines) kept as a code block."""
    out = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        first, *rest = paragraph.splitlines()
        if first.endswith(":") and rest and all(line.startswith(" ") for line in rest):
            out.append(first + "\n\n```\n" + inspect.cleandoc("\n".join(rest)) + "\n```")
        else:
            out.append(" ".join(line.strip() for line in paragraph.splitlines()))
    return "\n\n".join(out)


def _fields(cls: ast.ClassDef, source: str, lines: list[str]) -> list[tuple[str, str, str, str]]:
    """(name, type, default, meaning) of each annotated field of the class body, in order."""
    rows = []
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        meaning = ""
        after = body[i + 1] if i + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            meaning = _words(after.value.value)
        elif "#" in lines[node.lineno - 1]:
            meaning = lines[node.lineno - 1].split("#", 1)[1].strip()
        annotation = ast.get_source_segment(source, node.annotation) or ""
        rows.append((node.target.id, annotation, _default(node.value, source), meaning))
    return rows


def render() -> str:
    """docs/CONFIGURATION.md as it should read for the current capture/config.py."""
    source = SOURCE.read_text()
    lines = source.splitlines()
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}
    missing = [name for name in classes if name.endswith("Config") and name not in ORDER]
    if missing:
        raise SystemExit(f"scripts/config_reference.py: add {', '.join(missing)} to ORDER and WHERE")
    out = [HEADER]
    for name in ORDER:
        cls = classes[name]
        words = _words(ast.get_docstring(cls, clean=False) or "")
        where = "" if f"{name}(" in words.split("\n\n")[0] else f"{WHERE[name]}\n\n"
        out.append(f"## {name}\n\n{where}{words}\n")
        for field, annotation, default, meaning in _fields(cls, source, lines):
            item = f"- **`{field}`** = `{default}` (`{annotation}`)"
            if meaning:
                first, *rest = meaning.split("\n\n")
                item += f": {first}" + "".join(f"\n\n  {p}" for p in rest)
            out.append(item)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/CONFIGURATION.md is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = TARGET.is_file() and TARGET.read_text() == text
        if not current:
            print("docs/CONFIGURATION.md is not current: run python -m scripts.config_reference", file=sys.stderr)
        return 0 if current else 1
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
