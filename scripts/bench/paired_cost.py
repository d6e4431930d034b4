"""Benchmark: the Guard's healthy-step cost on one GPU, resolved to a few tenths of a percent on a noisy machine.

Issue 55's goals (<= 1.005 on a short step, <= 1.01 on the synchronous path) are smaller than the between-round spread
of the interleaved-rounds bench (scripts/bench/step_ratios.py: 26 % on a lent H100). Here, in one process:

- Arms: each trains its own copy of nanoGPT's GPT-2 small (scripts/bench/step_ratios.py nanogpt(): the same initial
  weights and micro-batches, torch.compile, bf16) with its own AdamW. `plain` (fused, no Guard) and `plain_foreach`
  (foreach, no Guard) are the baselines; the arms measured against them (ARMS):
    guarded          fused AdamW, the default GuardConfig (the sync-free check)           vs plain
    synchronous      fused AdamW, DetectionConfig(sync_free=False)                        vs plain
    guarded_foreach  foreach AdamW, the default GuardConfig (it then checks synchronously) vs plain_foreach
    synced           foreach AdamW, `torch.isfinite(norm).item()` by hand (the floor of any exact check before the
                     step: one read)                                                       vs plain_foreach
    toggled          fused AdamW, the default GuardConfig on a copy of its own whose B blocks step the same model and
                     optimizer without calling the Guard (its hooks stay): no difference between two copies can
                     enter, the Guard's hooks are in both                                  vs toggled_off
    plain_copy       a second plain copy (an A/A control: how far two copies differ)      vs plain
  Two estimates of the default's cost that share nothing but the Guard: guarded (two copies) and toggled (one).
- Design: blocks of `--block` steps, arranged in units B X X B (B: the arm's baseline, X: the arm), the units of the
  measured arms interleaved with their order rotating. A unit's ratio is X's two blocks over B's two blocks: a drift
  that is linear over the unit's ~1 s cancels, a slower one never reaches the ratio.
- Timing: a CUDA event on the stream at each step's start, none waited on until the end: a step's time is the
  stream's time from its start to the next step's start, the GPU's work and every gap in which it waited for the host
  (the host time that shows through). No sync between blocks (a sync would add a drain to every block's first step).
  On a CPU the host's clock (the steps run synchronously there).
- Estimate: the median of the units' ratios with a 95 % bootstrap interval (2,000 resamples of the units), and the
  geometric mean with a 95 % t interval beside it; both again without each block's first step (what an arm switch
  might cost a block; the two should agree).
- Then (`--profile N`): N steps of each arm under torch.profiler (CUDA activity only, so the host is not slowed by
  the profiler's per-operator records): kernel time per step against the same steps' stream time; stream minus kernels
  is the time the GPU waited (for the host, or between kernels), and an arm's idle minus its baseline's is how much
  of the Guard's host work shows through. Then (`--pieces N`) the host time of each piece of the Guard
  (scripts/bench/guard_pieces.py), N steps per guarded arm.

    python -m scripts.bench.paired_cost --batch 6 --deadline 200            # on one GPU (gpu_cost.sh)
    python -m scripts.bench.paired_cost --tiny --no-compile --deadline 20   # a CPU dry run of the script
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from forensics.capture import DetectionConfig, Guard, GuardConfig
from scripts.bench.common import machine, median, sync
from scripts.bench.guard_pieces import Pieces
from scripts.bench.step_ratios import median_interval, nanogpt

STARTED = time.perf_counter()  # --deadline counts from here (building and compiling the models included)

# arm -> (fused AdamW, baseline arm, what it checks); the baselines themselves: plain, plain_foreach
ARMS = {
    "guarded": (True, "plain", "the default GuardConfig (sync-free check)"),
    "synchronous": (True, "plain", "DetectionConfig(sync_free=False): one read before optimizer.step()"),
    "guarded_foreach": (False, "plain_foreach", "the default GuardConfig (foreach AdamW: the synchronous check)"),
    "synced": (False, "plain_foreach", "a hand-written isfinite(norm).item() before optimizer.step()"),
    "toggled": (True, "toggled_off", "the default GuardConfig on one copy, called in X blocks, not in B blocks"),
    "plain_copy": (True, "plain", "another plain copy (an A/A control: what two copies differ by)"),
}
BASELINES = {"plain": True, "plain_foreach": False, "toggled_off": True}  # arm -> fused


@dataclass
class Arm:
    name: str
    model: Any
    optimizer: torch.optim.Optimizer
    guard: Guard | None  # called as a loop calls it, untimed (None: no Guard)
    hand_check: bool = False  # synced: the loop reads isfinite(norm) itself


@dataclass
class Clock:
    """Step starts on one timeline: CUDA events on the current stream (read at the end), or host times on a CPU."""

    cuda: bool
    marks: list[Any] = field(default_factory=list)

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self, start: int, end: int) -> float:
        """Seconds from mark `start` to mark `end` (synchronise before reading CUDA marks)."""
        if self.cuda:
            return self.marks[start].elapsed_time(self.marks[end]) / 1e3
        return self.marks[end] - self.marks[start]


@dataclass
class Unit:
    """One B X X B unit: each block's per-step mark indices (the block's end is the next block's first mark)."""

    arm: str
    blocks: list[tuple[str, list[int]]]  # (arm name, the marks of its steps), in run order; the unit's end mark last
    end: int = -1

    def times(self, clock: Clock, skip_first: bool = False) -> tuple[float, float, list[float]]:
        """(the baseline's blocks, the arm's blocks, the arm's step times), seconds."""
        totals = {"base": 0.0, "arm": 0.0}
        steps: list[float] = []
        for index, (name, marks) in enumerate(self.blocks):
            ends = marks[1:] + [self.blocks[index + 1][1][0] if index + 1 < len(self.blocks) else self.end]
            each = [clock.seconds(s, e) for s, e in zip(marks, ends)]
            kept = each[1:] if skip_first and len(each) > 1 else each
            totals["arm" if name == self.arm else "base"] += sum(kept)
            if name == self.arm:
                steps += each
        return totals["base"], totals["arm"], steps


