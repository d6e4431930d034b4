"""Replay loading: time and peak host memory of `load_session` on a Llama-shaped dump, against `cat` of the
same files (the disk / page-cache limit) measured in the same run.

    python -m scripts.bench.replay_load --dir /tmp/bench --hidden 1024 --layers 12 [--device cpu]

Writes one dump (fp32 weights and AdamW moments of a random Llama-shaped model, written with the dump
writer as the Guard does), then in fresh processes: `cat` of its files (warm cache), the replay load
(verify + build + weights + optimizer metadata + micro-batches; transformers' model module imported before
the clock starts), and a whole `run_replay` to its verdict (its recorded NaN does not reproduce, so the
replay runs the optimizer check, which reads every AdamW moment), each reporting wall time and its own peak
RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PEAK = """
def peak_rss_gb():  # VmHWM: this process's own peak (ru_maxrss would carry the parent's peak across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
"""

LOAD = (
    PEAK
    + """
import json, sys, time
from forensics.format import open_dump
from forensics.replay.load.session import load_session
import transformers.models.llama.modeling_llama  # a fixed import cost (~5 s here), not loading: outside the timer
start = time.perf_counter()
session = load_session(open_dump(sys.argv[1]), device=sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_gb": peak_rss_gb()}))
"""
)

REPLAY = (
    PEAK
    + """
import json, sys, time
from forensics.replay.engine import ReplayOptions, run_replay
import transformers.models.llama.modeling_llama
start = time.perf_counter()
report = run_replay(sys.argv[1], ReplayOptions(device=sys.argv[2], rng_check=False))
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_gb": peak_rss_gb(),
                  "verdict": report["verdict"]["kind"], "optimizer_checked": report.get("optimizer") is not None
                  or "optimizer" in json.dumps(report.get("stages", []))}))
"""
)


def write(directory: Path, hidden: int, layers: int) -> Path:
    import torch
    import transformers

    from forensics.capture import DetectionConfig, Guard, GuardConfig

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        vocab_size=32000,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = Guard(
        model,
        optimizer,
        config=GuardConfig(dump_dir=str(directory), run_id="bench", detection=DetectionConfig(on_nonfinite="skip")),
    )
    ids = torch.randint(0, 32000, (2, 64))
    guard.record_batch({"input_ids": ids, "labels": ids, "sample_ids": ["a", "b"]})
    loss = model(input_ids=ids, labels=ids).loss
    guard.record_loss(loss * float("nan"))
    loss.backward()
    for p in model.parameters():  # moments exist, as after any real step
        optimizer.state[p]["exp_avg"] = torch.zeros_like(p)
        optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p)
        optimizer.state[p]["step"] = torch.tensor(10.0)
    guard.check()
    guard.close()
    return guard.dumps[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/forensics_bench_load")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dump = write(Path(args.dir), args.hidden, args.layers)
    size = sum(p.stat().st_size for p in dump.iterdir())
    subprocess.run(["cat", *map(str, dump.iterdir())], stdout=subprocess.DEVNULL, check=True)  # warm the cache
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, dump.iterdir())], stdout=subprocess.DEVNULL, check=True)
    cat_s = time.perf_counter() - start
    results = {}
    for name, script in (("load", LOAD), ("replay", REPLAY)):
        done = subprocess.run(
            [sys.executable, "-c", script, str(dump), args.device], capture_output=True, text=True, check=True
        )
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    gb = size / 2**30
    load, replay = results["load"], results["replay"]
    print(
        json.dumps(
            {
                "dump_gb": round(gb, 3),
                "cat_warm_gb_s": round(gb / cat_s, 2),
                "load_s": round(load["seconds"], 2),
                "load_gb_s": round(gb / load["seconds"], 3),
                "load_vs_cat": round(cat_s / load["seconds"], 3),
                "load_peak_rss_gb": round(load["peak_rss_gb"], 2),
                "replay_s": round(replay["seconds"], 2),
                "replay_verdict": replay["verdict"],
                "replay_peak_rss_gb": round(replay["peak_rss_gb"], 2),
                "replay_rss_vs_dump": round(replay["peak_rss_gb"] / gb, 2),
                "goal_rss_gb": round(0.25 * gb + 2, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
