"""`forensics repro DUMP -o DIR`: a standalone reproduction of a dump's failure, for whoever must fix it.

Two scripts, each failing (an AssertionError, exit code 1) for as long as the bug is there:

* `op_repro.py` — the first non-finite ATen op, as replay's forward localisation finds it
  (replay/localize/forward_backward.py, `keep_op_inputs`), called on its exact input tensors
  (`op_inputs.safetensors`, read by the script itself: it needs only torch). The inputs are shrunk first: along
  each dimension of the output, the slice that holds a non-finite value is kept wherever the op still makes
  NaN/Inf from the sliced inputs (the one row / sample of a batched op). Written only when the failure shows up
  in the forward pass as an op's output.
* `model_repro.py` — the culprit sample (the first sample of the failing micro-batch that fails alone; else the
  whole micro-batch) run through the model's recorded pre-step state from the dump, under the job's autocast and
  RNG. It needs the model's code: it imports the factory and loss the dump's recipe names (as `forensics replay`
  does, with the --trust that `forensics repro` was given), and forensics to read the dump.

Nothing from the dump reaches a path or the scripts' code: file names are this module's own, the scripts are
fixed text, and what varies (op name, sample ID, dump path) is in `op.json` / `model.json`, read with json.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from forensics.errors import ReplayError
from forensics.format import open_dump
from forensics.format.tensors import safetensors_bytes
from forensics.kinds import TriggerKind
from forensics.fsio import atomic_file, atomic_write_text
from forensics.thirdparty import op_schema
from forensics.trigger import Trigger
from replay.load.samples import SampleRef
from replay.load.session import load_session
from replay.localize.forward_backward import localize_forward
from replay.run.execute import StepRunner
from replay.run.streamed import runner_for

log = logging.getLogger(__name__)

OP_SCRIPT, OP_SPEC, OP_INPUTS = "op_repro.py", "op.json", "op_inputs.safetensors"
MODEL_SCRIPT, MODEL_SPEC = "model_repro.py", "model.json"
MAX_SAMPLE_TRIES = 64  # samples run alone to find the culprit of the failing micro-batch
SHRINK_ROUNDS = 4      # passes over the output's dimensions while slicing still keeps the failure
MAX_OP_INPUT_BYTES = 1 << 30  # op_inputs.safetensors larger than this (an op the shrinking could not cut) is not written


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
        return {"directory": str(self.directory), "files": dict(self.files), "op": self.op, "shrunk": self.shrunk,
                "sample": self.sample, "notes": list(self.notes)}


def write_repro(dump_path: str | Path, out_dir: str | Path, *, device: str | None = "cpu", trust: bool = False,
                factory: str | None = None, loss: str | None = None, sys_path: list[str] | None = None,
                rank: int | None = None) -> Repro:
    """Writes `op_repro.py` (+ its inputs) and `model_repro.py` for the dump at `dump_path` into `out_dir`.

    Args:
        dump_path: the dump (rank dir, step dir or .tar.zst).
        out_dir: where the scripts go (created).
        device, trust, factory, loss, sys_path, rank: as for `forensics replay`.
    Returns:
        Repro: the files written, and notes on what could not be.
    Raises:
        ReplayError: the dump's step does not fail in the forward or backward on replay (or is a precursor dump).
    Example:
        >>> write_repro("dumps/run/step-000000042", "repro")  # doctest: +SKIP
    """
    dump = open_dump(dump_path, rank=rank)
    if Trigger.from_dict(dump.trigger).kind is TriggerKind.PRECURSOR:
        raise ReplayError(f"step {dump.step} is a precursor dump: a healthy step, dumped because per-layer statistics "
                          "kept growing, before anything failed: nothing to reproduce standalone. `forensics replay` "
                          "ranks the statistics that grew; run `forensics repro` on the crash dump that follows")
    session = load_session(dump, device=device, trust=trust, factory=factory, loss=loss, sys_path=sys_path or [])
    runner = runner_for(session)  # a state that does not fit the GPU is streamed (replay/run/streamed.py)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    repro = Repro(out)
    finding = localize_forward(runner, keep_op_inputs=True)
    if finding is not None and finding.op_call is not None:
        _write_op(repro, *finding.op_call)
    else:
        repro.notes.append("no ATen op made the first non-finite value in the forward pass (the batch held it, or it "
                           "appears in the backward): no op-level script")
    refs = _culprit(runner, finding)
    if refs is None:
        raise ReplayError(f"step {dump.step} stays finite in a forward-only replay: nothing to reproduce standalone "
                          "(a gradient or optimizer failure: see `forensics replay`)")
    _write_model(repro, Path(dump_path), dump, session, refs, device, trust, factory, loss, sys_path or [])
    atomic_write_text(out / "repro.json", json.dumps(repro.as_dict(), indent=2, default=repr))
    return repro


def link_report(report_dir: str | Path, repro: Repro) -> dict:
    """Adds the `repro` block to the report in `report_dir` (written by `forensics replay -o`) and rewrites its
    files, so report.json / report.md / report.html link the scripts. Returns the files written."""
    from forensics.report import write_report_files
    from forensics.report.model import load_report

    report = load_report(report_dir)
    report["repro"] = repro.as_dict()
    return write_report_files(report, report_dir)


# -- the op ------------------------------------------------------------------------------------------
def _fails(func: Any, args: tuple, kwargs: dict) -> bool:
    try:
        out = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a slice the op does not accept is simply not a smaller repro
        return False
    result = out[0] if isinstance(out, (tuple, list)) else out
    return isinstance(result, torch.Tensor) and result.is_floating_point() and not bool(torch.isfinite(result).all())


def shrink(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Smaller inputs that still make the op's output non-finite: along each output dimension, every input whose
    same dimension has the output's size is cut to the slice holding the first non-finite output value; a cut is
    kept only when the op still fails on it."""
    from torch.utils._pytree import tree_map

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
            at = int(bad[0, dim])

            def cut(value: Any) -> Any:
                if isinstance(value, torch.Tensor) and value.dim() == result.dim() and value.shape[dim] == size:
                    return value.narrow(dim, at, 1).clone()
                return value

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


