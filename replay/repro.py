"""`forensics repro DUMP -o DIR`: a standalone reproduction of a dump's failure, for whoever must fix it.

Two scripts, each failing (an AssertionError, exit code 1) for as long as the bug is there:

* `op_repro.py` — the first non-finite ATen op, as replay's forward localisation finds it
  (replay/localize/forward_backward.py, `keep_op_inputs`), called on its exact input tensors
  (`op_inputs.safetensors`, read by the script itself: it needs only torch). The inputs are shrunk first: along
  each dimension of the output, the slice that holds a non-finite value is kept wherever the op still makes
  NaN/Inf from the sliced inputs (the one row / sample of a batched op). Written only when the failure shows up
  in the forward pass as an op's output.
  A step that raised (trigger `exception`: a token id past the vocabulary) gets the op that raised, called on its
  inputs for the culprit sample alone; the script fails while the op still raises.
* `model_repro.py` — the culprit sample (the first sample of the failing micro-batch that fails alone) run through
  the model's recorded pre-step state from the dump, under the job's autocast and RNG. When every sample fails
  alone (the weights themselves are broken: a learning-rate divergence), no sample is to blame: the script runs the
  whole micro-batch and its assertion says so. It needs the model's code: it imports the factory and loss the dump's
  recipe names (as `forensics replay` does, with the --trust that `forensics repro` was given), and forensics to
  read the dump.

The scripts run from any directory: the dump's path and the --path entries are stored relative to the scripts'
own directory and absolute (model.json), never as the working directory of whoever wrote them; a copy of the
directory elsewhere finds the dump where it was, and `model_repro.py --dump PATH` names a moved one. A dump not
found is one line and exit code 3 (1 is the reproduced failure's).

Nothing from the dump reaches a path or the scripts' code: file names are this module's own, the scripts are
fixed text, and what varies (op name, sample ID, dump path) is in `op.json` / `model.json`, read with json.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from forensics.core.errors import ReplayError
from forensics.format.location import Location, RemotePath, as_location
from forensics.format import open_dump
from forensics.format.tensors import safetensors_bytes
from forensics.core.kinds import Phase, TriggerKind
from forensics.core.fsio import atomic_file, atomic_write_text
from forensics.core.thirdparty import op_schema, tree_flatten, tree_map
from forensics.replay.load.samples import SampleRef
from forensics.replay.load.session import load_session
from forensics.replay.judge.history_pattern import diverged_long_ago, read_history
from forensics.replay.localize.exception import localize_exception
from forensics.replay.localize.forward_backward import localize_forward
from forensics.replay.run.execute import StepRunner
from forensics.replay.run.streamed_runner import runner_for

log = logging.getLogger(__name__)

OP_SCRIPT, OP_SPEC, OP_INPUTS = "op_repro.py", "op.json", "op_inputs.safetensors"
MODEL_SCRIPT, MODEL_SPEC = "model_repro.py", "model.json"
MAX_SAMPLE_TRIES = 64  # samples run alone to find the culprit of the failing micro-batch
SHRINK_ROUNDS = 4  # passes over the output's dimensions while slicing still keeps the failure
MAX_OP_INPUT_BYTES = (
    1 << 30
)  # op_inputs.safetensors larger than this (an op the shrinking could not cut) is not written


@dataclass
class Repro:
    """What `write_repro` wrote."""

    directory: Path
    files: dict[str, str] = field(default_factory=dict)
    """{"op_script", "op_inputs", "model_script"...: path}."""
    op: str | None = None
    """The op `op_repro.py` calls, e.g. 'aten::log'."""
    shrunk: dict | None = None
    """{"from": [shapes], "to": [shapes]} of the op's tensor inputs."""
    sample: Any = None
    notes: list[str] = field(default_factory=list)
    """Why a part was not written."""

    def as_dict(self) -> dict:
        return {
            "directory": str(self.directory),
            "files": dict(self.files),
            "op": self.op,
            "shrunk": self.shrunk,
            "sample": self.sample,
            "notes": list(self.notes),
        }


