"""Scale: a Llama-shaped model's dump written and replayed to its verdict, against the physical floor measured in the
same run (one row of BENCHMARKS.md "Scale table").

    python -m scripts.bench.replay_scale --hidden 2048 --layers 16 --device cuda:0 --json out.json
    python -m scripts.bench.replay_scale --dump STEP_DIR --device cuda:0   # replay an existing dump (a 7B FSDP2 one:
                                                                            # its step directory, so `cat` reads every rank)

Writes (unless --dump): a LlamaForCausalLM of the given shape, built on the meta device and materialised on the
device with random weights, AdamW moments (zeros, as after a step), one step of `--micro` micro-batches in which
one sample's input embedding holds an inf (a corrupted feature); the Guard dumps it (policy raise). Timed: the
dump stall (`Guard.check` that writes) against a raw writer of the same bytes (os.write from host memory + fsync).
Then `cat` of the dump's files (the second of two: warm cache) and, in fresh processes: `run_replay` to its
verdict (load time from its stage callbacks; passes from the report), and one forward/backward pass of the step
(the median of 3 after one warm-up). Floor = cat time + passes x one pass. Each process reports its peak host RSS
(VmHWM) and peak GPU memory (torch.cuda.max_memory_allocated). JSON out, with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = r"""
import json, statistics, sys, time
def peak_rss_gb():  # VmHWM: this process's own peak
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # kB
import torch
import transformers.models.llama.modeling_llama  # a fixed import cost, outside the timers
from forensics.replay.engine import ReplayOptions, run_replay
from forensics.replay.load.session import load_session
from forensics.replay.run.execute import StepRunner
from forensics.format import open_dump
mode, dump, device, rank = sys.argv[1:5]
rank = int(rank) if rank != "-" else None
cuda = device.startswith("cuda")
if cuda:
    torch.cuda.set_device(torch.device(device))
def sync():
    if cuda:
        torch.cuda.synchronize()
out = {}
if mode == "replay":
    marks, peaks = [], []
    def mark(message):  # each stage's own GPU peak: the peak since the previous stage began
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        marks.append((time.perf_counter(), message))
    start = time.perf_counter()
    report = run_replay(dump, ReplayOptions(device=device, rank=rank), progress=mark)
    out["replay_s"] = time.perf_counter() - start
    if cuda:
        peaks.append(torch.cuda.max_memory_allocated() / 2**30)
        out["gpu_peak_gb"] = max(peaks)
        out["stage_gpu_peak_gb"] = [round(p, 2) for p in peaks[1:]]  # [i]: during stage i (marks[i] to the next)
    loading = next((t for t, m in marks if m.startswith("loading")), start)
    after = next((t for t, m in marks if t > loading and not m.startswith("loading")), None)
    out["load_s"] = (after - loading) if after else None
    out["stages"] = [[round(t - start, 3), m[:80]] for t, m in marks]
    out["verdict"] = report["verdict"]["kind"]
    out["culprits"] = [s["sample_id"] for s in (report.get("culprit") or {}).get("samples") or []]
    out["passes"] = report["timings"]["passes"]
else:
    session = load_session(open_dump(dump, rank=rank), device=device)
    runner = StepRunner(session)
    times = []
    for _ in range(4):
        runner.reset()
        sync()
        t = time.perf_counter()
        runner.run()
        sync()
        times.append(time.perf_counter() - t)
    out["one_pass_s"] = statistics.median(times[1:])
