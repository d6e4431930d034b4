"""Streamed replay on one GPU: the same dump replayed unconstrained and under GPU-memory budgets, each in a fresh
process, to the same verdict and sample (the table of BENCHMARKS.md "Streamed replay").

    python -m scripts.bench.replay_stream --dump STEP_DIR --rank 1 --device cuda:0 --budgets none,32GiB,16GiB \
        --json out.json
    python -m scripts.bench.replay_stream --dump RANK_DIR --device cuda:0 --budgets none,quarter:old,quarter

A budget is a size, "quarter" (a quarter of the model's fp32 weights; the least budget the plan takes when that is
too small for the part outside the blocks), or "none"; ":old" runs it with the schedule before issue 53 (no host
cache: every pass reads the dump; one walk over the blocks per pass, passes with a backward alone; the per-layer
table is read from the reproduce pass in both), else the current one (on a CPU with a host cache for every block,
the stand-in for a GPU host's memory: a CPU replay has none by default). The JSON's rows feed
scripts/bench/stream_projection.py (a 70B projection from a measured row).

Each budget runs `run_replay(..., ReplayOptions(memory_budget=B))` in its own process with the CUDA caching allocator
capped at B (`torch.cuda.set_per_process_memory_fraction(B / total)`: an allocation beyond it raises out of memory,
so the budget is enforced, not only planned); the peak is `torch.cuda.max_memory_allocated`. "none" is the normal
replay, uncapped. Columns: budget, GPU peak, replay time (to the verdict, load included), passes, blocks materialised
at once (K) and block reads, the verdict and culprit samples; the last line says whether every row agrees with the
first. `--no-remedies` / `--no-rng-check` are passed to every row alike (one 10-minute device call). Each budgeted row
is compared with the unconstrained row run last before it: `--budgets none,quarter,none,quarter,none,quarter` gives
three pairs and their median (one pair moved 1.95 -> 2.39 x between two calls at 13 B).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

PROBE = r"""
import json, os, sys, time
import faulthandler
if os.environ.get("BENCH_HANG_S"):  # a row that hangs prints every thread's stack to stderr and ends (the row's error)
    faulthandler.dump_traceback_later(float(os.environ["BENCH_HANG_S"]), exit=True)
import torch
import transformers.models.llama.modeling_llama  # a fixed import cost, outside the timers
from forensics.replay.engine import ReplayOptions, run_replay
from forensics.core.sizes import parse_bytes
dump, device, rank, budget, remedies, rng, old = sys.argv[1:8]
cuda = device.startswith("cuda")
schedule = dict(host_cache_bytes=0, block_major=False) if old == "1" else dict(
    host_cache_bytes=None if cuda else 1 << 40)
if os.environ.get("BENCH_HOST_CACHE_BYTES"):  # a row's own host cache size (bytes)
    schedule["host_cache_bytes"] = int(os.environ["BENCH_HOST_CACHE_BYTES"])
if os.environ.get("BENCH_FILL_THREADS"):  # a row's own number of threads page-locking the host cache
    from forensics.replay.load import host_cache
    host_cache.FILL_THREADS = int(os.environ["BENCH_FILL_THREADS"])
limit = None if budget == "none" else parse_bytes(budget)
total = 0
if cuda:  # the CPU runs the same probe (a check of this script), without an enforced cap
    torch.cuda.set_device(torch.device(device))
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    if limit is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), torch.device(device))
marks, cpu_marks = [], []
cpu0 = time.process_time()  # CPU seconds of every thread of this process: steadier than wall time on a shared CPU
def mark(message):
    marks.append((round(time.perf_counter() - start, 2), message[:400]))
    cpu_marks.append(round(time.process_time() - cpu0, 2))
profile = None
if os.environ.get("BENCH_PROFILE"):  # a cProfile of the replay's main thread, top functions by own time
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
start = time.perf_counter()
try:
    report = run_replay(dump, ReplayOptions(device=device, rank=int(rank) if rank != "-" else None,
                                            memory_budget=limit, remedies=remedies == "1", rng_check=rng == "1",
                                            **(schedule if limit is not None else {})),
                        progress=mark)
except Exception as exc:  # the plan's refusal names the least budget: the caller retries with it
    import traceback
    where = "".join(traceback.format_exception(exc)[-8:])[-2500:]  # the last frames, for a row that failed
    print("RESULT " + json.dumps({"budget": budget, "error": str(exc), "where": where}))
    raise SystemExit(0)