def write_repro(
    dump_path: str | Path | Location,
    out_dir: str | Path,
    *,
    device: str | None = "cpu",
    trust: bool = False,
    factory: str | None = None,
    loss: str | None = None,
    sys_path: list[str] | None = None,
    rank: int | None = None,
    factory_kwargs: dict | None = None,
    loss_kwargs: dict | None = None,
) -> Repro:
    """Writes `op_repro.py` (+ its inputs) and `model_repro.py` for the dump at `dump_path` into `out_dir`.

    Args:
        dump_path: the dump (rank dir, step dir or .tar.zst; on disk or at a URL, which the scripts then read).
        out_dir: where the scripts go (created before the model is loaded: an unwritable one fails first).
        device, trust, factory, loss, sys_path, rank, factory_kwargs, loss_kwargs: as for `forensics replay`.
    Returns:
        Repro: the files written, and notes on what could not be.
    Raises:
        ReplayError: the dump's step does not fail in the forward or backward on replay (or is a precursor dump, or
            raised between steps).
        OSError: `out_dir` cannot be made.
    Example:
        >>> write_repro("dumps/run/step-000000042", "repro")  # doctest: +SKIP
    """
    out = Path(out_dir)
    dump = open_dump(dump_path, rank=rank)
    kind = dump.trigger.kind
    if kind is TriggerKind.PRECURSOR:
        raise ReplayError(
            f"step {dump.step} is a precursor dump: a healthy step, dumped because per-layer statistics "
            "kept growing, before anything failed: nothing to reproduce standalone. `forensics replay` "
            "ranks the statistics that grew; run `forensics repro` on the crash dump that follows"
        )
    exception = dump.manifest.get("exception") or {}
    if kind is TriggerKind.EXCEPTION and exception.get("during") == Phase.BETWEEN_STEPS.value:
        raise ReplayError(
            f"step {dump.step} raised between steps (data loading or your code after the update): there "
            "is no model step to reproduce standalone; `forensics replay` names the exception and your "
            "line of code"
        )
    out.mkdir(parents=True, exist_ok=True)  # before the model loads: an unwritable one fails now
    session = load_session(
        dump,
        device=device,
        trust=trust,
        factory=factory,
        loss=loss,
        sys_path=sys_path or [],
        factory_kwargs=factory_kwargs,
        loss_kwargs=loss_kwargs,
    )
    runner = runner_for(session)  # a state that does not fit the GPU is streamed (replay/run/streamed_runner.py)
    repro = Repro(out)
    if kind is TriggerKind.EXCEPTION:
        refs, blamed = _exception_culprit(repro, runner, dump.step, exception)
    else:
        finding = localize_forward(runner, keep_op_inputs=True)
        if finding is not None and finding.op_call is not None:
            _write_op(repro, *finding.op_call)
        else:
            repro.notes.append(
                "no ATen op made the first non-finite value in the forward pass (the batch held it, or "
                "it appears in the backward): no op-level script"
            )
        culprit = _culprit_samples(runner, finding)
        if culprit is None:
            raise ReplayError(
                f"step {dump.step} stays finite in a forward-only replay: nothing to reproduce "
                f"standalone ({_finite_kind(kind)}: see `forensics replay`)"
            )
        refs, blamed = culprit
    why_no_sample = None if kind is TriggerKind.EXCEPTION else _diverged_before(dump)
    if why_no_sample is not None and blamed:  # as replay's verdict: the run, not this step's data
        refs, blamed = [r for r in session.sample_refs if r.micro_batch == refs[0].micro_batch], False
    if not blamed:
        why_no_sample = why_no_sample or "every sample of it fails alone: the weights, not a sample"
        repro.notes.append(f"no sample is to blame ({why_no_sample}): model_repro.py runs the whole micro-batch")
    spec = {
        "factory_override": factory,
        "loss_override": loss,
        "factory_kwargs": factory_kwargs,
        "loss_kwargs": loss_kwargs,
        "raises": kind is TriggerKind.EXCEPTION,
        "why_no_sample": why_no_sample,
    }
    _write_model(repro, as_location(dump_path), dump, session, refs, blamed, device, trust, sys_path or [], spec)
    atomic_write_text(out / "repro.json", json.dumps(repro.as_dict(), indent=2, default=repr))
    return repro


