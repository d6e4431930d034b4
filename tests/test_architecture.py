"""The import graph of the repository: three layers and no circles (docs/ARCHITECTURE.md).

Every import counts — module level, inside functions, under TYPE_CHECKING — because a cycle kept apart
only by a deferred import is still a cycle to whoever reads the code.

    top:    forensics (the public API), forensics.cli, forensics.demo.*, forensics.commands.summary, forensics.commands.catalog
    middle: capture.*  (runs in the job)      replay.*  (runs offline, one sub-package per stage)
    core:   forensics.* except the above (format, rng, errors, kinds, report, recipes ...)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("forensics", "capture", "replay")
TOP = ("forensics", "forensics.cli", "forensics.demo", "forensics.commands")


def _modules() -> dict[str, Path]:
    """Every module by its import name: the folders capture/ and replay/ are forensics.capture and forensics.replay
    (one import root: forensics/capture and forensics/replay are links to them, walked once, as the folders)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] == "forensics" and len(parts) > 1 and parts[1] in ("capture", "replay"):
                continue  # the links: the same files as the folders
            if parts[-1] == "__init__":
                parts.pop()
            if parts[0] != "forensics":
                parts.insert(0, "forensics")
            found[".".join(parts)] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The repository modules `name` imports (a `from pkg import sub` counts as importing pkg.sub)."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
    return {t for t in targets if t in modules and t != name}


def _layer(module: str) -> int:
    if module.startswith(("forensics.capture", "forensics.replay")):
        return 1
    if module in TOP or module.startswith(tuple(t + "." for t in TOP[1:])):
        return 2
    return 0


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def test_no_module_imports_a_higher_layer_and_capture_never_imports_replay():
    wrong = []
    for module, targets in _graph().items():
        for target in targets:
            if _layer(target) > _layer(module):
                wrong.append(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})")
            if module.startswith("forensics.capture") and target.startswith("forensics.replay"):
                wrong.append(f"{module} imports {target}: capture runs in the job and never imports replay")
            if module.startswith("forensics.replay") and target.startswith("forensics.capture"):
                wrong.append(f"{module} imports {target}: replay reads dumps, not the capture code")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_import_graph_has_no_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_graph_sees_the_packages():
    graph = _graph()
    assert (
        "forensics.capture.dumping.dumper" in graph
        and "forensics.format.writer" in graph["forensics.capture.dumping.dumper"]
    )
    assert "forensics.replay.engine" in graph and "forensics.cli" in graph and _layer("forensics.format.reader") == 0