def build(args: argparse.Namespace, device: torch.device, arms: list[str]) -> tuple[dict[str, Arm], Callable, str]:
    make, data, loss_of, words = nanogpt(args.tiny, device, not args.no_compile, args.batch, True)
    dump_dir = tempfile.mkdtemp(prefix="fx-paired-")
    built: dict[str, Arm] = {}
    for name in [*dict.fromkeys(ARMS[a][1] for a in arms if ARMS[a][1] != "toggled_off"), *arms]:
        fused = BASELINES[name] if name in BASELINES else ARMS[name][0]
        model, optimizer = make(fused)
        guard = None
        if name in ("guarded", "synchronous", "guarded_foreach", "toggled"):
            detection = DetectionConfig(sync_free=False if name == "synchronous" else None)
            guard = Guard(model, optimizer, config=GuardConfig(dump_dir=dump_dir, run_id=name, detection=detection))
        built[name] = Arm(name, model, optimizer, guard, hand_check=name == "synced")
        if name == "toggled":  # its baseline: the same model and optimizer stepped without the Guard's calls (its
            # hooks stay: the autocast pre-hook returns at once without a step record, the optimizer's are bookkeeping)
            built["toggled_off"] = Arm("toggled_off", model, optimizer, None)

    def step(arm: Arm) -> None:
        guard = arm.guard
        for ids in data:
            if guard:
                guard.record_batch({"input_ids": ids})
            loss = loss_of(arm.model, ids)
            if guard:
                guard.record_loss(loss)
            (loss / len(data)).backward()
        norm = torch.nn.utils.clip_grad_norm_(arm.model.parameters(), 1.0)
        if arm.hand_check and not torch.isfinite(norm).item():
            return
        if guard is None or guard.check(grad_norm=norm):
            arm.optimizer.step()
        arm.optimizer.zero_grad(set_to_none=True)

    return built, step, words.replace(" (fused)", "").replace(" (foreach)", "")


def run_unit(arm: str, built: dict[str, Arm], step: Callable, clock: Clock, block: int) -> Unit:
    base = ARMS[arm][1]
    unit = Unit(arm, [])
    for name in (base, arm, arm, base):
        marks = []
        for _ in range(block):
            marks.append(clock.mark())
            step(built[name])
        unit.blocks.append((name, marks))
    return unit