out["peak_rss_gb"] = peak_rss_gb()
out.setdefault("gpu_peak_gb", torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
print(json.dumps(out))
"""


def write_dump(args, directory: Path) -> tuple[Path, float]:
    """The Llama-shaped job's dump; returns (the rank dump, the dump stall in seconds)."""
    import torch
    import transformers

    from forensics.capture import Guard, GuardConfig
    from forensics.core.errors import TrainingFaultError

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    heads = max(1, args.hidden // 128)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 256),
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    with torch.device(device):  # the rotary embedding's buffers are computed, not loaded: build it for real
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # moments exist, as after any real step
        optimizer.state[p]["exp_avg"] = torch.zeros_like(p)
        optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p)
        optimizer.state[p]["step"] = torch.tensor(10.0)
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=str(directory), run_id="scale"))
    generator = torch.Generator().manual_seed(1)
    per = args.batch
    for m in range(args.micro):
        embeds = torch.randn(per, args.seq, args.hidden, generator=generator) * 0.02
        if m == args.micro - 1:
            embeds[per - 1, args.seq // 2] = float("inf")  # one sample's corrupted feature
        batch = {
            "inputs_embeds": embeds.to(device),
            "labels": torch.randint(0, args.vocab, (per, args.seq), generator=generator).to(device),
            "sample_ids": [f"rec-{m * per + i:05d}" for i in range(per)],
        }
        guard.record_batch(batch)
        loss = model(inputs_embeds=batch["inputs_embeds"], labels=batch["labels"]).loss
        guard.record_loss(loss)
        (loss / args.micro).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        guard.check()
        raise SystemExit("the planted fault did not trigger")
    except TrainingFaultError as fault:
        stall = time.perf_counter() - start
        path = fault.dump_path
    guard.close()
    return Path(path), stall


def raw_write(directory: Path, nbytes: int, name: str = "raw.bin") -> float:
    """os.write of `nbytes` from host memory (a 64 MiB buffer, reused) into one file, then fsync."""
    buffer = memoryview(os.urandom(64 << 20))
    path = directory / name
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, buffer[: min(left, len(buffer))])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def raw_write_ranks(directory: Path, nbytes: int, ranks: int) -> float:
    """`ranks` raw writers of `nbytes` each at once (threads: os.write and fsync release the GIL), as the ranks of a
    multi-GPU job on one host write their dumps; the wall time until the last one is done."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(ranks) as pool:
        list(pool.map(lambda r: raw_write(directory, nbytes, f"raw-{r}.bin"), range(ranks)))
    return time.perf_counter() - start


def cat_warm(files: list[Path]) -> float:
    for _ in range(2):  # the second one is timed: warm page cache, as a replay right after a dump sees it
        start = time.perf_counter()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def probe(mode: str, dump: Path, device: str, rank: int | None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(dump), device, "-" if rank is None else str(rank)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))},
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dump", help="replay this dump instead of writing one")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the dump is written")
    parser.add_argument("--device", default="cpu", help="cpu, cuda:N")
    parser.add_argument(
        "--rank",
        type=int,
        help="with --dump of a step directory: the rank to replay (default: the one the replay picks)",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=0, help="default 8/3 x hidden")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches in the step")
    parser.add_argument(
        "--raw-only",
        type=float,
        metavar="GB",
        help="only time --ranks raw writers of this many GB each at once (the baseline of a "
        "multi-GPU job's dump stall, measured beside it)",
    )
    parser.add_argument("--ranks", type=int, default=1, help="with --raw-only: writers at once")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    import torch

    from scripts.bench.common import machine

    result: dict = {"machine": machine(), "device": args.device}
    if args.raw_only:
        seconds = raw_write_ranks(Path(args.dir), int(args.raw_only * 1e9), args.ranks)
        result.update(raw_gb_each=args.raw_only, ranks=args.ranks, raw_write_s=round(seconds, 3))
        print(json.dumps(result))
        return
    if args.dump:
        dump = Path(args.dump)
    else:
        work = Path(tempfile.mkdtemp(dir=args.dir, prefix="fx-scale-"))
        dump, stall = write_dump(args, work)
        result.update(
            shape={k: getattr(args, k) for k in ("hidden", "layers", "intermediate", "vocab", "seq", "batch", "micro")},
            write_stall_s=round(stall, 3),
        )
    files = [p for p in (dump.rglob("*") if dump.is_dir() else [dump]) if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    result["dump_gb"] = round(nbytes / 1e9, 3)
    if not args.dump:
        raw = raw_write(dump.parent, nbytes)
        result.update(raw_write_s=round(raw, 3), write_stall_vs_raw=round(result["write_stall_s"] / raw, 3))
    cat = cat_warm(files)
    replay = probe("replay", dump, args.device, args.rank)
    one_pass = probe("pass", dump, args.device, args.rank)
    floor = cat + replay["passes"] * one_pass["one_pass_s"]
    result.update(
        cat_warm_s=round(cat, 3),
        cat_gb_s=round(nbytes / 1e9 / cat, 3),
        load_s=round(replay["load_s"], 3) if replay["load_s"] else None,
        load_vs_cat=round(cat / replay["load_s"], 3) if replay["load_s"] else None,
        passes=replay["passes"],
        one_pass_s=round(one_pass["one_pass_s"], 4),
        replay_to_verdict_s=round(replay["replay_s"], 3),
        floor_s=round(floor, 3),
        replay_vs_floor=round(replay["replay_s"] / floor, 3),
        verdict=replay["verdict"],
        culprits=replay["culprits"],
        gpu_peak_gb=replay["gpu_peak_gb"] and round(replay["gpu_peak_gb"], 2),
        stage_gpu_peak_gb=replay.get("stage_gpu_peak_gb"),
        gpu_total_gb=round(torch.cuda.get_device_properties(torch.device(args.device)).total_memory / 2**30, 1)
        if args.device.startswith("cuda")
        else None,
        replay_peak_rss_gb=round(replay["peak_rss_gb"], 2),
        stages=replay["stages"],
    )
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