# -- the trees in docs/ARCHITECTURE.md --------------------------------------------------------------
def _doc_tree(root: str) -> dict[str, str]:
    """The code block of docs/ARCHITECTURE.md that draws `root/`: {path below root: the rest of its line}."""
    lines = (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines()
    start = lines.index(f"{root}/") + 1
    entries, folders = {}, []
    for line in lines[start : lines.index("```", start)]:
        depth = next(i for i, c in enumerate(line) if c.isalnum() or c == "_") // 4 - 1
        name, _, rest = line[(depth + 1) * 4 :].partition(" ")
        folders[depth:] = [name.rstrip("/")] if name.endswith("/") else []
        entries["/".join(folders[:depth] + [name.rstrip("/")])] = rest.strip()
    return entries


def _assert_the_doc_draws(package: str) -> None:
    """docs/ARCHITECTURE.md's tree of `package/` names each of its modules and sub-packages, and no module is named
    like its sub-package."""
    drawn = _doc_tree(package)
    files = {
        p.relative_to(ROOT / package).as_posix() for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"
    }
    modules = {p for p in drawn if p.endswith(".py")}
    assert modules == files, (
        f"docs/ARCHITECTURE.md's {package}/ tree: missing {sorted(files - modules)}, "
        f"not in the code {sorted(modules - files)}"
    )
    assert {p for p in drawn if "." not in p} == {
        p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()
    }
    assert all(p.parent == ROOT / package or p.stem != p.parent.name for p in (ROOT / package).rglob("*.py")), (
        "a module named like its sub-package"
    )


def test_the_replay_tree_in_the_architecture_doc_is_the_package():
    _assert_the_doc_draws("replay")


REPLAY_STAGES = ["load", "run", "localize", "culprits", "judge"]
"""replay/'s sub-packages in the order engine.py runs them: a stage may import its own and earlier stages only."""


def test_a_replay_stage_imports_only_its_own_and_earlier_stages():
    stage = {
        name: name.split(".")[2] for name in _modules() if name.count(".") >= 3 and name.startswith("forensics.replay.")
    }
    wrong = [
        f"{module} ({stage[module]}) imports {target} ({stage[target]})"
        for module, targets in _graph().items()
        if module in stage and stage[module] in REPLAY_STAGES
        for target in targets
        if target in stage
        and stage[target] in REPLAY_STAGES
        and REPLAY_STAGES.index(stage[target]) > REPLAY_STAGES.index(stage[module])
    ]
    assert not wrong, "\n".join(sorted(wrong))
    assert set(REPLAY_STAGES) == {p.name for p in (ROOT / "replay").iterdir() if (p / "__init__.py").is_file()}


CAPTURE_STAGES = [
    "config",
    "recording",
    "state",
    "precursors",
    "detection",
    "dumping",
    "silent",
    "raised",
    "stages",
    "guard",
    "integrations",
]
"""capture/ in the order of a step's way through the Guard: the configuration every stage reads, what is recorded of the
step, the state a dump holds, the precursor statistics, the check, the dump, a step that raised, the stages built and
wired for a Guard, the Guard that runs them, and the framework adapters built on it. A sub-package (or the top-level
module config / stages / guard) may import its own and earlier stages only."""


def _capture_stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["forensics", "capture"] and len(parts) > 2 else None


def test_a_capture_stage_imports_only_its_own_and_earlier_stages():
    graph = _graph()
    stage = {name: _capture_stage(name) for name in graph if _capture_stage(name)}
    assert set(stage.values()) == set(CAPTURE_STAGES), "a capture/ module outside the stages of CAPTURE_STAGES"
    wrong = [
        f"{module} ({stage[module]}) imports {target} ({stage[target]})"
        for module, targets in graph.items()
        if module in stage
        for target in targets
        if target in stage and CAPTURE_STAGES.index(stage[target]) > CAPTURE_STAGES.index(stage[module])
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_capture_stage_holds_the_guard():
    """The stages take their inputs (configuration, state source, recorders, a `report` callable): none gets the Guard
    as `Any` or reads it through a wide Protocol (the excepthook's one-method `RecordsExceptions` is the narrowest)."""
    wrong = []
    for path in (ROOT / "capture").rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "capture/guard.py" or relative.startswith("capture/integrations/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), relative)):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "Protocol" for b in node.bases):
                members = [n for n in node.body if isinstance(n, (ast.AnnAssign, ast.FunctionDef))]
                if len(members) > 1:
                    wrong.append(f"{relative}: Protocol {node.name} has {len(members)} members")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                wrong += [
                    f"{relative}:{node.lineno}: {node.name}({a.arg}) takes the Guard"
                    for a in node.args.args + node.args.kwonlyargs
                    if a.arg == "guard"
                ]
    assert not wrong, "\n".join(wrong)


def test_the_capture_tree_in_the_architecture_doc_is_the_package():
    _assert_the_doc_draws("capture")


def test_the_forensics_tree_in_the_architecture_doc_names_each_module_and_its_layer():
    drawn = _doc_tree("forensics")
    present = {
        p.name
        for p in (ROOT / "forensics").iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").is_file()) and not p.is_symlink()  # the sides: their own trees
    }
    assert set(drawn) == present
    for name, rest in drawn.items():
        module = "forensics" if name == "__init__.py" else f"forensics.{name.removesuffix('.py')}"
        layer = "top" if _layer(module) == 2 else "core"
        assert rest.split()[0] == layer, (
            f"docs/ARCHITECTURE.md calls forensics/{name} {rest.split()[0]}, the import rules {layer}"
        )


# -- named kinds instead of strings (forensics/core/kinds.py) ------------------------------------------
KIND_HOMES = {
    "forensics/core/kinds.py",
    "forensics/format/spec.py",
    "forensics/format/reader.py",
    "forensics/format/writer.py",
    "forensics/format/manifest.py",
}
"""Where a kind's value may stand as a string: the kinds module and the format's reader / writer."""


def _kind_literals() -> set[str]:
    """The values of the kinds code branches on: trigger kinds, phases, state layouts, policies, fidelity modes,
    replayed quantities and trackers. 'exception', 'optimizer', 'precursor' and 'grad_norm' are left out: they are also
    the names of manifest / report sections, columns and state keys, spelt out in lists of names too."""
    from forensics.core.kinds import FidelityMode, Phase, Policy, ReplayedQuantity, StateLayout, Tracker, TriggerKind

    values = {
        k.value
        for kind in (TriggerKind, Phase, StateLayout, Policy, FidelityMode, ReplayedQuantity, Tracker)
        for k in kind
    }
    return values - {
        TriggerKind.EXCEPTION.value,
        TriggerKind.PRECURSOR.value,
        Phase.OPTIMIZER.value,
        StateLayout.AUTO.value,
        ReplayedQuantity.GRAD_NORM.value,
    }


_GETTERS = {"get", "pop", "setdefault"}


def _keys_of(tree: ast.AST) -> set[int]:
    """The constants that name a key (a dict literal's key, a subscript, `.get("key")`): a key may share its spelling
    with a kind (`fidelity["tolerance"]`)."""
    keys: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Subscript):
            keys.add(id(node.slice))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _GETTERS
            and node.args
        ):
            keys.add(id(node.args[0]))
    return keys


def test_no_kind_string_outside_the_kinds_module_and_the_format():
    literals, found = _kind_literals(), []
    for path in _modules().values():
        relative = path.relative_to(ROOT).as_posix()
        if relative in KIND_HOMES:
            continue
        tree = ast.parse(path.read_text(), relative)
        skipped = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)} | _keys_of(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in literals and id(node) not in skipped:
                found.append(f"{relative}:{node.lineno}: {node.value!r}")
    assert not found, "use the kind (forensics/core/kinds.py), not its string:\n" + "\n".join(found)


def test_the_architecture_kinds_table_lists_every_kind_and_member():
    import enum

    from forensics.core import kinds

    table = {}
    for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            table[cells[0].strip("`")] = cells[1]
    kinds_found = [
        k
        for k in vars(kinds).values()
        if isinstance(k, type)
        and issubclass(k, enum.Enum)
        and k.__module__ == kinds.__name__
        and not k.__name__.startswith("_")
    ]
    assert {k.__name__ for k in kinds_found} >= {"TriggerKind", "VerdictKind", "Phase", "StateLayout"}
    for kind in kinds_found:
        assert kind.__name__ in table, f"docs/ARCHITECTURE.md's kinds table lacks {kind.__name__}"
        members = {m.strip() for m in table[kind.__name__].replace(",", " ").split()}
        for member in kind:
            assert str(member.value) in members or member.name in members, (
                f"docs/ARCHITECTURE.md's kinds table lacks {kind.__name__}.{member.name}"
            )


# -- the verdict seam: one place decides the verdict and whom it blames -----------------------------------------------
def _replay_trees() -> dict[str, ast.AST]:
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text()) for p in sorted((ROOT / "replay").rglob("*.py"))}


