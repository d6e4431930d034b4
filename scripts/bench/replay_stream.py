"""Streamed replay on one GPU: the same dump replayed unconstrained and under GPU-memory budgets, each in a fresh
process, to the same verdict and sample (the table of BENCHMARKS.md "Streamed replay").

    python -m scripts.bench.replay_stream --dump STEP_DIR --rank 1 --device cuda:0 --budgets none,32GiB,16GiB \
        --json out.json

Each budget runs `run_replay(..., ReplayOptions(memory_budget=B))` in its own process with the CUDA caching allocator
capped at B (`torch.cuda.set_per_process_memory_fraction(B / total)`: an allocation beyond it raises out of memory,
so the budget is enforced, not only planned); the peak is `torch.cuda.max_memory_allocated`. "none" is the normal
replay, uncapped. Columns: budget, GPU peak, replay time (to the verdict, load included), passes, blocks materialised
at once (K) and block reads, the verdict and culprit samples; the last line says whether every row agrees with the
first. `--no-remedies` / `--no-rng-check` are passed to every row alike (one 10-minute device call).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROBE = r"""
import json, sys, time
import torch
import transformers.models.llama.modeling_llama  # a fixed import cost, outside the timers
from forensics.replay.engine import ReplayOptions, run_replay
from forensics.core.sizes import parse_bytes
dump, device, rank, budget, remedies, rng = sys.argv[1:7]
cuda = device.startswith("cuda")
limit = None if budget == "none" else parse_bytes(budget)
total = 0
if cuda:  # the CPU runs the same probe (a check of this script), without an enforced cap
    torch.cuda.set_device(torch.device(device))
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    if limit is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), torch.device(device))
marks = []
start = time.perf_counter()
report = run_replay(dump, ReplayOptions(device=device, rank=int(rank) if rank != "-" else None, memory_budget=limit,
                                        remedies=remedies == "1", rng_check=rng == "1"),
                    progress=lambda m: marks.append((round(time.perf_counter() - start, 2), m[:120])))
out = {"budget": budget, "replay_s": round(time.perf_counter() - start, 2),
       "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
       "total_gib": round(total / 2**30, 1),
       "verdict": report["verdict"]["kind"],
       "culprits": [s["sample_id"] for s in (report.get("culprit") or {}).get("samples") or []],
       "module": (report.get("culprit") or {}).get("module"), "passes": report["timings"]["passes"],
       "stream": report.get("stream"), "stages": marks}
print("RESULT " + json.dumps(out))
"""


def run_one(dump: str, device: str, rank: str, budget: str, remedies: bool, rng: bool) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, dump, device, rank, budget, "1" if remedies else "0", "1" if rng else "0"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"budget": budget, "error": (proc.stderr or proc.stdout)[-3000:]}
    return json.loads(line[len("RESULT ") :])


def stage_times(row: dict) -> dict[str, float]:
    """{stage: seconds} of one row: from each stage's progress line to the next one's (the plan's lines, printed
    before the first pass, fold into the stage before them; the last stage runs to the end of the replay)."""
    marks = [(at, message) for at, message in row["stages"] if not message.startswith(("  ", "streamed replay"))]
    out: dict[str, float] = {}
    for (at, message), (end, _) in zip(marks, marks[1:] + [(row["replay_s"], "")]):
        name = message.split(" (")[0].split(" on ")[0].split(" /")[0]
        name = "loading model and step" if name.startswith("loading model") else name
        name = "bisecting samples" if name.startswith("bisecting") else name
        out[name] = round(out.get(name, 0.0) + end - at, 2)
    return out


def print_stage_times(rows: list[dict]) -> None:
    """Seconds per stage, one column per budget."""
    if not rows:
        return
    times = [stage_times(r) for r in rows]
    stages = list(dict.fromkeys(name for t in times for name in t))
    print("\n| stage (s) | " + " | ".join(r["budget"] for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for stage in stages:
        print(f"| {stage} | " + " | ".join(f"{t[stage]:.2f}" if stage in t else "-" for t in times) + " |")


def _host(stream: dict) -> str:
    """Gradient bytes held on the host and the time making those buffers (replay/run/stream_blocks.GradStore)."""
    if "gradient_host_bytes" not in stream:
        return "-"
    return (
        f"{stream['gradient_host_bytes'] / 2**30:.1f} ({stream['gradient_pinned_bytes'] / 2**30:.1f}), "
        f"{stream['gradient_host_alloc_seconds']:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", required=True, help="the step (or rank) directory to replay")
    parser.add_argument("--rank", default="-", help="which rank of a step directory")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--budgets", default="none,32GiB,16GiB", help="comma-separated; none = unconstrained")
    parser.add_argument("--no-remedies", action="store_true")
    parser.add_argument("--no-rng-check", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for budget in args.budgets.split(","):
        row = run_one(args.dump, args.device, args.rank, budget.strip(), not args.no_remedies, not args.no_rng_check)
        rows.append(row)
        if "error" in row:
            print(f"{budget}: FAILED\n{row['error']}", flush=True)
            continue
        for at, message in row["stages"]:
            print(f"  [{budget} +{at:7.2f}s] {message}", flush=True)
    print(
        "\n| budget | GPU peak (GiB) | replay to verdict (s) | passes | blocks at once (K) / of | block reads | "
        "read ahead used | cast, not read | evicted for memory | gradients off the device: host GiB (pinned), s making "
        "buffers | verdict | culprits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['budget']} | failed | | | | | | | | | | |")
            continue
        stream = row.get("stream") or {}
        k = f"{stream.get('blocks_resident')} / {stream.get('blocks')}" if stream else "all"
        print(
            f"| {row['budget']} | {row['gpu_peak_gib']} | {row['replay_s']} | {row['passes']} | {k} | "
            f"{stream.get('block_reads', '-')} | {stream.get('read_ahead_used', '-')} | "
            f"{stream.get('blocks_cast_not_read', '-')} | {stream.get('evicted_for_memory', '-')} | {_host(stream)} | "
            f"{row['verdict']} | "
            f"{row['culprits']} |"
        )
    good = [r for r in rows if "error" not in r]
    same = (
        bool(good)
        and len(good) == len(rows)
        and all((r["verdict"], r["culprits"]) == (good[0]["verdict"], good[0]["culprits"]) for r in good)
    )
    base = good[0]["replay_s"] if good and good[0]["budget"] == "none" else None
    for row in good[1:]:
        if base:
            print(
                f"{row['budget']}: {row['replay_s'] / base:.2f} x the unconstrained replay's time "
                f"(goal <= 3), peak {row['gpu_peak_gib']} GiB"
            )
    print(f"same verdict and culprits in every row: {same}")
    print_stage_times(good)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
