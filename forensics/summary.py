"""The human summary of a dump printed by `forensics inspect` (and its --json form)."""

from __future__ import annotations


from forensics.format.reader import Dump
from forensics.kinds import StateLayout

from forensics.report.wording import clean, fmt_num, fmt_size, mb_phrase
from forensics.trigger import trigger_detail

HISTORY_AROUND_TRIGGER = 12  # steps of history shown before the trigger


def dump_summary(dump: Dump, missing_ranks: list[int], path: str | None = None) -> dict:
    """A JSON-able summary: the manifest's key facts plus the history tail (reads history.json only).
    `path`: what to call the dump (the archive the user named, not its temporary unpacked directory). `damaged`:
    listed files missing or of another size, and headers that break the rules replay applies (no file is hashed)."""
    history = dump.history()
    tail = {key: history.get(key, [])[-HISTORY_AROUND_TRIGGER:] for key in ("step", "loss", "grad_norm", "lr",
                                                                             "loss_scale", "skipped")}
    m = dump.manifest
    return {
        "path": path or str(dump.path), "run_id": m["run_id"], "step": dump.step, "rank": dump.rank,
        "world_size": dump.world_size, "missing_ranks": missing_ranks, "trigger": dump.trigger.as_dict(),
        "micro_batches": [{k: mb.get(k) for k in ("index", "sample_ids", "batch_size", "loss", "unreplayable")}
                          for mb in dump.micro_batches_meta],
        "precision": dump.precision, "recipe": dump.recipe, "recheck": m.get("recheck"),
        "history_tail": tail, "total_bytes": dump.total_size(),
        "files": m["files"], "environment": m.get("environment", {}),
        "format_version": m["format_version"], "created_at": m["created_at"],
        "state": _state_summary(m),
        "window": m.get("window"), "data_recipe": m.get("data_recipe"), "snapshot_step": dump.snapshot_step,
        "state_missing": dump.state_missing,
        "damaged": [clean(problem) for problem in dump.size_mismatches() + dump.structure_problems()],
    }


def _state_summary(manifest: dict) -> dict:
    """Full or sharded; for a sharded dump, how much of the whole state this rank holds (from the manifest)."""
    layout = manifest.get("layout")
    if layout is None:
        return {"layout": StateLayout.FULL.value}
    rows = {(f, n): r for f, table in layout["tensors"].items() for n, r in table.items()}
    held = sum(1 for shards in layout["shards"].values() for _ in shards)
    copies_of = sorted({int(c["rank"]) for c in (layout.get("copies") or {}).values()})
    return {"layout": StateLayout.SHARDED.value, "tensors": len(rows), "parts_here": held, "copies_of": copies_of}


def render_damage(summary: dict) -> list[str]:
    """The `DAMAGED:` lines of `forensics inspect` (it prints them on stderr and exits 2)."""
    return [clean(f"DAMAGED: {problem} — `forensics verify` checks every file; replay refuses a damaged essential file")
            for problem in summary.get("damaged") or []]