def test_only_the_verdict_modules_decide_a_verdict_kind_or_withhold_blame():
    """Outside replay/judge/verdict*.py nothing clears the culprits the stages found (the verdict decides whom it
    blames: replay/judge/verdict.blamed_samples) nor names a verdict kind except to compare with it."""
    wrong = []
    for rel, tree in _replay_trees().items():
        if rel.startswith("replay/judge/verdict"):
            continue
        compared = {id(n) for c in ast.walk(tree) if isinstance(c, ast.Compare) for n in ast.walk(c)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Attribute) and t.attr == "culprits" for t in targets) and (
                    isinstance(node.value, ast.List) and not node.value.elts
                ):
                    wrong.append(f"{rel}:{node.lineno}: clears the culprits")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if (
                    node.func.attr in ("clear", "pop", "remove")
                    and getattr(node.func.value, "attr", None) == "culprits"
                ):
                    wrong.append(f"{rel}:{node.lineno}: takes samples out of the culprits")
            if isinstance(node, ast.Delete) and any(
                isinstance(t, ast.Subscript) and getattr(t.value, "attr", None) == "culprits" for t in node.targets
            ):
                wrong.append(f"{rel}:{node.lineno}: takes samples out of the culprits")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("Verdict", "verdict_node"):
                wrong.append(f"{rel}:{node.lineno}: builds a verdict")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "VerdictKind"
                and id(node) not in compared
            ):
                wrong.append(f"{rel}:{node.lineno}: names VerdictKind.{node.attr} other than to compare with it")
    assert not wrong, "\n".join(wrong)