def link_report(report_dir: str | Path, repro: Repro) -> dict:
    """Adds the `repro` block to the report in `report_dir` (written by `forensics replay -o`) and rewrites its
    files, so report.json / report.md / report.html link the scripts. Returns the files written."""
    from forensics.report import parse_report, write_report_files
    from forensics.report.model import load_report
    from forensics.report.tree import Repro as ReproBlock

    report = parse_report(load_report(report_dir))
    report.repro = ReproBlock.parse(repro.as_dict())
    return write_report_files(report, report_dir)


# -- the op ------------------------------------------------------------------------------------------
def _fails(func: Any, args: tuple, kwargs: dict) -> bool:
    try:
        out = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a slice the op does not accept is simply not a smaller repro
        return False
    result = out[0] if isinstance(out, (tuple, list)) else out
    return isinstance(result, torch.Tensor) and result.is_floating_point() and not bool(torch.isfinite(result).all())


def _cut(value: Any, rank: int, dim: int, size: int, at: int) -> Any:
    """A tensor of `rank` dimensions whose `dim` has `size` elements, cut to its slice `at` (a copy)."""
    if isinstance(value, torch.Tensor) and value.dim() == rank and value.shape[dim] == size:
        return value.narrow(dim, at, 1).clone()
    return value


def shrink(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Smaller inputs that still make the op's output non-finite: along each output dimension, every input whose
    same dimension has the output's size is cut to the slice holding the first non-finite output value; a cut is
    kept only when the op still fails on it."""
    for _ in range(SHRINK_ROUNDS):
        changed = False
        out = func(*args, **kwargs)
        result = out[0] if isinstance(out, (tuple, list)) else out
        for dim in range(result.dim()):
            size = result.shape[dim]
            if size <= 1:
                continue
            bad = (~torch.isfinite(result)).nonzero()
            if not len(bad):
                break
            cut = functools.partial(_cut, rank=result.dim(), dim=dim, size=size, at=int(bad[0, dim]))
            smaller_args, smaller_kwargs = tree_map(cut, args), tree_map(cut, kwargs)
            if _fails(func, smaller_args, smaller_kwargs):
                args, kwargs, changed = smaller_args, smaller_kwargs, True
                out = func(*args, **kwargs)
                result = out[0] if isinstance(out, (tuple, list)) else out
        if not changed:
            break
    return args, kwargs


class _Unwritable(Exception):
    """An op argument that JSON and safetensors cannot carry (then no op-level script is written)."""


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """An op argument as JSON: tensors by a name of ours in `tensors`, dtypes / devices / layouts by name."""
    if isinstance(value, torch.Tensor):
        name = f"input_{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous()
        return {"tensor": name}
    if isinstance(value, (list, tuple)):
        return {"list": [_encode(v, tensors) for v in value], "tuple": isinstance(value, tuple)}
    if isinstance(value, dict):
        return {"dict": {str(k): _encode(v, tensors) for k, v in value.items()}}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": "cpu"}
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {"torch": str(value).removeprefix("torch.")}
    raise _Unwritable(type(value).__name__)


def _write_op(repro: Repro, func: Any, args: tuple, kwargs: dict, raised: str | None = None) -> None:
    """The op script: `raised` ("IndexError: ...") for an op that raised (its inputs are one sample's: not shrunk),
    else an op whose output is non-finite (its inputs shrunk)."""
    schema = op_schema(func)
    namespace, _, name = schema.name.partition("::")
    overload = schema.overload_name or "default"
    before = [list(t.shape) for t in _tensors((args, kwargs))]
    if raised is None:
        try:
            args, kwargs = shrink(func, args, kwargs)
        except Exception:  # the full inputs are a repro too
            log.warning(
                "forensics repro: shrinking the inputs of %s failed; writing them whole", schema.name, exc_info=True
            )
    tensors: dict[str, torch.Tensor] = {}
    try:
        spec = {
            "namespace": namespace,
            "name": name,
            "overload": overload,
            "op": schema.name,
            "args": _encode(args, tensors),
            "kwargs": _encode(kwargs, tensors),
            "raised": raised,
        }
    except _Unwritable as exc:
        repro.notes.append(f"{schema.name} takes an argument of type {exc} that cannot be written: no op-level script")
        return
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > MAX_OP_INPUT_BYTES:
        repro.notes.append(
            f"the inputs of {schema.name} are {size} bytes even after shrinking, over the "
            f"{MAX_OP_INPUT_BYTES} bytes written: no op-level script"
        )
        return
    out = repro.directory
    with atomic_file(out / OP_INPUTS, binary=True) as handle:
        handle.write(safetensors_bytes(tensors))
    atomic_write_text(out / OP_SPEC, json.dumps(spec, indent=1))
    atomic_write_text(out / OP_SCRIPT, OP_TEMPLATE)
    repro.op = schema.name
    repro.shrunk = {"from": before, "to": [list(t.shape) for t in tensors.values()]}
    repro.files.update(op_script=str(out / OP_SCRIPT), op_inputs=str(out / OP_INPUTS), op_spec=str(out / OP_SPEC))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


# -- the sample through the model -------------------------------------------------------------------
def _culprit_samples(runner: StepRunner, finding: Any) -> tuple[list[SampleRef], bool] | None:
    """(the samples model_repro.py runs, whether one sample is to blame): the first sample of the failing micro-batch
    that fails alone — unless every sample fails alone (broken weights: the whole micro-batch, no sample blamed) or
    none does (they fail only together: the whole micro-batch). None when the forward of the whole step is finite."""
    if finding is None:
        return None
    refs = runner.session.sample_refs
    index = (
        finding.micro_batch
        if finding.micro_batch is not None
        else next(
            (
                mb
                for mb in range(len(runner.session.micro_batches))
                if not runner.run([r for r in refs if r.micro_batch == mb], backward=False).loss_finite
            ),
            0,
        )
    )
    batch_refs = [r for r in refs if r.micro_batch == index]
    return _first_alone(
        batch_refs,
        [r for r in refs if r.micro_batch != index],
        lambda ref: not runner.run([ref], backward=False).loss_finite,
    )


def _finite_kind(kind: TriggerKind) -> str:
    """What a dump whose forward stays finite is, in words: a spike is a finite value, never a failure of the
    gradients or the optimizer."""
    if kind is TriggerKind.LOSS_SPIKE:
        return "a loss spike: the loss stays finite, and `forensics replay` finds the samples that make it spike"
    if kind is TriggerKind.GRAD_NORM_SPIKE:
        return "a grad-norm spike: the gradients stay finite, and `forensics replay` finds what makes them large"
    return "a failure of the gradients or the optimizer update"


def _diverged_before(dump: Any) -> str | None:
    """Why no sample of the step is to blame although one fails alone: the loss had left its start before the dumped
    step (a learning rate too high: replay's verdict says so too, and names no sample). None otherwise."""
    try:
        history = dump.history()
    except Exception:  # noqa: BLE001 - a damaged optional part: judge the step alone
        return None
    if not history:
        return None
    onset = read_history(history, dump.step).onset
    if onset is not None and onset < dump.step:
        return f"the loss had left its start at step {onset}, before step {dump.step}: the run diverged"
    return diverged_long_ago(history)


def _first_alone(batch_refs: list[SampleRef], others: list[SampleRef], fails: Any) -> tuple[list[SampleRef], bool]:
    """The first sample that fails alone, blamed only when another sample (of the micro-batch, else of the step's
    other micro-batches) does not fail alone."""
    tried = batch_refs[:MAX_SAMPLE_TRIES]
    failing = [ref for ref in tried if fails(ref)]
    if failing and (len(failing) < len(tried) or any(not fails(ref) for ref in others[:4])):
        return [failing[0]], True
    return batch_refs, False


def _exception_culprit(repro: Repro, runner: StepRunner, step: int, recorded: dict) -> tuple[list[SampleRef], bool]:
    """A step that raised: the samples that make it raise, and the op that raised called on their inputs."""
    found = localize_exception(runner)
    if found is None:
        raise ReplayError(
            f"step {step} raised {recorded.get('type') or 'an exception'} in the job, but its replay here "
            "does not raise: nothing to reproduce standalone (see `forensics replay` for why)"
        )
    batch_refs = [r for r in runner.session.sample_refs if r.micro_batch == found.micro_batch]
    alone: dict[int, Any] = {}

    def raises(ref: SampleRef) -> bool:
        alone[ref.index] = localize_exception(runner, [ref])
        return alone[ref.index] is not None

    refs, blamed = _first_alone(
        batch_refs, [r for r in runner.session.sample_refs if r.micro_batch != found.micro_batch], raises
    )
    call = (alone.get(refs[0].index) if blamed else None) or found
    if call.op_call is not None:
        op, args, kwargs = call.op_call
        _write_op(repro, op, args, kwargs, raised=f"{call.type}: {call.message}")
    else:
        repro.notes.append(
            f"the {call.type} was not raised by an ATen op in the forward pass (Python code, or the "
            "backward): no op-level script"
        )
    return refs, blamed


def _relative(path: str | Path, directory: Path) -> str:
    """`path` relative to the scripts' directory (they resolve it against their own file, not the working one)."""
    try:
        return os.path.relpath(Path(path).resolve(), directory.resolve())
    except ValueError:  # another drive (Windows): only an absolute path can say where it is
        return str(Path(path).resolve())


def _write_model(
    repro: Repro,
    dump_path: Location,
    dump: Any,
    session: Any,
    refs: list[SampleRef],
    blamed: bool,
    device: str | None,
    trust: bool,
    sys_path: list[str],
    overrides: dict,
) -> None:
    recipe = dump.recipe or {}
    out = repro.directory
    whole = not blamed and len(refs) == len([r for r in session.sample_refs if r.micro_batch == refs[0].micro_batch])
    spec = {
        "dump": str(dump_path) if isinstance(dump_path, RemotePath) else _relative(dump_path, out),
        "dump_absolute": str(dump_path) if isinstance(dump_path, RemotePath) else str(dump_path.resolve()),
        "rank": dump.rank,
        "step": dump.step,
        "device": device or "cpu",
        "micro_batch": refs[0].micro_batch,
        "samples": None if whole else [r.index for r in refs],
        "sample_ids": [r.sample_id for r in refs],
        "blames_sample": blamed,
        "factory": overrides["factory_override"] or recipe.get("factory"),
        "sys_path": [_relative(p, out) for p in sys_path],
        "sys_path_absolute": [str(Path(p).resolve()) for p in sys_path],
        "trust": bool(trust),
        **overrides,
    }
    atomic_write_text(out / MODEL_SPEC, json.dumps(spec, indent=1, default=repr))
    atomic_write_text(out / MODEL_SCRIPT, MODEL_TEMPLATE)
    repro.sample = refs[0].sample_id if blamed else None
    repro.files.update(model_script=str(out / MODEL_SCRIPT), model_spec=str(out / MODEL_SPEC))


# -- the scripts (fixed text: whatever varies is read from the JSON beside them) -------------------------
OP_TEMPLATE = '''#!/usr/bin/env python
"""Standalone reproduction of the first non-finite op of a training step, written by `forensics repro`.

Needs only torch (the inputs are read from op_inputs.safetensors by the few lines below). op.json names the op
and its arguments. It FAILS with an AssertionError (exit code 1) while the op makes NaN/Inf from these inputs (or,
for a step that raised, while the op raises on them), and passes once it does not. Run it from any directory.
"""

import json
import struct
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def load_safetensors(path):
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        raw = bytearray(data[8 + size + start:8 + size + end])
        flat = torch.frombuffer(raw, dtype=DTYPES[meta["dtype"]]) if raw else torch.empty(0, dtype=DTYPES[meta["dtype"]])
        tensors[name] = flat.reshape(meta["shape"])
    return tensors


def decode(node, tensors):
    if "tensor" in node:
        return tensors[node["tensor"]]
    if "list" in node:
        items = [decode(v, tensors) for v in node["list"]]
        return tuple(items) if node.get("tuple") else items
    if "dict" in node:
        return {k: decode(v, tensors) for k, v in node["dict"].items()}
    if "float" in node:
        return float(node["float"])
    if "dtype" in node:
        return getattr(torch, node["dtype"])
    if "device" in node:
        return torch.device(node["device"])
    if "torch" in node:
        return getattr(torch, node["torch"])
    return node["value"]


def main():
    spec = json.loads((HERE / "op.json").read_text())
    tensors = load_safetensors(HERE / "op_inputs.safetensors")
    op = getattr(getattr(getattr(torch.ops, spec["namespace"]), spec["name"]), spec["overload"])
    args, kwargs = decode(spec["args"], tensors), decode(spec["kwargs"], tensors)
    for index, value in enumerate(tensors.values()):
        finite = bool(torch.isfinite(value).all()) if value.is_floating_point() else True
        print(f"input {index}: {value.dtype} {list(value.shape)} finite={finite}"
              + (f" abs-max={value.abs().max().item():.6g}" if value.is_floating_point() and value.numel() else ""))
    if spec.get("raised"):  # the job's step raised here
        try:
            op(*args, **kwargs)
        except Exception as exc:
            raise AssertionError(f"{spec['op']} raised {type(exc).__name__} on these inputs: {exc}") from exc
        print(f"{spec['op']}.{spec['overload']} no longer raises on these inputs (the job's: {spec['raised']})")
        return
    out = op(*args, **kwargs)
    result = out[0] if isinstance(out, (tuple, list)) else out
    kinds = [k for k, bad in (("nan", torch.isnan(result).any()), ("+inf", torch.isposinf(result).any()),
                              ("-inf", torch.isneginf(result).any())) if bool(bad)]
    print(f"{spec['op']}.{spec['overload']}: output {result.dtype} {list(result.shape)}, non-finite: {kinds or 'none'}")
    assert not kinds, f"{spec['op']} made non-finite output ({', '.join(kinds)}) from these inputs"


if __name__ == "__main__":
    main()
'''

MODEL_TEMPLATE = '''#!/usr/bin/env python
"""Reproduction of a failing training step's culprit sample through the model, written by `forensics repro`.

Runs the sample(s) model.json names through the model's pre-step weights read from the dump, with the job's RNG
and autocast, and FAILS with an AssertionError (exit code 1) while the loss is non-finite (or, for a step that
raised, while the step raises). model.json says whether one sample is to blame ("blames_sample"): when every sample
of the micro-batch fails alone, or the run had diverged before this step, no sample is ("why_no_sample") and the
whole micro-batch runs.

Needs torch, forensics (to read the dump) and the model's code: it imports the model factory and the loss that
the dump's recipe names (model.json "factory") with the consent `forensics repro` was given (model.json "trust"),
as `forensics replay` does. The dump and the --path entries are looked for relative to this file first, then where
they were when `forensics repro` wrote it (absolute): run it from any directory, or copy this directory elsewhere.
`--dump PATH` names the dump yourself (a moved or unpacked copy).

Exit codes: 0 the step no longer fails; 1 AssertionError: the failure is reproduced; 2 the reproduction could not
run (the model code or the recipe: one line says why); 3 the dump was not found (one line: pass --dump PATH).
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from forensics.core.errors import DumpNotFoundError, ForensicsError
from forensics.format import open_dump
from forensics.replay.load.samples import select_samples
from forensics.replay.load.session import load_session
from forensics.replay.run.streamed_runner import runner_for

HERE = Path(__file__).resolve().parent
CANNOT_RUN, NO_DUMP = 2, 3  # exit codes (1 is the reproduced failure's AssertionError)


def fail(message, code):
    print(f"model_repro.py: {message}", file=sys.stderr)
    sys.exit(code)


def find(relative, absolute):
    """A path model.json names: relative to this file first, then where it was when the scripts were written."""
    for candidate in (HERE / relative, Path(absolute) if absolute else None):
        if candidate is not None and candidate.exists():
            return candidate
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, default=None, help="the dump (default: where model.json says)")
    args = parser.parse_args()
    spec = json.loads((HERE / "model.json").read_text())
    remote = args.dump is None and "://" in spec["dump"]  # a dump in object storage: read where it is
    path = spec["dump"] if remote else args.dump if args.dump is not None else find(spec["dump"], spec.get("dump_absolute"))
    if not remote and (path is None or not path.exists()):
        tried = str(args.dump) if args.dump is not None else \
            f"{HERE / spec['dump']} nor {spec.get('dump_absolute') or 'its recorded place'}"
        fail(f"the dump is not at {tried}; pass --dump PATH", NO_DUMP)
    absolute = spec.get("sys_path_absolute") or [None] * len(spec["sys_path"])
    sys_path = [str(find(p, a) or HERE / p) for p, a in zip(spec["sys_path"], absolute)]
    try:
        dump = open_dump(path, rank=spec["rank"])
        session = load_session(dump, device=spec["device"], trust=spec["trust"], factory=spec["factory_override"],
                               loss=spec["loss_override"], sys_path=sys_path,
                               factory_kwargs=spec.get("factory_kwargs"), loss_kwargs=spec.get("loss_kwargs"))
    except DumpNotFoundError as exc:
        fail(f"{exc}; pass --dump PATH", NO_DUMP)
    except ForensicsError as exc:
        fail(f"cannot run the reproduction: {exc}", CANNOT_RUN)
    runner = runner_for(session)
    model = session.model.train()
    batch = session.micro_batches[spec["micro_batch"]]
    if spec["samples"] is not None:
        batch = select_samples(batch, spec["samples"])
    runner.restore_rng(spec["micro_batch"])
    what = (f"sample(s) {spec['sample_ids']!r}" if spec["blames_sample"] else
            f"micro-batch {spec['micro_batch'] + 1} (no sample is to blame: {spec['why_no_sample']})")
    try:
        with torch.set_grad_enabled(spec["raises"]), runner.autocast_context():
            loss = session.loss_fn(model, batch)
            if spec["raises"]:
                loss.float().mean().backward()
    except Exception as exc:
        if spec["raises"]:
            raise AssertionError(f"{what} make the step raise {type(exc).__name__}: {exc}") from exc
        raise
    value = float(loss.detach().float().mean())
    print(f"step {spec['step']}, micro-batch {spec['micro_batch'] + 1}, samples {spec['sample_ids']!r}: loss {value}")
    assert spec["raises"] or math.isfinite(value), f"the loss of {what} is {value}"


if __name__ == "__main__":
    main()
'''