out = {"budget": budget, "replay_s": round(time.perf_counter() - start, 2),
       "cpu_s": round(time.process_time() - cpu0, 2), "stage_cpu": cpu_marks,
       "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
       "total_gib": round(total / 2**30, 1),
       "verdict": report["verdict"]["kind"],
       "culprits": [s["sample_id"] for s in (report.get("culprit") or {}).get("samples") or []],
       "module": (report.get("culprit") or {}).get("module"), "passes": report["timings"]["passes"],
       "stream": report.get("stream"), "stages": marks}
if profile is not None:
    import pstats
    profile.disable()
    with open(f"{os.environ['BENCH_PROFILE']}-{budget}.txt", "w") as sink:
        pstats.Stats(profile, stream=sink).sort_stats("tottime").print_stats(45)
        pstats.Stats(profile, stream=sink).sort_stats("cumulative").print_stats(45)
print("RESULT " + json.dumps(out))
"""


def run_one(
    dump: str, device: str, rank: str, budget: str, remedies: bool, rng: bool, env: dict[str, str] | None = None
) -> dict:
    """One row in a fresh process; `budget`: a size or "none", with ":old" for the schedule before issue 53; `env`:
    variables set for that process alone (BENCH_PYSPY=FILE: the row run under `py-spy record`, its samples of every
    thread's native and Python stack written to FILE, collapsed)."""
    size, _, old = budget.partition(":")
    env = {**os.environ, **(env or {})}
    command = [sys.executable, "-c", PROBE, dump, device, rank, size]
    command += ["1" if remedies else "0", "1" if rng else "0", "1" if old == "old" else "0"]
    spy = shutil.which("py-spy", path=os.pathsep.join([os.environ.get("PATH", ""), "/tmp/site/bin"]))
    if env.get("BENCH_PYSPY") and spy:
        command = [spy, "record", "-r", "20", "--threads", "--idle", "--native", "--format", "raw", "-o", env["BENCH_PYSPY"],
                   "--"] + command  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"budget": budget, "error": (proc.stderr or proc.stdout)[-3000:]}
    row = json.loads(line[len("RESULT ") :])
    row["budget"] = budget
    return row


def quarter_of_weights(dump: str, rank: str) -> int:
    """A quarter of the model's weights in fp32 (their elements x 4 bytes, from the dump's tensor headers)."""
    from forensics.format import open_dump
    from forensics.replay.load.build_budget import weights_held

    held = weights_held(open_dump(dump, rank=int(rank) if rank != "-" else None))
    if held is None:
        raise SystemExit(f"{dump} holds no weights to size a budget from")
    return held.elements * 4 // 4


def least_budget(error: str) -> str | None:
    """The least budget a refused plan names ("give --memory-budget 1GiB or more"), None for another error."""
    if "--memory-budget " not in error:
        return None
    return error.split("--memory-budget ")[1].split()[0]


def stage_times(row: dict, clock: str = "wall") -> dict[str, float]:
    """{stage: seconds} of one row: from each stage's progress line to the next one's (the plan's lines, printed
    before the first pass, fold into the stage before them; the last stage runs to the end of the replay); `clock`
    "cpu": the process's CPU seconds instead of wall time."""
    ats = row["stage_cpu"] if clock == "cpu" else [at for at, _ in row["stages"]]
    end_at = row["cpu_s"] if clock == "cpu" else row["replay_s"]
    marks = [
        (at, message)
        for at, (_, message) in zip(ats, row["stages"])
        if not message.startswith(("  ", "streamed replay"))
    ]
    out: dict[str, float] = {}
    for (at, message), (end, _) in zip(marks, marks[1:] + [(end_at, "")]):
        name = message.split(" (")[0].split(" on ")[0].split(" /")[0]
        name = "loading model and step" if name.startswith("loading model") else name
        name = "bisecting samples" if name.startswith("bisecting") else name
        out[name] = round(out.get(name, 0.0) + end - at, 2)
    return out


def print_stage_times(rows: list[dict], clock: str = "wall") -> None:
    """Seconds per stage, one column per budget."""
    if not rows:
        return
    times = [stage_times(r, clock) for r in rows]
    stages = list(dict.fromkeys(name for t in times for name in t))
    print(f"\n| stage ({'CPU ' if clock == 'cpu' else ''}s) | " + " | ".join(r["budget"] for r in rows) + " |")
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