def test_decide_verdict_returns_the_typed_verdict_and_the_replay_builds_the_tree_directly():
    """The replay's report is built as the tree (forensics/report/tree.py), not as a dict parsed back: parse_report is
    for reading report.json. That holds for the reports of dumps with no step to replay too (replay/judge/precursor.py,
    replay/judge/between_steps.py): their verdicts come from replay/judge/verdict_unreplayed.py."""
    import typing

    from forensics.report.tree import Verdict
    from forensics.replay.judge.verdict import decide_verdict

    assert typing.get_type_hints(decide_verdict)["return"] is Verdict
    readers = {"replay/repro.py"}  # `forensics repro --report DIR` reads a report.json back
    parsing = sorted(
        rel
        for rel, tree in _replay_trees().items()
        if rel not in readers
        and any(
            isinstance(n, (ast.Name, ast.Attribute))
            and "parse_report" in (getattr(n, "id", None), getattr(n, "attr", None))
            for n in ast.walk(tree)
        )
    )
    assert not parsing, f"parse_report on the replay path: {parsing}"


def test_assemble_places_what_the_verdict_decided():
    """Which found samples are named triggers and where the tested remedies go are the verdict's decisions
    (replay/judge/verdict.marks_triggers, and decide_verdict from the remedies block in its facts): assemble.py reads
    no verdict kind to decide them, nor orders the remedies itself."""
    tree = _replay_trees()["replay/judge/assemble.py"]
    names = {getattr(n, "id", None) for n in ast.walk(tree)} | {getattr(n, "attr", None) for n in ast.walk(tree)}
    assert "VerdictKind" not in names and "tested_suggestions" not in names
    assert {"marks_triggers", "decide_verdict"} <= names


VERDICT_FIELDS = {"kind", "headline", "explanation", "suggestions"}


def _verdict_edits(tree: ast.AST) -> list[tuple[int, str]]:
    """Where `tree` edits a verdict after it was built: assigns (or adds) to a field of something named `verdict`
    (`verdict.headline = ...`, `report.verdict.suggestions += ...`), replaces the report's verdict, rebuilds one
    with dataclasses.replace, or appends / inserts into its suggestions."""

    def names_a_verdict(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and "verdict" in node.id.lower()) or (
            isinstance(node, ast.Attribute) and node.attr == "verdict"
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and (
                    (target.attr in VERDICT_FIELDS and names_a_verdict(target.value))
                    or (target.attr == "verdict" and not isinstance(node, ast.AnnAssign))
                ):
                    found.append((node.lineno, f"assigns {ast.unparse(target)}"))
        if isinstance(node, ast.Call):
            func = node.func
            if (
                getattr(func, "attr", getattr(func, "id", None)) == "replace"
                and node.args
                and names_a_verdict(node.args[0])
                and any(k.arg in VERDICT_FIELDS for k in node.keywords)
            ):
                found.append((node.lineno, f"rebuilds {ast.unparse(node.args[0])} with replace"))
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("append", "insert", "extend", "remove", "clear")
                and isinstance(func.value, ast.Attribute)
                and func.value.attr == "suggestions"
            ):
                found.append((node.lineno, f"changes {ast.unparse(func.value)}"))
    return found