def render_summary(summary: dict) -> str:
    """The `forensics inspect` text. Micro-batches are counted from 1, as people count them
    ("micro-batch 2 of 2" is JSON index 1); `--json` keeps the 0-based indices."""
    t = summary["trigger"]
    n_mb = len(summary["micro_batches"])
    lines = [
        f"forensics dump  {summary['path']}",
        f"  run {summary['run_id']}  step {summary['step']}  rank {summary['rank']} of {summary['world_size']}"
        + (f"  (missing ranks: {summary['missing_ranks']})" if summary["missing_ranks"] else ""),
        f"  trigger: {t.get('kind')}  value {fmt_num(t.get('value'), 6)}"
        + (f"  threshold {fmt_num(t.get('threshold'), 6)}" if t.get("threshold") is not None else "")
        + (f"  {mb_phrase(t['micro_batch'], n_mb)}" if t.get("micro_batch") is not None else ""),
        f"  {trigger_detail(t)}",
        "",
        f"  micro-batches ({n_mb}, counted from 1):",
    ]
    for mb in summary["micro_batches"]:
        ids = mb.get("sample_ids") or []
        shown = ", ".join(str(i) for i in ids[:8]) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
        lines.append(f"    {mb_phrase(mb['index'], n_mb)}: loss {fmt_num(mb.get('loss'), 6)}  samples: {shown}")
        for leaf in mb.get("unreplayable") or []:
            leaf = leaf if isinstance(leaf, dict) else {}
            lines.append(f"        unreplayable leaf {leaf.get('path')} ({leaf.get('type')})")
    tail = summary["history_tail"]
    columns = ["step", "loss", "grad_norm", "lr"]
    columns += [c for c in ("loss_scale", "skipped") if any(v not in (None, False) for v in tail.get(c, []))]
    lines += ["", "  history (last steps):", "    " + "  ".join(f"{c:>10}" for c in columns)]
    for row in zip(*(tail[c] for c in columns)):
        lines.append("    " + "  ".join(f"{fmt_num(v, 6):>10}" for v in row))
    precision = summary["precision"]
    autocast = precision.get("autocast") or {}
    env = summary["environment"]
    gpus = ", ".join(f"{g.get('name')} ({g.get('sm_count')} SMs)" for g in env.get("gpus") or []
                     if isinstance(g, dict)) or "none"
    recipe = summary["recipe"]
    lines += [
        "",
        f"  precision: params {precision.get('param_dtype')}, autocast "
        + (f"{autocast.get('dtype')} on {autocast.get('device_type')}" if autocast.get("enabled") else "off")
        + (", GradScaler on" if precision.get("grad_scaler") else ""),
        f"  recipe: factory {recipe.get('factory')}  loss {recipe.get('loss')}  ({recipe.get('source', '')})",
        f"  environment: python {env.get('python')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"GPUs {gpus}, host {env.get('hostname')}, git {env.get('git_commit') or '-'}",
        f"  size: {fmt_size(summary['total_bytes'])} in {len(summary['files'])} files; format v{summary['format_version']}, "
        f"written {summary['created_at']}",
    ]
    state = summary.get("state") or {}
    if state.get("layout") == StateLayout.SHARDED:
        lines.append(f"  state: sharded — this rank holds {state['parts_here']} parts of the {state['tensors']} tensors "
                     "of the state; replay and verify read the step's other rank dumps too (--shards DIR for "
                     "other nodes')")
        if state.get("copies_of"):
            ranks = ", ".join(str(r) for r in state["copies_of"])
            lines.append(f"  buddy copies: the parts of rank(s) {ranks} too (GuardConfig.shard_replicas), used where "
                         "their own dumps are missing")
    window = summary.get("window") or {}
    if window:
        data = (summary.get("data_recipe") or {}).get("dataset")
        lines.append(f"  flight recorder: steps {window.get('first_step')}..{window.get('last_step')} "
                     f"({window.get('steps')} steps); data recipe: {data or 'none (window replay needs one)'}")
    if summary.get("state_missing"):
        lines.append(f"  pre-step state: MISSING ({summary['state_missing']}); replay re-executes up to the step from "
                     "the host snapshot or --from CHECKPOINT")
    if summary.get("snapshot_step") is not None:
        lines.append(f"  host snapshot: the state before step {summary['snapshot_step']} (window replay starts there "
                     "with --trust)")
    recheck = summary.get("recheck") or {}
    if recheck.get("performed"):
        lines.append(f"  in-job re-check: {'reproduced' if recheck.get('reproduced') else 'NOT reproduced'} "
                     f"(original {fmt_num(recheck.get('original'), 6)}, recomputed {fmt_num(recheck.get('recomputed'), 6)})")
    return "\n".join(clean(line) for line in lines)  # every value from the dump is shown escaped
