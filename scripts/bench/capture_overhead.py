"""Benchmark: step time of the same training loop with and without the Guard, interleaved, as a ratio.

GPU: GPT-2 small (124M), batch 8 x 1024 tokens, bf16 autocast, AdamW, 2 micro-batches per step.
CPU: a small GPT-2 stand-in. Also counts device->host syncs per step with CUDA's sync debug mode.
Modes: plain, logged (loss.item() each step), synced (a NaN check by hand), guarded_no_window (the Guard without
its flight recorder, RecordConfig(window_steps=0)), guarded (the default Guard: with the fused AdamW used on CUDA, the
sync-free check, no sync in check()) and guarded_synchronous (DetectionConfig(sync_free=False): one read in check()).
Usage: python scripts/bench/capture_overhead.py [--rounds 6] [--steps 10]

The two configurations of issue 32 (`--config`), each printing a ratio table (plain, guarded and guarded with
precursors; each mode its own copy of the model and optimizer, so no Guard's hooks sit on another mode's model;
interleaved rounds whose mode order rotates, medians of rounds; the Guard's own host time per step beside them):
  nanogpt: GPT-2 small (124M, dropout 0, nanoGPT's pre-training setting), torch.compile, bf16 autocast, 4 micro-batches
           x 12 x 1024 tokens, fused AdamW, clip_grad_norm_, check(grad_norm=...):
      python -m scripts.bench.capture_overhead --config nanogpt [--rounds 6 --steps 10]
  fsdp2:   FSDP2 (fully_shard per layer, bf16 compute / fp32 reduce) Llama of 1.47 B parameters (hidden 2048, 26
           layers, SwiGLU 5632, vocabulary 32000), AdamW (fused on CUDA), 2 micro-batches x 2 x 1024 tokens per rank:
      torchrun --nproc_per_node=2 -m scripts.bench.capture_overhead --config fsdp2 [--rounds 6 --steps 10]
  host:    the host time a guarded step adds on the CPU, 12 x Linear(256), AdamW, one thread, plain and guarded
           interleaved (15 rounds x 20 steps unless --rounds / --steps say otherwise), and the time inside the Guard:
      python -m scripts.bench.capture_overhead --config host [--micro 4]
`--tiny` shrinks either to a CPU-sized model (a check that the script runs: `--no-compile` on a machine without a
compiler for inductor).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig, RecordConfig
from scripts.bench.common import gpt2, machine, median, sync, timed

STARTED = time.perf_counter()  # --deadline counts from here (building and compiling the models included)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--config",
        choices=("short", "nanogpt", "fsdp2", "host"),
        default="short",
        help="short: the modes below on 2 x 4 x 1024 tokens; nanogpt / fsdp2: issue 32's two steps; "
        "host: the host time a guarded step adds on the CPU (12 x Linear(256))",
    )
    parser.add_argument("--micro", type=int, default=1, help="host: micro-batches per step")
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (checks that the script runs)")
    parser.add_argument("--no-compile", action="store_true", help="nanogpt without torch.compile")
    parser.add_argument("--batch", type=int, default=12, help="nanogpt: sequences per micro-batch (6: a ~70 ms step)")
    parser.add_argument(
        "--foreach", action="store_true", help="nanogpt: foreach AdamW instead of fused (the synchronous check)"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="nanogpt / fsdp2: then trace this many steps of each mode with torch.profiler (host and device time)",
    )
    parser.add_argument(
        "--modes",
        default="",
        help="nanogpt / fsdp2: only these modes, comma-separated (plain always "
        "runs): plain, synced, guarded, synchronous, precursors",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="nanogpt: start no round after this many seconds since the start (compiling included; "
        "--rounds: the most), so that a run under a time limit reports",
    )
    parser.add_argument(
        "--warm-rounds", type=int, default=0, help="nanogpt / fsdp2: interleaved rounds run first and discarded"
    )
    parser.add_argument(
        "--pieces",
        type=int,
        default=0,
        help="nanogpt / fsdp2: then time each piece of the Guard's calls over this many steps (host wall time)",
    )
    parser.add_argument(
        "--pin", action="store_true", help="nanogpt / fsdp2: each local rank on its own share of the host's cores"
    )
    args = parser.parse_args()
    if args.config == "host":
        from scripts.bench.step_ratios import host_cost

        host_cost(15 if args.rounds == 6 else args.rounds, 20 if args.steps == 10 else args.steps, args.micro)
        return
    if args.config != "short":
        from scripts.bench.step_ratios import run_config

        run_config(
            args.config,
            args.rounds,
            args.steps,
            tiny=args.tiny,
            compile_model=not args.no_compile,
            only=tuple(m for m in args.modes.split(",") if m),
            profile=args.profile,
            pin=args.pin,
            batch=args.batch,
            fused=not args.foreach,
            stop_at=STARTED + args.deadline if args.deadline else 0.0,
            pieces=args.pieces,
            warm_rounds=args.warm_rounds,
        )
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size, batch, seq = ("small", 4, 1024) if device == "cuda" else ("tiny", 4, 128)
    micro = 2  # 2 x 4 = 8 sequences per optimizer step
    torch.manual_seed(0)
    model = gpt2(size, device)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    dtype = torch.bfloat16
    data = [
        {
            "input_ids": torch.randint(0, vocab, (batch, seq), device=device),
            "sample_ids": list(range(i * batch, (i + 1) * batch)),
        }
        for i in range(micro)
    ]
    for b in data:
        b["labels"] = b["input_ids"]
    guard = Guard(model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp()))
    synchronous = Guard(
        model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp(), detection=DetectionConfig(sync_free=False))
    )
    no_window = Guard(
        model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp(), recording=RecordConfig(window_steps=0))
    )

    def step(mode: str) -> None:
        guarded = mode in ("guarded", "guarded_synchronous", "guarded_no_window")
        g = {"guarded_synchronous": synchronous, "guarded_no_window": no_window}.get(mode, guard)
        for b in data:
            if guarded:
                g.record_batch(b)
            with torch.autocast(device, dtype=dtype):
                loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
            if guarded:
                g.record_loss(loss)
            (loss / micro).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if mode == "synced":  # a NaN check by hand before the step (as GradScaler / error_if_nonfinite do)
            norm.item()
        if not guarded or g.check(grad_norm=norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mode == "logged":  # what most loops do: log the loss every step (one sync)
            loss.item()

    modes = ("plain", "logged", "synced", "guarded_no_window", "guarded", "guarded_synchronous")
    for mode in modes * 2:  # warm-up: kernels, allocator, the guard's detectors
        step(mode)
    times = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:  # interleaved so drift hits all alike
            times[mode].append(timed(lambda mode=mode: [step(mode) for _ in range(args.steps)], device) / args.steps)
    syncs = {}
    if device == "cuda":
        for mode in modes:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                step(mode)
                torch.cuda.set_sync_debug_mode("default")
            syncs[mode] = sum("synchroniz" in str(w.message) for w in caught)
    sync(device)
    med = {mode: median(times[mode]) for mode in modes}
    print(f"machine: {machine()}")
    print(f"model: GPT-2 {size}, {micro} micro-batches x {batch} x {seq} tokens, bf16 autocast, AdamW, {device}")
    print(f"{args.rounds} interleaved rounds of {args.steps} steps, medians of step time:")
    print(f"flight recorder: {len(guard.window)} steps held, {window_bytes(guard)} bytes of host memory")
    for mode in modes:
        print(
            f"  {mode:<17} {med[mode] * 1e3:8.2f} ms  ratio vs plain {med[mode] / med['plain']:.4f}  "
            f"vs logged {med[mode] / med['logged']:.4f}" + (f"  syncs/step {syncs[mode]}" if syncs else "")
        )


def window_bytes(guard: Guard) -> int:
    """Host bytes the flight recorder holds (RNG tensors and Python RNG tuples; sample ids are references)."""
    import sys

    total = 0
    for entry in guard.window._steps:
        for state in entry.rng:
            total += state.torch_cpu.numel() + sum(t.numel() for t in state.cuda)
            total += sys.getsizeof(state.python[1]) + sum(sys.getsizeof(v) for v in state.python[1])
            if state.numpy is not None:
                total += state.numpy[1].nbytes
    return total


if __name__ == "__main__":
    main()