def test_nothing_outside_the_verdict_modules_edits_a_verdict():
    """A verdict is decided and worded once, in replay/judge/verdict*.py, from facts handed to it (issue 54): the
    window replay, the host snapshot and the history before the crash are facts of decide_verdict's context
    (replay/judge/verdict_context.py), not sentences added to its verdict afterwards. No module outside the verdict
    modules assigns to a verdict's fields, rebuilds one with dataclasses.replace, or edits its suggestions."""
    wrong = []
    trees = _replay_trees()
    for package in ("forensics", "capture"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if not path.is_symlink() and not any(p.is_symlink() for p in path.parents if ROOT in p.parents):
                trees.setdefault(path.relative_to(ROOT).as_posix(), ast.parse(path.read_text()))
    for rel, tree in trees.items():
        if rel.startswith("replay/judge/verdict"):
            continue
        wrong += [f"{rel}:{line}: {what}" for line, what in _verdict_edits(tree)]
    assert not wrong, "a verdict edited after it was decided:\n" + "\n".join(wrong)


def test_the_verdict_edit_check_sees_each_kind_of_edit():
    """The check above finds each way of editing a verdict (it would pass vacuously otherwise)."""
    source = """
report.verdict.suggestions = [hint, *(report.verdict.suggestions or [])]
verdict.explanation += " Replay them."
verdict.headline = prefix + verdict.headline
report.verdict = dataclasses.replace(report.verdict, headline="x")
v2 = replace(verdict, explanation="y")
report.verdict.suggestions.append("z")
"""
    assert sorted(line for line, _ in _verdict_edits(ast.parse(source))) == [2, 3, 4, 5, 5, 6, 7]


def test_the_verdict_docstring_lists_every_rule():
    """Every return of decide_verdict's rules (replay/judge/verdict._by_rule) is a row of the module docstring's
    first table, in order, naming the builder that words it: a rule added without its row fails here."""
    import forensics.replay.judge.verdict as verdict

    tree = ast.parse((ROOT / "replay/judge/verdict.py").read_text())
    rules = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_by_rule")
    builders = [
        node.value.func.id
        for node in ast.walk(rules)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
    ]
    returns = [n for n in ast.walk(rules) if isinstance(n, ast.Return)]
    assert len(builders) == len(returns), "each rule returns its builder's verdict"
    doc = verdict.__doc__ or ""
    table = doc[: doc.index("The samples bisection found")]
    rows = [line for line in table.splitlines() if line.startswith("|") and "`" in line and "---" not in line]
    named = [line.split("|")[2].strip().strip("`").split("`")[0] for line in rows]
    assert named == _in_order(rules), f"the docstring's rules {named} are not decide_verdict's returns"


def _in_order(function: ast.FunctionDef) -> list[str]:
    """The builders `function` returns, in source order."""
    returns = sorted((n for n in ast.walk(function) if isinstance(n, ast.Return)), key=lambda n: n.lineno)
    return [n.value.func.id for n in returns if isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)]


def test_each_verdict_builder_words_one_kind_and_hands_no_decision_to_another():
    """The kind is decided once: by decide_verdict's rules for a replayed step (replay/judge/verdict.py), by the dump's
    trigger for a dump with no step to replay. A builder (verdict_state.py, verdict_data.py, verdict_unreplayed.py,
    verdict_silent.py) words the one kind it names and never returns another builder's verdict — a branch there
    would be a rule missing from verdict.py's table (issue 54: `exception_verdict` and `not_reproduced` did)."""
    modules = ("verdict_state", "verdict_data", "verdict_unreplayed", "verdict_silent")
    trees = {m: ast.parse((ROOT / f"replay/judge/{m}.py").read_text()) for m in modules}
    builders = {
        f.name
        for tree in trees.values()
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and f.returns is not None and "Verdict" in ast.unparse(f.returns)
    }
    wrong = []
    for module, tree in trees.items():
        for function in (f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in builders):
            kinds = {
                ast.unparse(call.args[0])
                for call in ast.walk(function)
                if isinstance(call, ast.Call)
                and getattr(call.func, "id", None) in ("verdict_node", "verdict_of")
                and call.args
            }
            if len(kinds) > 1:
                wrong.append(f"{module}.{function.name} words {sorted(kinds)}")
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Return)
                    and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", None) in builders
                ):
                    wrong.append(f"{module}.{function.name} returns {node.value.func.id}'s verdict")
    assert builders and not wrong, "\n".join(wrong)
