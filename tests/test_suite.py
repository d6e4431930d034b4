"""The suite's own rules: an assertion that passes when the key it reads was never written is a test that cannot fail.

`assert a.get("k") == b.get("k")` holds when no code writes "k" (None == None), and so do `x.get("k") is None` and
`x.get("k") != value`. A test reads such a key through `helpers.written(record, "k")` (tests/helpers.py), which fails
naming the key, or asserts `"k" in record` first.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

_ABSENT = (None, False, 0, "")  # what `.get(key)` of an absent key equals or is, or what it is compared with to pass


def _reads_a_key(node: ast.AST) -> bool:
    """`x.get(key)` without a default, also as `(x.get(key) or {})` and `x.get(a).get(b)`."""
    if isinstance(node, ast.BoolOp):
        return any(_reads_a_key(value) for value in node.values)
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and len(node.args) == 1
        and not node.keywords
        and not (isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "environ")
    )


def _absent_value(node: ast.AST) -> bool:
    return (
        (isinstance(node, ast.Constant) and node.value in _ABSENT and not isinstance(node.value, float))
        or (isinstance(node, ast.Dict) and not node.keys)
        or (isinstance(node, (ast.List, ast.Tuple)) and not node.elts)
    )


def _passes_without_the_key(compare: ast.Compare) -> bool:
    if len(compare.ops) != 1:
        return False
    op, left, right = compare.ops[0], compare.left, compare.comparators[0]
    if not (_reads_a_key(left) or _reads_a_key(right)):
        return False
    other = right if _reads_a_key(left) else left
    if isinstance(op, (ast.Eq, ast.Is)):  # None == None, None is None
        return _reads_a_key(other) or _absent_value(other)
    if isinstance(op, (ast.NotEq, ast.IsNot)):  # None != "value"
        return not _absent_value(other) and not _reads_a_key(other)
    return False


def vacuous_assertions(source: str, name: str) -> list[str]:
    """`name:line: the comparison` for each assertion in `source` that holds when the key it reads is absent."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Assert):
            for compare in ast.walk(node.test):
                if isinstance(compare, ast.Compare) and _passes_without_the_key(compare):
                    found.append(f"{name}:{compare.lineno}: {ast.unparse(compare)}")
    return found


def test_no_assertion_passes_because_a_key_is_missing():
    found = [
        line
        for path in sorted(TESTS.rglob("*.py"))
        for line in vacuous_assertions(path.read_text(), path.relative_to(TESTS).as_posix())
    ]
    assert not found, "these hold when nothing writes the key; read it with helpers.written(...):\n" + "\n".join(found)


def test_the_rule_catches_the_pattern_and_leaves_sound_reads_alone():
    caught = [
        'assert a.get("k") == b.get("k")',
        'assert (a.get("c") or {}).get(key) == (b.get("c") or {}).get(key)',
        'assert a.get("k") is None',
        'assert a.get("k") != "x"',
        'assert a.get("k") == {}',
    ]
    sound = [
        'assert a.get("k") is not None',
        'assert a.get("k") == 3',
        'assert a.get("k", 0) == 0',
        'assert a["k"] == b["k"]',
        'assert os.environ.get("X") is None',
        'assert a.get("k") != None',
    ]
    assert [bool(vacuous_assertions(line, "t.py")) for line in caught] == [True] * len(caught)
    assert [bool(vacuous_assertions(line, "t.py")) for line in sound] == [False] * len(sound)
