"""Benchmark: what the precursor monitor costs a healthy training step, from per-step times of the same run.

GPU: GPT-2 small (124M), bf16 autocast, fused AdamW, clip_grad_norm_; by default 2 micro-batches x 4 x 1024 tokens
(a short step: the monitor's cost is per sampled step, not per token, so this is near its worst case);
`--micro 5 --batch 12` is the step nanoGPT trains GPT-2 small with on each of 8 GPUs (5 x 12 x 1024 tokens).
CPU: a small GPT-2 stand-in (4 layers, width 256, 2 x 4 x 128 tokens), AdamW.
Modes: guarded (GuardConfig()), precursors (GuardConfig(precursors=PrecursorConfig()): every 8th step sampled) and
precursors_no_optimizer (PrecursorConfig(optimizer=False): no update-ratio / Adam-floor pass) and
precursors_no_attention (attention=False: no query / key hooks): what each part costs. Each round builds
each mode's Guard afresh (closing a Guard removes its hooks), warms it up and times `--steps` steps one by one
(each ends with a device sync; the Guard's check() syncs every step anyway), marking which were sampled. The
report: per mode the median unsampled, sampled and "reading" step (the one after a sampled step, whose check() reads
and judges the sampled step's row); each one's cost = its median - the unsampled median of the same run (paired, so
the machine's drift cancels); amortised = (sampled cost + reading cost) / every / guarded step — what a job pays on
average, the <= 1 % goal — with a negative cost (noise: ~20 steps of each kind) counted as 0. The unsampled steps' difference to `guarded` (another Guard, timed at another moment) is
shown apart: there each hook returns after one flag check and nothing is dispatched (the extra-ops column), so what
it shows is the machine's drift between modes.
Then, per mode, the operators dispatched per step beyond `guarded`'s (views left out: on a GPU each of the others
is about one kernel launch; a `_foreach` op is one launch per few dozen tensors), averaged over `every` steps.
--profile: then, under torch.profiler, `every` steps of `guarded` and of every-step sampling: the operators whose
device time (CUDA kernels; CPU time on a CPU) grew most per step — where a sampled step's cost goes.
Usage: python -m scripts.bench.precursor_overhead [--rounds 5] [--steps 32] [--micro 2 --batch 4] [--modes all|precursors]
       [--profile]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig, PrecursorConfig
from forensics.core.thirdparty import TorchDispatchMode
from scripts.bench.common import gpt2, machine, median, sync

MODES = {
    "guarded": None,
    "precursors": PrecursorConfig(),
    "precursors_no_optimizer": PrecursorConfig(optimizer=False),
    "precursors_no_attention": PrecursorConfig(attention=False),
}


class CountOps(TorchDispatchMode):
    """Counts dispatched operators that are not views."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False) and func.overloadpacket.__name__ not in ("detach", "alias"):
            self.count += 1
        return func(*args, **(kwargs or {}))


UNSAMPLED, SAMPLED, READING = KINDS = ("unsampled", "sampled", "reading")


def step_kind(guard: Guard) -> str:
    """What the next step does for the monitor: measures (sampled), reads and judges the last sampled step's row
    (reading), or neither."""
    monitor = guard.precursors
    if monitor is None:
        return UNSAMPLED
    return SAMPLED if monitor.stats.active else READING if monitor.pending_row() is not None else UNSAMPLED


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument(
        "--modes",
        choices=("all", "precursors"),
        default="all",
        help="precursors: guarded and the default monitor only (a long step)",
    )
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size, batch, seq = ("small", args.batch, 1024) if device == "cuda" else ("tiny", args.batch, 128)
    micro = args.micro
    modes = MODES if args.modes == "all" else {m: MODES[m] for m in ("guarded", "precursors")}
    torch.manual_seed(0)
    model = gpt2(size, device)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    data = [
        {
            "input_ids": torch.randint(0, vocab, (batch, seq), device=device),
            "sample_ids": list(range(i * batch, (i + 1) * batch)),
        }
        for i in range(micro)
    ]

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
        return Guard(
            model,
            optimizer,
            config=GuardConfig(
                dump_dir=tempfile.mkdtemp(), precursors=precursors, detection=DetectionConfig(on_nonfinite="continue")
            ),
        )

    # (mode, kind of step) -> step times in seconds
    times: dict[tuple[str, str], list[float]] = {(mode, kind): [] for mode in modes for kind in KINDS}
    for _ in range(args.rounds):
        for mode, precursors in modes.items():
            guard = fresh(precursors)
            for _ in range(2):
                step(guard)
            sync(device)
            for _ in range(args.steps):
                kind = step_kind(guard)
                begin = time.perf_counter()
                step(guard)
                sync(device)
                times[mode, kind].append(time.perf_counter() - begin)
            guard.close()
    ops: dict[str, float] = {}
    every = PrecursorConfig().every
    for mode, precursors in modes.items():
        guard = fresh(precursors)
        with CountOps() as counter:
            for _ in range(every):
                step(guard)
        ops[mode] = counter.count / every
        guard.close()
    base = median(times["guarded", UNSAMPLED])
    print(f"machine: {machine()}")
    print(
        f"model: GPT-2 {size}, {micro} x {batch} x {seq} tokens per step, {args.rounds} rounds x {args.steps} "
        f"steps, every={every}"
    )
    print(f"guarded step: {base * 1e3:.2f} ms (median of {len(times['guarded', UNSAMPLED])})")
    print(
        f"{'mode':<26} {'unsampled':>10} {'sampled (cost)':>22} {'reading (cost)':>22} {'amortised':>10} "
        f"{'unsampled - guarded':>20} {'extra ops':>10}"
    )
    for mode in list(modes)[1:]:
        plain, sampled, reading = (median(times[mode, kind]) for kind in KINDS)
        amortised = (max(sampled - plain, 0) + max(reading - plain, 0)) / every / base
        print(
            f"{mode:<26} {plain * 1e3:7.2f} ms {sampled * 1e3:8.2f} ms ({(sampled - plain) * 1e3:5.2f} ms) "
            f"{reading * 1e3:8.2f} ms ({(reading - plain) * 1e3:5.2f} ms) {100 * amortised:9.2f}% "
            f"{100 * (plain - base) / base:+19.2f}% {ops[mode] - ops['guarded']:10.1f}"
        )
    if args.profile:
        profiled = {
            mode: device_time_per_op(lambda g: [step(g) for _ in range(every)], fresh(config), device, every)
            for mode, config in (("guarded", None), ("sampled", PrecursorConfig(every=1)))
        }
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
        print(
            f"profile: {label} time per step {totals[0]:.2f} ms guarded, {totals[1]:.2f} ms sampled "
            f"({totals[1] - totals[0]:+.2f} ms)"
        )
    grown = sorted(
        (
            (max(other.get(k, zero)[1] - base.get(k, zero)[1], other.get(k, zero)[2] - base.get(k, zero)[2]), k)
            for k in set(base) | set(other)
        ),
        reverse=True,
    )
    print(f"{'operator':<44} {'extra device us':>15} {'extra CPU us':>12} {'extra calls':>11}")
    for _, key in grown[:20]:
        calls, device_us, cpu_us = (other.get(key, zero)[i] - base.get(key, zero)[i] for i in range(3))
        print(f"{key[:44]:<44} {device_us:15.1f} {cpu_us:12.1f} {calls:11.1f}")


if __name__ == "__main__":
    main()