def t_interval(logs: list[float]) -> tuple[float, float, float]:
    """The geometric mean of the ratios whose logs are `logs`, with a 95 % t interval (normal beyond 30 units)."""
    mean = statistics.fmean(logs)
    if len(logs) < 3:
        return math.exp(mean), math.nan, math.nan
    t = {3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 8: 2.36, 10: 2.26, 15: 2.14, 20: 2.09, 30: 2.05}
    factor = next((v for k, v in sorted(t.items()) if len(logs) <= k), 1.96)
    half = factor * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def report(units: list[Unit], clock: Clock, arms: list[str], block: int) -> None:
    print(
        f"{'arm':<16} {'vs':<14} {'units':>5} {'step':>9} {'base':>9}  ratio arm / base: median of the units "
        "[95 % bootstrap]; geometric mean [95 % t]; the same without each block's first step"
    )
    for arm in arms:
        mine = [u for u in units if u.arm == arm]
        if len(mine) < 2:
            print(f"{arm:<16} {len(mine)} unit(s): too few")
            continue
        timed = [u.times(clock) for u in mine]
        estimates = []
        for pairs in (timed, [u.times(clock, skip_first=True) for u in mine]):
            ratios = [a / b for b, a, _ in pairs]
            low, high = median_interval(ratios)
            geo, glow, ghigh = t_interval([math.log(r) for r in ratios])
            estimates.append(f"{median(ratios):.4f} [{low:.4f}-{high:.4f}]; {geo:.4f} [{glow:.4f}-{ghigh:.4f}]")
        steps = [s for _, _, each in timed for s in each]
        base = [b / (2 * block) for b, _, _ in timed]
        ratios = [a / b for b, a, _ in timed]
        print(
            f"{arm:<16} {ARMS[arm][1]:<14} {len(mine):>5} {median(steps) * 1e3:6.2f} ms {median(base) * 1e3:6.2f} ms  "
            f"{estimates[0]}  |  without the first: {estimates[1]}"
        )
        print(
            f"  {arm}: its baseline's step over the units {min(base) * 1e3:.2f}-{max(base) * 1e3:.2f} ms (spread "
            f"{100 * (max(base) - min(base)) / median(base):.1f} %); the units' ratios {min(ratios):.4f}-"
            f"{max(ratios):.4f}, quartiles " + "-".join(f"{q:.4f}" for q in statistics.quantiles(ratios, n=4))
        )


def idle_per_step(arm: Arm, step: Callable, steps: int, cuda: bool) -> tuple[float, float]:
    """(stream seconds per step, seconds per step in which a kernel or copy ran) over `steps` steps under
    torch.profiler (CUDA activity only)."""
    if not cuda:
        return math.nan, math.nan
    clock = Clock(True)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as profiler:
        first = clock.mark()
        for _ in range(steps):
            step(arm)
        last = clock.mark()
        torch.cuda.synchronize()
    stream = clock.seconds(first, last) / steps
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in profiler.events()
        if str(getattr(event, "device_type", "")).endswith("CUDA")  # kernels and copies, not the host's records
    )
    busy, reach = 0.0, -math.inf  # the union of the spans (kernels of two streams may overlap), microseconds
    for start, end in spans:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return stream, busy / 1e6 / steps


def rng_capture_exact(device: torch.device) -> str:
    """The Guard's hot-path RNG capture (forensics/core/rng.py RngCapture: a CUDA state shared while its seed and
    offset are unchanged) against a full capture, after draws of each kind on this device: a line for the log."""
    from forensics.core.rng import RngCapture, capture_rng

    capture, checks = RngCapture(), 0
    draws = (
        lambda: None,
        lambda: torch.rand(3, device=device),
        lambda: torch.nn.functional.dropout(torch.ones(64, device=device), 0.5),
        lambda: torch.manual_seed(5),
        lambda: random.random(),
    )
    for draw in draws * 2:
        draw()
        mine, full = capture(), capture_rng()
        same = mine.python == full.python and torch.equal(mine.torch_cpu, full.torch_cpu)
        same = same and len(mine.cuda) == len(full.cuda) and all(map(torch.equal, mine.cuda, full.cuda))
        if not same:
            return f"RNG capture: DIFFERS from a full capture after draw {checks} on {device}"
        checks += 1
    first, second = capture(), capture()
    shared = bool(first.cuda) and first.cuda[0] is second.cuda[0]
    return f"RNG capture: equal to a full capture after {checks} draws on {device}; an unchanged CUDA state shared: {shared}"


