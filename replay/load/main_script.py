"""Define a loss or model factory from the training script a dump holds, without running the script's training.

A function of the job's `__main__` (`python train.py`) cannot be imported: importing `train` runs the whole
script again, and most scripts train at top level, with no `if __name__ == "__main__":` guard. The dump holds
the script's source (`main_script.py`, capture/dumping/main_script.py); behind --trust, this module parses it and
runs only the statements that define things — imports, `def`, `class`, assignments of constants (literals,
names, attribute reads and arithmetic on them) to the module's own names, and `try` blocks made of those — in a
fresh module whose `__name__` is not "__main__". Everything else (calls at top level, loops, `with`,
`model = GPT(...)`, `torch.backends.cudnn.benchmark = True`, the main guard's body) is left out. What runs can
still run any code — an import's side effects, a decorator, a default value, a class body, a base class
expression — which is what --trust consents to (TRUST_NOTE). The globals the function read in the job, as the dump
recorded them (`recipe.script.globals`: nanoGPT's configurator values, `ddp_world_size`), are defined before the
script's definitions run and again after them, so the job's values win over the script's defaults; a constant
assignment that reads a name nothing defines here is skipped. A constant assignment is not run but evaluated here
(`literal_value`): literals, containers of them, names and module attributes that hold such plain values, and
arithmetic, comparisons and f-strings on plain values only, within size limits — an operator or a format of any other
object (one whose class the script or an import defines) would run its code, so such an assignment is skipped too. When the function needs a name that only left-out code
defines and the dump holds no value of, nothing is run and the error says what to pass instead.
"""

from __future__ import annotations

import ast
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from forensics.core.errors import RecipeError
from forensics.report.wording import clean

TRUST_NOTE = (
    "its imports, decorators, default values and class bodies can run any code: trust the dump as you would the script"
)
"""What defining a function from the recorded script runs, in the words the --trust refusal uses."""
MODULE_NAME = "forensics_training_script"  # __name__ of the module the script's definitions run in
STATIC_EXPRESSIONS = (
    ast.Constant,
    ast.Name,
    ast.Attribute,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Dict,
    ast.UnaryOp,
    ast.BinOp,
    ast.BoolOp,
    ast.Compare,
    ast.Subscript,
    ast.Slice,
    ast.Load,
    ast.operator,
    ast.unaryop,
    ast.boolop,
    ast.cmpop,
    ast.JoinedStr,
    ast.FormattedValue,
)


def _static(node: ast.AST | None) -> bool:
    """An expression that computes nothing of consequence: no call, no lambda, no comprehension."""
    return node is None or all(isinstance(n, STATIC_EXPRESSIONS) for n in ast.walk(node))


def _names_only(target: ast.expr) -> bool:
    """An assignment target that binds names of the script's module only (`x`, `a, (b, *c)`): never an attribute
    or item of another object (`torch.backends.cudnn.benchmark = True`, `os.environ["X"] = ...`)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return all(_names_only(t) for t in target.elts)
    if isinstance(target, ast.Starred):
        return _names_only(target.value)
    return isinstance(target, ast.Name)


def defines_only(node: ast.stmt) -> bool:
    """The statement only defines names: run at replay."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Pass)):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)  # a docstring
    if isinstance(node, ast.Assign):
        return _static(node.value) and all(_names_only(t) for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return _static(node.value) and _static(node.annotation) and _names_only(node.target)
    if isinstance(node, ast.Try):
        blocks = [node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)]
        return all(defines_only(s) for block in blocks for s in block)
    return False


def _bound(nodes: list[ast.stmt]) -> set[str]:
    """Names the statements bind at module level (assignment targets, defs, imports, loop variables ...)."""
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names.add(sub.id)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in sub.names)
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(sub.name)
    return names