def _write_op(repro: Repro, func: Any, args: tuple, kwargs: dict) -> None:
    schema = op_schema(func)
    namespace, _, name = schema.name.partition("::")
    overload = schema.overload_name or "default"
    before = [list(t.shape) for t in _tensors((args, kwargs))]
    try:
        args, kwargs = shrink(func, args, kwargs)
    except Exception:  # noqa: BLE001 - the full inputs are a repro too
        log.warning("forensics repro: shrinking the inputs of %s failed; writing them whole", schema.name, exc_info=True)
    tensors: dict[str, torch.Tensor] = {}
    try:
        spec = {"namespace": namespace, "name": name, "overload": overload, "op": schema.name,
                "args": _encode(args, tensors), "kwargs": _encode(kwargs, tensors)}
    except _Unwritable as exc:
        repro.notes.append(f"{schema.name} takes an argument of type {exc} that cannot be written: no op-level script")
        return
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > MAX_OP_INPUT_BYTES:
        repro.notes.append(f"the inputs of {schema.name} are {size} bytes even after shrinking, over the "
                           f"{MAX_OP_INPUT_BYTES} bytes written: no op-level script")
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
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


# -- the sample through the model -------------------------------------------------------------------
def _culprit(runner: StepRunner, finding: Any) -> list[SampleRef] | None:
    """The first sample of the failing micro-batch that fails alone (forward only), else that whole micro-batch;
    None when the forward of the whole step is finite."""
    if finding is None:
        return None
    refs = runner.session.sample_refs
    index = finding.micro_batch if finding.micro_batch is not None else next(
        (mb for mb in range(len(runner.session.micro_batches))
         if not runner.run([r for r in refs if r.micro_batch == mb], backward=False).loss_finite), 0)
    batch_refs = [r for r in refs if r.micro_batch == index]
    for ref in batch_refs[:MAX_SAMPLE_TRIES]:
        if not runner.run([ref], backward=False).loss_finite:
            return [ref]
    return batch_refs


def _write_model(repro: Repro, dump_path: Path, dump: Any, session: Any, refs: list[SampleRef], device: str | None,
                 trust: bool, factory: str | None, loss: str | None, sys_path: list[str]) -> None:
    recipe = dump.recipe or {}
    whole = len(refs) == len([r for r in session.sample_refs if r.micro_batch == refs[0].micro_batch])
    spec = {"dump": str(dump_path.resolve()), "rank": dump.rank, "step": dump.step, "device": device or "cpu",
            "micro_batch": refs[0].micro_batch, "samples": None if whole else [r.index for r in refs],
            "sample_ids": [r.sample_id for r in refs], "factory": factory or recipe.get("factory"),
            "factory_override": factory, "loss_override": loss, "sys_path": [str(p) for p in sys_path],
            "trust": bool(trust)}
    out = repro.directory
    atomic_write_text(out / MODEL_SPEC, json.dumps(spec, indent=1, default=repr))
    atomic_write_text(out / MODEL_SCRIPT, MODEL_TEMPLATE)
    repro.sample = refs[0].sample_id if len(refs) == 1 else None
    repro.files.update(model_script=str(out / MODEL_SCRIPT), model_spec=str(out / MODEL_SPEC))


# -- the scripts (fixed text: whatever varies is read from the JSON beside them) -------------------------
OP_TEMPLATE = '''#!/usr/bin/env python
"""Standalone reproduction of the first non-finite op of a training step, written by `forensics repro`.

Needs only torch (the inputs are read from op_inputs.safetensors by the few lines below). op.json names the op
and its arguments. It FAILS with an AssertionError (exit code 1) while the op makes NaN/Inf from these inputs,
and passes once it does not.
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
and autocast, and FAILS with an AssertionError (exit code 1) while the loss is non-finite.

Needs torch, forensics (to read the dump) and the model's code: it imports the model factory and the loss that
the dump's recipe names (model.json "factory") with the consent `forensics repro` was given (model.json "trust"),
as `forensics replay` does.
"""

import json
import math
from pathlib import Path

import torch

from forensics.format import open_dump
from replay.load.samples import select_samples
from replay.load.session import load_session
from replay.run.streamed import runner_for

HERE = Path(__file__).resolve().parent


def main():
    spec = json.loads((HERE / "model.json").read_text())
    dump = open_dump(spec["dump"], rank=spec["rank"])
    session = load_session(dump, device=spec["device"], trust=spec["trust"], factory=spec["factory_override"],
                           loss=spec["loss_override"], sys_path=spec["sys_path"])
    runner = runner_for(session)
    model = session.model.train()
    batch = session.micro_batches[spec["micro_batch"]]
    if spec["samples"] is not None:
        batch = select_samples(batch, spec["samples"])
    runner.restore_rng(spec["micro_batch"])
    with torch.no_grad(), runner.autocast_context():
        loss = session.loss_fn(model, batch)
    value = float(loss.detach().float().mean())
    print(f"step {spec['step']}, micro-batch {spec['micro_batch'] + 1}, samples {spec['sample_ids']!r}: loss {value}")
    assert math.isfinite(value), f"the loss of sample(s) {spec['sample_ids']!r} is {value}"


if __name__ == "__main__":
    main()
'''
