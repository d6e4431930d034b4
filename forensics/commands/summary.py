"""The human summary of a dump printed by `forensics inspect` (and its --json form): a `DumpSummary`, a tree of
dataclasses like the report's (forensics/report/tree.py), whose `as_dict()` is the --json output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from forensics.format.reader import Dump
from forensics.core.kinds import StateLayout
from forensics.report.tree import CaptureEnv, Node, TriggerBlock, _node, _rows
from forensics.report.wording import clean, fmt_num, fmt_size, mb_phrase
from forensics.core.trigger import detail_words

HISTORY_AROUND_TRIGGER = 12  # steps of history shown before the trigger


@dataclass
class MicroBatchFacts(Node):
    index: Any = None
    sample_ids: list | None = None
    batch_size: Any = None
    loss: Any = None
    unreplayable: list | None = None


@dataclass
class Autocast(Node):
    enabled: Any = None
    device_type: Any = None
    dtype: Any = None


@dataclass
class DumpPrecision(Node):
    param_dtype: Any = None
    autocast: Autocast = _node(Autocast, always=True)
    grad_scaler: Any = None


@dataclass
class RecipeFacts(Node):
    factory: Any = None
    loss: Any = None
    source: Any = None


@dataclass
class Recheck(Node):
    performed: Any = None
    reproduced: Any = None
    original: Any = None
    recomputed: Any = None


@dataclass
class StateFacts(Node):
    layout: Any = None
    tensors: Any = None
    parts_here: Any = None
    copies_of: list | None = None


@dataclass
class WindowFacts(Node):
    first_step: Any = None
    last_step: Any = None
    steps: Any = None


@dataclass
class DataRecipe(Node):
    dataset: Any = None


@dataclass
class DumpSummary(Node):
    """What `forensics inspect` shows of a dump; `as_dict()` is `--json`'s object."""

    path: str | None = None
    run_id: str | None = None
    step: int | None = None
    rank: int | None = None
    world_size: int | None = None
    missing_ranks: list | None = None
    trigger: TriggerBlock = _node(TriggerBlock, always=True)
    micro_batches: list[MicroBatchFacts] = _rows(MicroBatchFacts)
    precision: DumpPrecision = _node(DumpPrecision, always=True)
    recipe: RecipeFacts = _node(RecipeFacts, always=True)
    recheck: Recheck | None = _node(Recheck)
    history_tail: dict | None = None
    total_bytes: int | None = None
    files: dict | None = None
    environment: CaptureEnv = _node(CaptureEnv, always=True)
    format_version: Any = None
    created_at: Any = None
    state: StateFacts | None = _node(StateFacts)
    window: WindowFacts | None = _node(WindowFacts)
    data_recipe: DataRecipe | None = _node(DataRecipe)
    snapshot_step: int | None = None
    state_missing: Any = None
    damaged: list | None = None


def dump_summary(dump: Dump, missing_ranks: list[int], path: str | None = None) -> DumpSummary:
    """A JSON-able summary: the manifest's key facts plus the history tail (reads history.json only).
    `path`: what to call the dump (the archive the user named, not its temporary unpacked directory). `damaged`:
    listed files missing or of another size, and headers that break the rules replay applies (no file is hashed)."""
    history = dump.history()
    tail = {
        key: history.get(key, [])[-HISTORY_AROUND_TRIGGER:]
        for key in ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped")
    }
    m = dump.manifest
    return DumpSummary.parse(
        {
            "path": path or str(dump.path),
            "run_id": m["run_id"],
            "step": dump.step,
            "rank": dump.rank,
            "world_size": dump.world_size,
            "missing_ranks": missing_ranks,
            "trigger": dump.trigger.as_dict(),
            "micro_batches": [
                {k: mb.get(k) for k in ("index", "sample_ids", "batch_size", "loss", "unreplayable")}
                for mb in dump.micro_batches_meta
            ],
            "precision": dump.precision,
            "recipe": dump.recipe,
            "recheck": m.get("recheck"),
            "history_tail": tail,
            "total_bytes": dump.total_size(),
            "files": m["files"],
            "environment": m.get("environment", {}),
            "format_version": m["format_version"],
            "created_at": m["created_at"],
            "state": _state_summary(m),
            "window": m.get("window"),
            "data_recipe": m.get("data_recipe"),
            "snapshot_step": dump.snapshot_step,
            "state_missing": dump.state_missing,
            "damaged": [clean(problem) for problem in dump.size_mismatches() + dump.structure_problems()],
        }
    )


def _state_summary(manifest: dict) -> dict:
    """Full or sharded; for a sharded dump, how much of the whole state this rank holds (from the manifest)."""
    layout = manifest.get("layout")
    if layout is None:
        return {"layout": StateLayout.FULL.value}
    rows = {(f, n): r for f, table in layout["tensors"].items() for n, r in table.items()}
    held = sum(1 for shards in layout["shards"].values() for _ in shards)
    copies_of = sorted({int(c["rank"]) for c in (layout.get("copies") or {}).values()})
    return {"layout": StateLayout.SHARDED.value, "tensors": len(rows), "parts_here": held, "copies_of": copies_of}