class LogCount(logging.Handler):
    """forensics' own warnings and errors during the run (an error in the Guard's hot path is logged, never raised:
    a bench that counts none has timed the Guard doing its work)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def line(self) -> str:
        errors = [r for r in self.records if r.levelno >= logging.ERROR]
        first = f"; the first: {errors[0].getMessage()[:200]}" if errors else ""
        said = dict.fromkeys(r.getMessage()[:90] for r in self.records if r.levelno < logging.ERROR)
        return (
            f"forensics log: {len(errors)} error(s) (want 0), {len(self.records) - len(errors)} warning(s){first}"
            + "".join(f"\n  warned: {message}" for message in list(said)[:6])
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arms", default="guarded,toggled,guarded_foreach,synced", help=f"comma-separated, of {list(ARMS)}"
    )
    parser.add_argument("--batch", type=int, default=6, help="sequences per micro-batch (6: ~70-90 ms on an H100)")
    parser.add_argument("--block", type=int, default=3, help="steps per block (a unit is 4 blocks)")
    parser.add_argument("--units", type=int, default=10_000, help="the most units (--deadline usually ends it)")
    parser.add_argument("--deadline", type=float, default=0.0, help="start no unit after this many seconds")
    parser.add_argument(
        "--warm",
        type=int,
        default=40,
        help="steps of each guarded arm first (compile, allocator, detectors); a plain one a quarter",
    )
    parser.add_argument("--warm-units", type=int, default=1, help="units of each arm run first and discarded")
    parser.add_argument("--profile", type=int, default=0, help="then this many steps of each arm under the profiler")
    parser.add_argument("--pieces", type=int, default=0, help="then the Guard's pieces over this many steps")
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (checks that the script runs)")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    print(rng_capture_exact(device), flush=True)
    logged = LogCount()
    logging.getLogger("forensics").addHandler(logged)
    built, step, words = build(args, device, arms)
    for arm in built.values():  # a Guard's detectors warm up over 32 checks (then the sync-free check's spike
        # operators join): the guarded arms run `--warm` steps, the plain ones a quarter (compile, allocator)
        for _ in range(args.warm if arm.guard is not None else 0 if arm.name == "toggled_off" else args.warm // 4):
            step(arm)
    sync(str(device))
    print(f"machine: {machine()}")
    print(f"model: {words}; device {device}; compiled and warmed in {time.perf_counter() - STARTED:.0f} s")
    gc.collect()
    gc.freeze()  # the models' objects leave the collector's walks (a walk landing in one arm's block counts there)
    clock = Clock(cuda)
    for _ in range(args.warm_units):
        for arm in arms:
            run_unit(arm, built, step, clock, args.block)
    print("the rounds begin", flush=True)  # (a log marker: a recompilation after it lands in a unit)
    units: list[Unit] = []
    order = list(arms)
    began = time.perf_counter()
    while len(units) < args.units and not (args.deadline and time.perf_counter() - STARTED > args.deadline):
        for arm in order:
            unit = run_unit(arm, built, step, clock, args.block)
            unit.end = len(clock.marks)  # the next mark: the next unit's first step, or the closing one
            units.append(unit)
        order = order[1:] + order[:1]  # no arm always follows the same one
    clock.mark()  # the last unit's end
    sync(str(device))
    print(
        f"{len(units)} units (B X X B, {args.block} steps a block) in {time.perf_counter() - began:.0f} s, "
        f"the arms' units interleaved, order rotating"
    )
    report(units, clock, arms, args.block)
    print(logged.line())
    for name, arm in built.items():
        if arm.guard is not None and arm.guard.checks.sync_free is not None:
            print(f"  {name}: sync-free check {'on' if arm.guard.checks.sync_free.active() else 'off'}")
        if arm.guard is not None and arm.guard.dumps:  # a spike held back and dumped: an outlier unit (or two)
            print(f"  {name}: {len(arm.guard.dumps)} dump(s) written during the run (spikes the Guard caught)")
    if args.profile and not cuda:
        print("--- GPU idle per step: no GPU here")
    if args.profile and cuda:
        print(f"--- GPU idle per step, {args.profile} steps of each arm under torch.profiler (CUDA activity only)")
        idle = {}
        for name, arm in built.items():
            try:
                stream, busy = idle_per_step(arm, step, args.profile, cuda)
            except Exception as exc:  # noqa: BLE001 - the ratios are printed already
                print(f"  {name}: the profiler failed ({type(exc).__name__}: {exc})")
                continue
            idle[name] = stream - busy
            print(
                f"  {name:<16} stream {stream * 1e3:8.2f} ms  kernels {busy * 1e3:8.2f} ms  idle {idle[name] * 1e3:7.3f} ms"
            )
        for arm in arms:
            if arm in idle and ARMS[arm][1] in idle:
                print(
                    f"  {arm}: idle beyond {ARMS[arm][1]}'s {1e3 * (idle[arm] - idle[ARMS[arm][1]]):+.3f} ms per step"
                )
    for name in arms if args.pieces else ():
        guard = built[name].guard
        if guard is None:
            continue
        watch = Pieces(guard, model_hooks=args.no_compile)
        sync(str(device))
        for _ in range(args.pieces):
            step(built[name])
        sync(str(device))
        print(
            f"{name}: the Guard's pieces, host time per step over {args.pieces} steps (a piece includes those under it)"
        )
        print(watch.table(args.pieces))
        watch.remove()
    for arm in built.values():
        if arm.guard is not None:
            arm.guard.close()


if __name__ == "__main__":
    random.seed(0)
    main()