def _spec(size: str, schedule: str) -> str:
    return f"{size}:{schedule}" if schedule else size


def _traffic(stream: dict) -> str:
    """GiB read from the dump, copied host to device, and the floor (each block once)."""
    if "bytes_floor" not in stream:
        return "-"
    return " / ".join(f"{stream[k] / 2**30:.2f}" for k in ("bytes_from_storage", "bytes_host_to_device", "bytes_floor"))


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
    flags = (not args.no_remedies, not args.no_rng_check)
    rows = []
    quarter: str | None = None
    for spec in args.budgets.split(","):
        spec, *sets = spec.strip().split("+")  # quarter+NAME=VALUE: that row's process with NAME set
        env = dict(item.split("=", 1) for item in sets)
        size, _, schedule = spec.partition(":")
        if size == "quarter":
            quarter = quarter or str(quarter_of_weights(args.dump, args.rank))
            size = quarter
        row = run_one(args.dump, args.device, args.rank, _spec(size, schedule), *flags, env=env)
        least = least_budget(row.get("error", ""))
        if least is not None:  # a quarter leaves no room beside the embeddings: the least budget the plan takes
            print(f"{size}: refused ({row['error'][:200]}); the least it takes instead: {least}", flush=True)
            quarter = least if size == quarter else quarter
            size = least
            row = run_one(args.dump, args.device, args.rank, _spec(size, schedule), *flags, env=env)
        row["budget"] += "".join(f"+{name}={value}" for name, value in env.items())  # rows told apart by what they set
        rows.append(row)
        if "error" in row:
            print(f"{row['budget']}: FAILED\n{row['error']}\n{row.get('where', '')}", flush=True)
            continue
        for at, message in row["stages"]:
            print(f"  [{row['budget']} +{at:7.2f}s] {message}", flush=True)
    print(
        "\n| budget | GPU peak (GiB) | replay to verdict (s; CPU s of the process) | passes | walks | blocks at once (K) / of | block reads (from the "
        "dump) | GiB read from the dump / host→device / floor | read ahead used | cast, not read | evicted for memory | "
        "gradients off the device: host GiB (pinned), s making buffers | verdict | culprits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['budget']} | failed | | | | | | | | | | | | |")
            continue
        stream = row.get("stream") or {}
        k = f"{stream.get('blocks_resident')} / {stream.get('blocks')}" if stream else "all"
        reads = f"{stream['block_reads']} ({stream.get('block_reads_from_storage', '-')})" if stream else "-"
        print(
            f"| {row['budget']} | {row['gpu_peak_gib']} | {row['replay_s']} ({row['cpu_s']} CPU) | {row['passes']} | "
            f"{stream.get('walks', '-')} | {k} | {reads} | "
            f"{_traffic(stream)} | {stream.get('read_ahead_used', '-')} | "
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
    by_budget = {r["budget"]: r for r in good}
    base, ratios = None, {}  # each row against the unconstrained row run last before it (pairs: none,B,none,B)
    for row in good:
        if row["budget"] == "none":
            base = row["replay_s"]
            continue
        if base:
            ratios.setdefault(row["budget"], []).append(row["replay_s"] / base)
            print(
                f"{row['budget']}: {row['replay_s'] / base:.2f} x the unconstrained replay's time before it "
                f"(goal <= 2), peak {row['gpu_peak_gib']} GiB"
            )
        old = by_budget.get(row["budget"] + ":old")
        if old is not None:
            print(
                f"{row['budget']}: the current schedule takes {row['replay_s'] / old['replay_s']:.2f} x the old one's time"
            )
    for budget, pairs in ratios.items():
        if len(pairs) > 1:
            print(
                f"{budget}: median {statistics.median(pairs):.2f} x of {len(pairs)} pairs "
                f"({min(pairs):.2f}-{max(pairs):.2f})"
            )
    print(f"same verdict and culprits in every row: {same}")
    for row in good:
        for error in (row.get("stream") or {}).get("joint_backward_errors") or []:
            print(f"{row['budget']}: passes run together raised (split or run alone): {error}")
        for group in (row.get("stream") or {}).get("joint_groups") or []:
            print(f"{row['budget']}: run together: a group of {group}")
    print_stage_times(good)
    if args.device == "cpu":  # a shared CPU's wall time moves with the other jobs' load
        print_stage_times(good, "cpu")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