def _needed(definitions: Mapping[str, ast.stmt], start: str) -> set[str]:
    """The module-level names `start` reads, following the script's own functions and classes it uses."""
    seen, todo, needed = set(), [start], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in definitions:
            continue
        seen.add(name)
        nodes = list(ast.walk(definitions[name]))
        local = {n.arg for n in nodes if isinstance(n, ast.arg)} | {
            n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
        for sub in nodes:
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in local:
                needed.add(sub.id)
                todo.append(sub.id)
    return needed


def _refusal(names: list[str], unrecorded: dict[str, str], script: str) -> str:
    shown = []
    for name in names[:8]:
        kind = unrecorded.get(name)
        shown.append(
            f"`{clean(name, 60)}` (a {clean(kind, 60)}: not a JSON value, so the dump holds none)"
            if kind
            else f"`{clean(name, 60)}`"
        )
    return (
        f"{', '.join(shown)}, which {script} sets in top-level code that replay does not run (calls, loops, "
        "`if` blocks, exec'd files) and the dump recorded no value of"
    )


def define_from_script(
    source: bytes,
    qualname: str,
    script_name: str,
    what: str,
    flag: str,
    recorded: dict[str, Any] | None = None,
    unrecorded: dict[str, str] | None = None,
) -> tuple[Any, list[str]]:
    """The object `qualname` of the script, defined by running only its definitions (see the module docstring).

    Args:
        recorded: the job's values of the globals the function reads (manifest `recipe.script.globals`).
        unrecorded: the globals it reads whose values were not JSON: name -> type name (for the refusal).
    Returns:
        (the callable, the recorded globals it uses: what the report says was defined from the dump).
    Raises:
        RecipeError: the script does not parse, does not define `qualname`, or `qualname` needs names that only
            code left out (training, building objects) defines; the message says what to pass instead.
    """
    shown, script = clean(qualname, 100), clean(script_name, 100)
    instead = move_instruction(qualname, script_name, flag)
    try:  # bytes: Python's own rules for a BOM and a coding line (PEP 263)
        tree = ast.parse(source, filename=script_name)
    except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
        raise RecipeError(
            f"the training script {script} recorded in the dump does not parse ({type(exc).__name__}); {instead}"
        ) from exc
    except (RecursionError, MemoryError):  # the parser's own guards against deep nesting
        raise RecipeError(
            f"the training script {script} recorded in the dump is nested too deep to parse; {instead}"
        ) from None
    kept = [node for node in tree.body if defines_only(node)]
    left_out = [node for node in tree.body if not defines_only(node)]  # the main guard too: it may set a global
    top = qualname.split(".")[0]
    definitions = {
        node.name: node for node in kept if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    if top not in definitions:
        raise RecipeError(
            f"the training script {script} recorded in the dump defines no function `{shown}` at its top "
            f"level; {instead}"
        )
    recorded, unrecorded = dict(recorded or {}), dict(unrecorded or {})
    needed = _needed(definitions, top)
    missing = sorted((needed & _bound(left_out)) - _bound(kept) - set(recorded))
    if missing:
        raise RecipeError(f"the {what} `{shown}` uses {_refusal(missing, unrecorded, script)}; {instead}")
    module = types.ModuleType(MODULE_NAME)
    module.__file__ = f"<{script} recorded in the dump>"
    sys.modules[MODULE_NAME] = module  # dataclasses and pickling look the module up by name
    module.__dict__.update(recorded)
    skipped: set[str] = set()
    for node in kept:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):  # evaluated here, never run
            if not _assign_literal(node, module.__dict__):
                skipped |= _bound([node])
            continue
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), module.__file__, "exec"), module.__dict__)  # noqa: S102
        except NameError:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                raise RecipeError(
                    f"defining `{shown}` from the training script {script} needs a name its top-level "
                    f"code sets at line {node.lineno}; {instead}"
                ) from None
            skipped |= _bound([node])  # `tokens_per_iter = batch * ddp_world_size`: ddp_world_size unknown here
        except Exception as exc:  # the script's imports or definitions failing here is the user's to fix
            raise RecipeError(
                f"defining `{shown}` from the training script {script} raised {type(exc).__name__}: "
                f"{clean(str(exc), 300)}; {instead}"
            ) from exc
    module.__dict__.update(recorded)  # the job's values win over the script's defaults (a configurator changed them)
    unset = sorted((needed & skipped) - set(module.__dict__))
    if unset:
        raise RecipeError(f"the {what} `{shown}` uses {_refusal(unset, unrecorded, script)}; {instead}")
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise RecipeError(f"`{shown}` in the training script {script} is not callable; {instead}")
    return obj, sorted(needed & set(recorded))


