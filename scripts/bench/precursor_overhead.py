"""Benchmark: what the precursor monitor costs a healthy training step, from per-step times of the same run.

GPU: GPT-2 small (124M), 2 micro-batches x 4 x 1024 tokens, bf16 autocast, fused AdamW, clip_grad_norm_.
CPU: a small GPT-2 stand-in (4 layers, width 256, 2 x 4 x 128 tokens), AdamW.
Modes: guarded (GuardConfig()), precursors (GuardConfig(precursors=PrecursorConfig()): every 8th step sampled) and
precursors_no_optimizer (PrecursorConfig(optimizer=False): no update-ratio / Adam-floor pass) and
precursors_no_attention (attention=False: no query / key hooks): what each part costs. Each round builds
each mode's Guard afresh (closing a Guard removes its hooks), warms it up and times `--steps` steps one by one
(each ends with a device sync; the Guard's check() syncs every step anyway), marking which were sampled. The
report: per mode the median unsampled and sampled step; a sampled step's cost = sampled - unsampled of the same
run (paired, so the machine's drift cancels); an unsampled step's cost = its median - guarded's; amortised =
(unsampled cost + sampled cost / every) / guarded step — what a job pays on average, the <= 1 % goal.
Then, per mode, the operators dispatched per step beyond `guarded`'s (views left out: on a GPU each of the others
is about one kernel launch; a `_foreach` op is one launch per few dozen tensors), averaged over `every` steps.
--profile: then, under torch.profiler, `every` steps of `guarded` and of every-step sampling: the operators whose
device time (CUDA kernels; CPU time on a CPU) grew most per step — where a sampled step's cost goes.
Usage: python -m scripts.bench.precursor_overhead [--rounds 5] [--steps 32] [--profile]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from capture import Guard, GuardConfig, PrecursorConfig
from scripts.bench.common import gpt2, machine, median, sync

MODES = {"guarded": None, "precursors": PrecursorConfig(),
         "precursors_no_optimizer": PrecursorConfig(optimizer=False),
         "precursors_no_attention": PrecursorConfig(attention=False)}


class CountOps(TorchDispatchMode):
    """Counts dispatched operators that are not views."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False) and func.overloadpacket.__name__ not in ("detach", "alias"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size, batch, seq = ("small", 4, 1024) if device == "cuda" else ("tiny", 4, 128)
    micro = 2
    torch.manual_seed(0)
    model = gpt2(size, device)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    data = [{"input_ids": torch.randint(0, vocab, (batch, seq), device=device),
             "sample_ids": list(range(i * batch, (i + 1) * batch))} for i in range(micro)]

    def step(guard: Guard) -> None:
        for b in data:
            guard.record_batch(b)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(input_ids=b["input_ids"], labels=b["input_ids"]).loss
            guard.record_loss(loss)
            (loss / micro).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.check(grad_norm=norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def fresh(precursors: PrecursorConfig | None) -> Guard:
        return Guard(model, optimizer, config=GuardConfig(dump_dir=tempfile.mkdtemp(), on_nonfinite="continue",
                                                          precursors=precursors))

    # (mode, sampled) -> step times in seconds
    times: dict[tuple[str, bool], list[float]] = {(mode, sampled): [] for mode in MODES for sampled in (False, True)}
    for _ in range(args.rounds):
        for mode, precursors in MODES.items():
            guard = fresh(precursors)
            for _ in range(2):
                step(guard)
            sync(device)
            for _ in range(args.steps):
                sampled = guard.precursors is not None and guard.precursors.stats.active
                begin = time.perf_counter()
                step(guard)
                sync(device)
                times[mode, sampled].append(time.perf_counter() - begin)
            guard.close()
    ops: dict[str, float] = {}
    every = PrecursorConfig().every
    for mode, precursors in MODES.items():
        guard = fresh(precursors)
        with CountOps() as counter:
            for _ in range(every):
                step(guard)
        ops[mode] = counter.count / every
        guard.close()
    base = median(times["guarded", False])
    print(f"machine: {machine()}")
    print(f"model: GPT-2 {size}, {micro} x {batch} x {seq} tokens per step, {args.rounds} rounds x {args.steps} "
          f"steps, every={every}")
    print(f"guarded step: {base * 1e3:.2f} ms (median of {len(times['guarded', False])})")
    print(f"{'mode':<26} {'unsampled':>10} {'sampled':>10} {'sampled cost':>13} {'amortised':>10} {'extra ops':>10}")
    for mode in list(MODES)[1:]:
        plain, sampled = median(times[mode, False]), median(times[mode, True])
        amortised = ((plain - base) + (sampled - plain) / every) / base
        print(f"{mode:<26} {plain * 1e3:7.2f} ms {sampled * 1e3:7.2f} ms {(sampled - plain) * 1e3:7.2f} ms "
              f"{100 * (sampled - plain) / base:4.1f}% {100 * amortised:+9.2f}% {ops[mode] - ops['guarded']:10.1f}")
    if args.profile:
        profiled = {mode: device_time_per_op(lambda g: [step(g) for _ in range(every)], fresh(config), device, every)
                    for mode, config in (("guarded", None), ("sampled", PrecursorConfig(every=1)))}
        print_profile_difference(*profiled.values())


def device_time_per_op(run, guard: Guard, device: str, steps: int) -> dict[str, tuple[float, float, float]]:
    """{operator: (calls, device microseconds, CPU microseconds) per step} of `run(guard)` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    run(guard)  # warm
    with profile(activities=activities) as prof:
        run(guard)
        if device == "cuda":
            torch.cuda.synchronize()
    guard.close()
    table = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue  # a kernel row: its time is also its launching operator's self device time
        micros = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        table[event.key] = (event.count / steps, micros / steps, event.self_cpu_time_total / steps)
    return table


def print_profile_difference(base: dict, other: dict) -> None:
    """The totals and the operators whose device or CPU time grew most (a launch-bound step pays the CPU time)."""
    zero = (0.0, 0.0, 0.0)
    for column, label in ((1, "device"), (2, "CPU (operators' own)")):
        totals = [sum(v[column] for v in table.values()) / 1e3 for table in (base, other)]
        print(f"profile: {label} time per step {totals[0]:.2f} ms guarded, {totals[1]:.2f} ms sampled "
              f"({totals[1] - totals[0]:+.2f} ms)")
    grown = sorted(((max(other.get(k, zero)[1] - base.get(k, zero)[1], other.get(k, zero)[2] - base.get(k, zero)[2]),
                     k) for k in set(base) | set(other)), reverse=True)
    print(f"{'operator':<44} {'extra device us':>15} {'extra CPU us':>12} {'extra calls':>11}")
    for _, key in grown[:20]:
        calls, device_us, cpu_us = (other.get(key, zero)[i] - base.get(key, zero)[i] for i in range(3))
        print(f"{key[:44]:<44} {device_us:15.1f} {cpu_us:12.1f} {calls:11.1f}")


if __name__ == "__main__":
    main()
