"""Benchmark: time from dump to verdict for one step of 32 samples with one culprit, next to the cost of
the same step under plain `torch.autograd.detect_anomaly` (which names no sample and no layer).

GPU: GPT-2 small (124M), 4 micro-batches x 8 samples x 1024 positions, one sample's input features
corrupted. CPU: a small stand-in. Model construction is timed separately and excluded.
Usage: python scripts/bench/replay_time.py
"""

from __future__ import annotations

import tempfile
import time

import torch

from forensics.capture import Guard, GuardConfig
from forensics.core.errors import TrainingFaultError
from forensics.replay.engine import ReplayOptions, run_replay
from scripts.bench.common import gpt2, machine, sync, timed

SAMPLES, MICRO = 32, 4
CULPRIT = 21


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size, seq = ("small", 1024) if device == "cuda" else ("tiny", 64)
    torch.manual_seed(0)
    model = gpt2(size, device)
    width, vocab = model.config.n_embd, model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    per = SAMPLES // MICRO
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp(), run_id="bench"))

    def batches(step: int, poison: bool) -> list[dict]:
        out = []
        for m in range(MICRO):
            ids = list(range(m * per, (m + 1) * per))
            embeds = torch.randn(per, seq, width, device=device) * 0.02
            if poison and CULPRIT in ids:
                embeds[ids.index(CULPRIT), seq // 2] = float("inf")  # a corrupted feature (e.g. log of 0 upstream)
            out.append(
                {
                    "inputs_embeds": embeds,
                    "labels": torch.randint(0, vocab, (per, seq), device=device),
                    "sample_ids": [f"shard-{step:04d}/rec-{i:05d}" for i in ids],
                }
            )
        return out

    def train_step(data: list[dict]) -> None:
        for b in data:
            guard.record_batch(b)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(inputs_embeds=b["inputs_embeds"], labels=b["labels"]).loss
            guard.record_loss(loss)
            (loss / MICRO).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.check(grad_norm=norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for step in range(3):
        train_step(batches(step, poison=False))
    bad = batches(3, poison=True)
    try:
        train_step(bad)
        raise SystemExit("the planted fault did not trigger")
    except TrainingFaultError as fault:
        dump = fault.dump_path

    # Plain anomaly mode on the same step, same weights (it raises at the first NaN in backward).
    def plain_step(anomaly: bool) -> None:
        try:
            with torch.autograd.detect_anomaly(check_nan=True) if anomaly else torch.enable_grad():
                for b in bad:
                    with torch.autocast(device, dtype=torch.bfloat16):
                        loss = model(inputs_embeds=b["inputs_embeds"], labels=b["labels"]).loss
                    (loss / MICRO).backward()
        except RuntimeError:
            pass
        optimizer.zero_grad(set_to_none=True)

    plain_step(False)
    plain = timed(lambda: plain_step(False), device)
    anomaly = timed(lambda: plain_step(True), device)
    model = optimizer = guard = None  # the job's memory (the closures above hold it too), freed before the replay
    if device == "cuda":
        torch.cuda.empty_cache()

    start = time.perf_counter()
    stages: list[tuple[float, str]] = []
    report = run_replay(
        dump, ReplayOptions(device=device), progress=lambda s: stages.append((time.perf_counter() - start, s))
    )
    sync(device)
    total = time.perf_counter() - start
    loaded = next((t for t, s in stages if "reproduc" in s.lower()), None)
    culprit = report["culprit"]
    print(f"machine: {machine()}")
    print(
        f"step: GPT-2 {size}, {MICRO} micro-batches x {per} samples x {seq} positions, bf16 autocast; culprit {CULPRIT}"
    )
    print(f"plain step (fwd+bwd) {plain:.3f} s; under detect_anomaly {anomaly:.3f} s ({anomaly / plain:.2f}x)")
    print(
        f"replay: {total:.2f} s to verdict in all; model load + construction until reproduction starts: "
        f"{loaded if loaded is not None else float('nan'):.2f} s"
    )
    print(
        f"verdict {report['verdict']['kind']}: samples {[s['sample_id'] for s in culprit['samples']]}, "
        f"module {culprit.get('module')}, op {culprit.get('op')}, phase {culprit.get('phase')}"
    )
    print(f"bisection: {report.get('bisection')}; passes {report.get('timings')}")
    for t, s in stages:
        print(f"  {t:7.2f} s  {s}")


if __name__ == "__main__":
    main()