class NotLiteral(Exception):
    """An expression `literal_value` does not evaluate: it would run code of some object, or grow too large."""


PLAIN = (int, float, complex, str, bytes, bool, type(None))
MAX_BITS = 1 << 16  # an int computed here: 65,536 bits (a 2 ** 65536 or a shift beyond: not a setting, skipped)
MAX_ITEMS = 1 << 20  # a str / bytes / tuple computed here: a million items


def _plain(value: Any) -> bool:
    """A value whose operators are Python's own: None, numbers, strings, and tuples / lists / sets / dicts of them."""
    if isinstance(value, PLAIN):
        return type(value) in PLAIN  # not a subclass, whose operators the script may define
    if type(value) in (tuple, list, set, frozenset):
        return len(value) <= MAX_ITEMS and all(_plain(v) for v in value)
    if type(value) is dict:
        return len(value) <= MAX_ITEMS and all(_plain(k) and _plain(v) for k, v in value.items())
    return False


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
    ast.LShift: lambda a, b: a << b,
    ast.RShift: lambda a, b: a >> b,
    ast.BitOr: lambda a, b: a | b,
    ast.BitAnd: lambda a, b: a & b,
    ast.BitXor: lambda a, b: a ^ b,
}
_UNARY: dict[type, Callable[[Any], Any]] = {
    ast.UAdd: lambda a: +a,
    ast.USub: lambda a: -a,
    ast.Not: lambda a: not a,
    ast.Invert: lambda a: ~a,
}
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
}


def _bounded(value: Any) -> Any:
    if (
        isinstance(value, int)
        and value.bit_length() > MAX_BITS
        or isinstance(value, (str, bytes, tuple, list))
        and len(value) > MAX_ITEMS
    ):
        raise NotLiteral("too large")
    return value


def _binary(op: ast.operator, a: Any, b: Any) -> Any:
    """`a op b` on plain values, refused before it computes something huge (2 ** 10 ** 10, "x" * 10 ** 12)."""
    if (
        isinstance(op, ast.Pow)
        and isinstance(a, int)
        and isinstance(b, int)
        and abs(a) > 1
        and b * max(abs(a).bit_length(), 1) > MAX_BITS
    ):
        raise NotLiteral("too large")
    if isinstance(op, ast.LShift) and isinstance(b, int) and b > MAX_BITS:
        raise NotLiteral("too large")
    if (
        isinstance(op, ast.Mult)
        and any(isinstance(x, (str, bytes, tuple, list)) for x in (a, b))
        and any(isinstance(x, int) and x * len(y) > MAX_ITEMS for x, y in ((a, b), (b, a)) if hasattr(y, "__len__"))
    ):
        raise NotLiteral("too large")
    return _bounded(_BINARY[type(op)](a, b))