def render_damage(summary: DumpSummary | Mapping) -> list[str]:
    """The `DAMAGED:` lines of `forensics inspect` (it prints them on stderr and exits 2)."""
    summary = _parsed(summary)
    return [
        clean(f"DAMAGED: {problem} — `forensics verify` checks every file; replay refuses a damaged essential file")
        for problem in summary.damaged or []
    ]


def _parsed(summary: DumpSummary | Mapping) -> DumpSummary:
    return summary if isinstance(summary, DumpSummary) else DumpSummary.parse(summary)


def render_summary(summary: DumpSummary | Mapping) -> str:
    """The `forensics inspect` text. Micro-batches are counted from 1, as people count them
    ("micro-batch 2 of 2" is JSON index 1); `--json` keeps the 0-based indices."""
    s = _parsed(summary)
    t = s.trigger
    n_mb = len(s.micro_batches)
    lines = [
        f"forensics dump  {s.path}",
        f"  run {s.run_id}  step {s.step}  rank {s.rank} of {s.world_size}"
        + (f"  (missing ranks: {s.missing_ranks})" if s.missing_ranks else ""),
        f"  trigger: {t.kind}  value {fmt_num(t.value, 6)}"
        + (f"  threshold {fmt_num(t.threshold, 6)}" if t.threshold is not None else "")
        + (f"  {mb_phrase(t.micro_batch, n_mb)}" if t.micro_batch is not None else ""),
        f"  {detail_words(t.detail, t.micro_batch)}",
        "",
        f"  micro-batches ({n_mb}, counted from 1):",
    ]
    for mb in s.micro_batches:
        ids = mb.sample_ids or []
        shown = ", ".join(str(i) for i in ids[:8]) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
        lines.append(f"    {mb_phrase(mb.index, n_mb)}: loss {fmt_num(mb.loss, 6)}  samples: {shown}")
        for leaf in mb.unreplayable or []:
            leaf = leaf if isinstance(leaf, dict) else {}
            lines.append(f"        unreplayable leaf {leaf.get('path')} ({leaf.get('type')})")
    tail = s.history_tail if isinstance(s.history_tail, dict) else {}
    columns = ["step", "loss", "grad_norm", "lr"]  # history.json's columns, by name
    columns += [c for c in ("loss_scale", "skipped") if any(v not in (None, False) for v in tail.get(c, []))]
    lines += ["", "  history (last steps):", "    " + "  ".join(f"{c:>10}" for c in columns)]
    for row in zip(*(tail[c] for c in columns)):
        lines.append("    " + "  ".join(f"{fmt_num(v, 6):>10}" for v in row))
    precision, autocast, env, recipe = s.precision, s.precision.autocast, s.environment, s.recipe
    gpus = (
        ", ".join(f"{g.get('name')} ({g.get('sm_count')} SMs)" for g in env.gpus or [] if isinstance(g, dict)) or "none"
    )
    lines += [
        "",
        f"  precision: params {precision.param_dtype}, autocast "
        + (f"{autocast.dtype} on {autocast.device_type}" if autocast.enabled else "off")
        + (", GradScaler on" if precision.grad_scaler else ""),
        f"  recipe: factory {recipe.factory}  loss {recipe.loss}  ({recipe.source or ''})",
        f"  environment: python {env.python}, torch {env.torch}, CUDA {env.cuda}, "
        f"GPUs {gpus}, host {env.hostname}, git {env.git_commit or '-'}",
        f"  job directories: script {clean(str(env.script_dir), 200) if env.script_dir else '-'}, working directory "
        f"{clean(str(env.cwd), 200) if env.cwd else '-'} (replay imports from them only with --trust, after the "
        "standard library and installed packages)",
        f"  size: {fmt_size(s.total_bytes or 0)} in {len(s.files or {})} files; format v{s.format_version}, "
        f"written {s.created_at}",
    ]
    state = s.state or StateFacts.parse({})
    if state.layout == StateLayout.SHARDED:
        lines.append(
            f"  state: sharded — this rank holds {state.parts_here} parts of the {state.tensors} tensors "
            "of the state; replay and verify read the step's other rank dumps too (--shards DIR for "
            "other nodes')"
        )
        if state.copies_of:
            ranks = ", ".join(str(r) for r in state.copies_of)
            lines.append(
                f"  buddy copies: the parts of rank(s) {ranks} too (GuardConfig.dumping.shard_replicas), used where "
                "their own dumps are missing"
            )
    window = s.window
    if window:
        data = s.data_recipe.dataset if s.data_recipe else None
        lines.append(
            f"  flight recorder: steps {window.first_step}..{window.last_step} "
            f"({window.steps} steps); data recipe: {data or 'none (window replay needs one)'}"
        )
    if s.state_missing:
        lines.append(
            f"  pre-step state: MISSING ({s.state_missing}); replay re-executes up to the step from "
            "the host snapshot or --from CHECKPOINT"
        )
    if s.snapshot_step is not None:
        lines.append(
            f"  host snapshot: the state before step {s.snapshot_step} (window replay starts there with --trust)"
        )
    recheck = s.recheck
    if recheck and recheck.performed:
        lines.append(
            f"  in-job re-check: {'reproduced' if recheck.reproduced else 'NOT reproduced'} "
            f"(original {fmt_num(recheck.original, 6)}, recomputed {fmt_num(recheck.recomputed, 6)})"
        )
    return "\n".join(clean(line) for line in lines)  # every value from the dump is shown escaped