def literal_value(node: ast.expr, names: Mapping[str, Any]) -> Any:
    """The value of a constant expression of the script, computed here without running any code of the script or
    its imports: literals and containers of them; names (of `names`) and module attributes (read from the module's
    own dict: no __getattr__, no descriptor) holding plain values; arithmetic, comparisons, `and` / `or`, subscripts
    and f-strings (without format specs) on plain values. Raises NotLiteral for anything else."""

    def value(n: ast.expr) -> Any:
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.Name):
            if n.id not in names or not _plain(names[n.id]):
                raise NotLiteral(n.id)
            return names[n.id]
        if isinstance(n, ast.Attribute):
            owner = n.value.id if isinstance(n.value, ast.Name) else None
            module = names.get(owner) if owner is not None else None
            if not isinstance(module, types.ModuleType) or not _plain(vars(module).get(n.attr, object())):
                raise NotLiteral(ast.dump(n)[:60])
            return vars(module)[n.attr]
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
            items = [value(e) for e in n.elts]
            return tuple(items) if isinstance(n, ast.Tuple) else items if isinstance(n, ast.List) else set(items)
        if isinstance(n, ast.Dict) and None not in n.keys:
            return {value(k): value(v) for k, v in zip(n.keys, n.values) if k is not None}
        if isinstance(n, ast.UnaryOp):
            return _bounded(_UNARY[type(n.op)](value(n.operand)))
        if isinstance(n, ast.BinOp):
            return _binary(n.op, value(n.left), value(n.right))
        if isinstance(n, ast.BoolOp):
            result = value(n.values[0])
            for other in n.values[1:]:
                if (not result) if isinstance(n.op, ast.Or) else result:
                    result = value(other)
            return result
        if isinstance(n, ast.Compare):
            left = value(n.left)
            for op, right_node in zip(n.ops, n.comparators):
                right = value(right_node)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(n, ast.Subscript) and not isinstance(n.slice, ast.Slice):
            return value(n.value)[value(n.slice)]
        if isinstance(n, ast.JoinedStr):
            parts = []
            for part in n.values:
                if isinstance(part, ast.FormattedValue) and part.format_spec is None:
                    shown = value(part.value)
                    convert: Callable[[Any], str] = {114: repr, 97: ascii}.get(part.conversion, str)  # !r !a
                    parts.append(convert(shown))
                elif isinstance(part, ast.Constant):
                    parts.append(str(part.value))
                else:
                    raise NotLiteral("a format spec")
            return _bounded("".join(parts))
        raise NotLiteral(type(n).__name__)

    try:
        result = value(node)
    except (
        NotLiteral,
        ArithmeticError,
        TypeError,
        ValueError,
        KeyError,
        IndexError,
        RecursionError,
        MemoryError,
    ) as exc:
        raise NotLiteral(str(exc)[:60]) from None
    if not _plain(result):
        raise NotLiteral("not a plain value")
    return result


def _assign_literal(node: ast.Assign | ast.AnnAssign, namespace: dict[str, Any]) -> bool:
    """Binds the targets of a constant assignment to its `literal_value` (its annotation is not evaluated); False,
    binding nothing, when the value is not one."""
    if node.value is None:
        return True  # `x: int` binds nothing
    try:
        result = literal_value(node.value, namespace)
        bound: dict[str, Any] = {}
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            _bind(target, result, bound)
    except NotLiteral:
        return False
    namespace.update(bound)
    return True


def _bind(target: ast.expr, value: Any, out: dict[str, Any]) -> None:
    """`target = value` for the name targets `_names_only` allows (`x`, `a, (b, *c)`), into `out`."""
    if isinstance(target, ast.Name):
        out[target.id] = value
        return
    if not isinstance(target, (ast.Tuple, ast.List)) or not isinstance(value, (tuple, list)):
        raise NotLiteral("cannot unpack")
    starred = [i for i, t in enumerate(target.elts) if isinstance(t, ast.Starred)]
    if not starred and len(value) != len(target.elts) or starred and len(value) < len(target.elts) - 1:
        raise NotLiteral("cannot unpack")
    if not starred:
        for t, v in zip(target.elts, value):
            _bind(t, v, out)
        return
    at = starred[0]
    after = len(target.elts) - at - 1
    for t, v in zip(target.elts[:at], value[:at]):
        _bind(t, v, out)
    star = target.elts[at]
    _bind(star.value if isinstance(star, ast.Starred) else star, list(value[at : len(value) - after]), out)
    for t, v in zip(target.elts[at + 1 :], value[len(value) - after :]):
        _bind(t, v, out)


def move_instruction(qualname: str, script_name: str, flag: str) -> str:
    """What to do instead: 'move `lm_loss` (and what it uses) from train.py into a module, e.g. train_lib.py beside
    it, and replay with --loss train_lib:lm_loss --path DIR_OF_THAT_MODULE'. Never an import of the script."""
    shown, script = clean(qualname, 100), clean(script_name, 100)
    stem = script_name.removesuffix(".py") if script_name.endswith(".py") else "training"
    module = ("".join(ch if ch.isalnum() or ch == "_" else "_" for ch in stem) or "training") + "_lib"
    return (
        f"move `{shown}` (and what it uses) from {script} into a module, e.g. {module}.py beside it, and replay "
        f"with {flag} {module}:{shown} --path DIR_OF_THAT_MODULE"
    )
